"""Varlen chunk tables built on the device from ``cu_seqlens``: no host sync, fixed sizes.

GPU kernels over chunk slots read ``chunk_start``/``chunk_len`` (a slot past the last real
chunk has length 0 and is skipped); kernels over sequences read ``cu_seqlens`` and
``seq_chunk_offsets`` (slot of each sequence's first chunk).  Sizes depend only on shapes:
``slots = ceil(T/C) + N - 1``, the same upper bound the per-chunk outputs use.
"""
from __future__ import annotations

import torch

from ..reference.layout import chunk_slots_per_batch


def varlen_chunk_tables(cu_seqlens: torch.Tensor, T: int, chunk_size: int):
    """Returns int32 ``(chunk_start [slots], chunk_len [slots], seq_chunk_offsets [N+1])``."""
    cu = cu_seqlens.to(torch.int64)
    N = cu.shape[0] - 1
    slots = chunk_slots_per_batch(T, chunk_size, N)
    lens = cu[1:] - cu[:-1]
    nchunks = (lens + chunk_size - 1) // chunk_size
    ends = torch.cumsum(nchunks, 0)
    offsets = torch.cat([ends.new_zeros(1), ends])
    slot = torch.arange(slots, device=cu.device)
    seq = torch.searchsorted(ends, slot, right=True).clamp_max(N - 1)
    start = cu[seq] + (slot - offsets[seq]) * chunk_size
    length = (cu[seq + 1] - start).clamp(0, chunk_size)
    length = torch.where(slot < ends[-1], length, 0)
    return start.to(torch.int32), length.to(torch.int32), offsets.to(torch.int32)
