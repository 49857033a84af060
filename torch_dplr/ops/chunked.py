"""Glue between the ops' ``[B, T, H, D]`` tensors and the reference stages' chunk-major layout."""
from __future__ import annotations

import contextlib
import functools

import torch

from ..reference.layout import chunk_layout, sequence_index
from .shapes import acc_dtype


class ChunkedView:
    """Reads inputs as ``[slots, H, C, D]`` in the compute dtype and writes results back."""

    def __init__(self, like: torch.Tensor, cu_seqlens: torch.Tensor, chunk_size: int):
        B, T = like.shape[:2]
        self.layout = chunk_layout(B, T, chunk_size, cu_seqlens, like.device)
        self.dtype = acc_dtype(like.dtype)

    def read(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.to_chunks(x, self.dtype).transpose(1, 2)

    def read_padded(self, x: torch.Tensor) -> torch.Tensor:
        """Like :meth:`read` with one extra all-zero slot at the end (the state pass's pad)."""
        return self.layout.to_chunks(x, self.dtype, zero_slot=True).transpose(1, 2)

    def read_slots(self, x: torch.Tensor, pad: bool = False) -> torch.Tensor:
        """Per-chunk tensors ``[B, slots, ...]`` -> ``[slots (+1), ...]`` in the compute dtype."""
        flat = x.reshape(-1, *x.shape[2:]).to(self.dtype)
        return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])]) if pad else flat

    def write(self, out: torch.Tensor, xc: torch.Tensor) -> torch.Tensor:
        """``[slots, H, C, D]`` (extra pad slots ignored) -> caller-allocated ``out [B, T, H, D]``."""
        xc = xc[: self.layout.num_slots].transpose(1, 2)
        return self.layout.from_chunks(xc, out)

    def write_slots(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out.view(-1, *out.shape[2:]).copy_(x[: self.layout.num_slots])
        return out


class SequenceView:
    """Reads ``[B, T, H, D]`` as per-sequence steps ``[N, L, H, D]`` for the per-token path."""

    def __init__(self, like: torch.Tensor, cu_seqlens: torch.Tensor, reverse: bool):
        B, T = like.shape[:2]
        self.num_tokens = B * T
        self.index = sequence_index(B, T, cu_seqlens, reverse, like.device)
        self.valid = self.index < self.num_tokens
        self.dtype = acc_dtype(like.dtype)

    def read(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(self.num_tokens, *x.shape[2:]).to(self.dtype)
        return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[self.index]

    def write(self, out: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        out.view(self.num_tokens, *out.shape[2:]).index_copy_(
            0, self.index[self.valid], xs[self.valid].to(out.dtype))
        return out


def start_state(state: torch.Tensor, present: bool, shape, dtype, device) -> torch.Tensor:
    """A state input in the compute dtype, or zeros where its size-0 sentinel stands."""
    return state.to(dtype) if present else torch.zeros(shape, dtype=dtype, device=device)


def without_autocast(kernel):
    """Op bodies compute in their own dtypes: a caller's autocast must not reach inside."""
    @functools.wraps(kernel)
    def run(*args, **kwargs):
        active = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if not active:
            return kernel(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device_type in active:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            return kernel(*args, **kwargs)
    return run
