"""Benchmark inputs, drawn on the device: one set serves every library, chunk size and mode.

The recipe is :func:`torch_dplr.testing.make_inputs`' (bf16 q, k, v, ``a = -kk``,
``b = kk·iclr``; fp32 gates from :func:`~torch_dplr.testing.make_gates`; fp32 initial state),
but drawn with a device generator: make_inputs draws on the CPU, which at the design shape costs
seconds of host time per set.  Varlen lengths follow ``../shared/bench``'s anchors: lengths
proportional to ``rand(N) + 0.35`` from ``torch.Generator().manual_seed(17 + N)``.
"""
from __future__ import annotations

import dataclasses

import torch

from torch_dplr.testing import make_gates

from .cells import Shape


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    gk: torch.Tensor
    h0: torch.Tensor  # [N, H, K, V] fp32
    do: torch.Tensor  # output gradient, same dtype as v
    dht: torch.Tensor  # final-state gradient, fp32
    cu_seqlens: torch.Tensor | None  # int64 on the device
    cu_seqlens_cpu: torch.Tensor | None

    def leaves(self) -> "Inputs":
        """A copy whose q, k, v, a, b, gk, h0 require grad (for forward+backward cells)."""
        grads = {n: getattr(self, n).detach().requires_grad_() for n in "q k v a b gk h0".split()}
        return dataclasses.replace(self, **grads)


def varlen_offsets(N: int, T: int) -> torch.Tensor:
    """int64 ``cu_seqlens`` [N+1] splitting T tokens into N non-empty sequences."""
    if not 1 <= N <= T:
        raise ValueError(f"cannot split {T} tokens into {N} non-empty sequences")
    weights = torch.rand(N, generator=torch.Generator().manual_seed(17 + N), dtype=torch.float64) + 0.35
    lengths = (weights / weights.sum() * (T - N)).floor().long() + 1
    lengths[-1] += T - lengths.sum()
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


def make(shape: Shape, gates: str, device, dtype=torch.bfloat16, seed=0) -> Inputs:
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, D = shape.B, shape.T, shape.H, shape.D

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device)

    kk = torch.nn.functional.normalize(randn(B, T, H, D), dim=-1)
    iclr = torch.sigmoid(randn(B, T, H, D))
    tensors = dict(q=randn(B, T, H, D), k=randn(B, T, H, D) * D ** -0.5, v=randn(B, T, H, D),
                   a=-kk, b=kk * iclr, do=randn(B, T, H, D))
    tensors = {n: x.to(dtype) for n, x in tensors.items()}
    del kk, iclr
    cu = varlen_offsets(shape.N, T) if shape.N is not None else None
    return Inputs(**tensors, gk=make_gates((B, T, H, D), gates, gen, device),
                  h0=randn(shape.num_states, H, D, D), dht=randn(shape.num_states, H, D, D),
                  cu_seqlens=None if cu is None else cu.to(device), cu_seqlens_cpu=cu)
