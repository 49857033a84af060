"""Which tensors are alive at the peak of one forward+backward, without running a kernel.

Runs ``chunk_dplr_delta_rule`` forward+backward (initial and final state) on the meta device,
where every op allocates only its outputs, as the GPU kernels do, and tracks the bytes of every
tensor an op creates until it is freed.  Prints the peak above the inputs and cotangents (what
the benchmark's ``*_peak_mb`` counts), the op it happens in, and the tensors alive there.
Without checkpointing it reproduces the H200's measured peaks of the design shape within 1 MB
(3129 / 2844 / 3104 MB at chunk 16 / 32 / 64); under a checkpoint policy it reads
lower than the GPU does, so it takes no policy.
Usage: python tools/peak_model.py [--B 8 --T 4096 --H 32 --D 64 --chunk 16]
"""
from __future__ import annotations

import argparse
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_dplr
from torch_dplr.testing import RWKV7_BOUND


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor an op creates (not views of its inputs) while it lives."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.peak_op = None
        self.peak_tensors: list = []
        self._alive: dict[int, tuple] = {}

    def _track(self, t: torch.Tensor, label: str) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return
        key = id(t)
        self.live += nbytes
        self._alive[key] = (nbytes, label, tuple(t.shape), t.dtype)

        def freed():
            self.live -= nbytes
            self._alive.pop(key, None)
        weakref.finalize(t, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {a.untyped_storage()._cdata for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor)}
        for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._track(t, f"{func.__name__}[{i}]")
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, func.__name__
            self.peak_tensors = sorted(self._alive.values(), key=lambda r: -r[0])
        return out


def main():
    p = argparse.ArgumentParser()
    for name, default in (("B", 8), ("T", 4096), ("H", 32), ("D", 64), ("chunk", 16)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    B, T, H, D = args.B, args.T, args.H, args.D

    def data(dtype=torch.bfloat16):
        return torch.empty(B, T, H, D, device="meta", dtype=dtype)

    leaves = [data().requires_grad_() for _ in range(5)] + [data(torch.float32).requires_grad_()]
    h0 = torch.empty(B, H, D, D, device="meta").requires_grad_()
    do, dht = data(), torch.empty(B, H, D, D, device="meta")
    counter = LiveBytes()
    with counter:
        o, ht = torch_dplr.chunk_dplr_delta_rule(
            *leaves, initial_state=h0, output_final_state=True, chunk_size=args.chunk,
            lower_bound=RWKV7_BOUND, scale=1.0)
        torch.autograd.grad([o, ht], [*leaves, h0], [do, dht])
    print(f"B{B} T{T} H{H} D{D} chunk {args.chunk}: peak {counter.peak / 1e6:.0f} MB above the "
          f"inputs and cotangents, in {counter.peak_op}; alive there:")
    for nbytes, label, shape, dtype in counter.peak_tensors:
        print(f"  {nbytes / 1e6:9.1f} MB  {label:28s} {list(shape)} {str(dtype).replace('torch.', '')}")


if __name__ == "__main__":
    main()
