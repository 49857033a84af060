"""Chunk tables for the GPU kernels, built on the device: no host sync, fixed sizes.

Every TileLang kernel sees one list of sequences (token tensors ``[1, T, H, D]``): a rect
batch ``[B, T, ...]`` is passed as the ``B`` sequences ``cu_seqlens = [0, T, 2T, ...]`` of a
flattened ``[1, B*T, ...]`` view, which is how the kernels come in one variant for both
layouts.  Kernels over chunk slots read ``chunk_start``/``chunk_len`` (a slot past the last
real chunk has length 0); kernels over sequences read ``cu_seqlens`` and ``chunk_offsets``
(the slot of each sequence's first chunk).  Slot numbering matches the ops' per-chunk tensors:
rect ``b * ceil(T/C) + c`` (so ``[B, slots, ...]`` flattens to ``[1, B*slots, ...]``), varlen
``chunk_offsets[n] + c`` inside ``ceil(T/C) + N - 1`` slots.

Building the tables takes 8-15 small launches.  The public functions build them once per call
as one packed int32 tensor (:func:`packed_tables`) and every stage op of the call, forward and
backward, reads it (:func:`tables_for`): on small grids and varlen calls that host time is not
hidden behind the kernels.  An op called without them builds its own.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..reference.layout import chunk_slots_per_batch


class KernelTables(NamedTuple):
    cu_seqlens: torch.Tensor     # int32 [N+1]
    chunk_start: torch.Tensor    # int32 [slots], first token of each slot
    chunk_len: torch.Tensor      # int32 [slots], rows of each slot (0: unused)
    chunk_offsets: torch.Tensor  # int32 [N+1], slot of each sequence's first chunk


def varlen_chunk_tables(cu_seqlens: torch.Tensor, T: int, chunk_size: int, slots: int | None = None):
    """Returns int32 ``(chunk_start [slots], chunk_len [slots], chunk_offsets [N+1])``.

    ``slots`` defaults to the varlen bound ``ceil(T/C) + N - 1``.
    """
    cu = cu_seqlens.to(torch.int64)
    N = cu.shape[0] - 1
    if slots is None:
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


def _rect_tables(B: int, T: int, chunk_size: int, device: torch.device) -> KernelTables:
    # closed form, a few tiny launches per call; not cached: a tensor kept across calls would
    # be allocated inside a CUDA-graph memory pool when first built under capture
    nt = chunk_slots_per_batch(T, chunk_size, None)
    seq = torch.arange(B + 1, device=device, dtype=torch.int32)
    slot = torch.arange(B * nt, device=device, dtype=torch.int32)
    offset_in_seq = (slot % nt) * chunk_size
    start = (slot // nt) * T + offset_in_seq
    length = (T - offset_in_seq).clamp_(max=chunk_size)
    return KernelTables(seq * T, start, length, seq * nt)


def kernel_tables(cu_seqlens: torch.Tensor, B: int, T: int, chunk_size: int,
                  device: torch.device) -> KernelTables:
    """Tables for a rect (``cu_seqlens.numel() == 0``: ``B`` sequences of ``T``) or varlen call."""
    if cu_seqlens.numel() == 0:
        return _rect_tables(B, T, chunk_size, torch.device(device))
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences are packed along T), got B={B}")
    return KernelTables(cu_seqlens.to(torch.int32), *varlen_chunk_tables(cu_seqlens, T, chunk_size))


def packed_tables(cu_seqlens: torch.Tensor, B: int, T: int, chunk_size: int,
                  device: torch.device) -> torch.Tensor:
    """:func:`kernel_tables` as one int32 tensor ``[cu_seqlens | chunk_offsets | chunk_start |
    chunk_len]`` (``2 (N + 1) + 2 slots`` entries), for the ``tables`` argument of the stage
    ops.  Plain tensor code: a compiled graph holds it as ordinary (fusible) ops."""
    t = kernel_tables(cu_seqlens, B, T, chunk_size, device)
    return torch.cat([t.cu_seqlens, t.chunk_offsets, t.chunk_start, t.chunk_len])


def tables_for(tables: torch.Tensor | None, cu_seqlens: torch.Tensor, B: int, T: int, chunk_size: int,
               device: torch.device) -> KernelTables:
    """The tables of an op call: views of the packed ``tables`` its caller built once for the
    whole call (:func:`packed_tables`), or built here when it is None (a direct op call)."""
    if tables is None:
        return kernel_tables(cu_seqlens, B, T, chunk_size, device)
    seqs = cu_seqlens.shape[0] - 1 if cu_seqlens.numel() else B
    slots = chunk_slots_per_batch(T, chunk_size, seqs if cu_seqlens.numel() else None)
    slots = slots if cu_seqlens.numel() else B * slots
    if tables.dtype != torch.int32 or tables.shape != (2 * (seqs + 1) + 2 * slots,):
        raise ValueError(f"tables: expected int32 [{2 * (seqs + 1) + 2 * slots}] for {seqs} "
                         f"sequence(s) of chunk size {chunk_size}, got {tables.dtype} "
                         f"{list(tables.shape)} (build it with packed_tables)")
    cu, offsets, start, length = tables.split([seqs + 1, seqs + 1, slots, slots])
    return KernelTables(cu, start, length, offsets)


def as_one_sequence_list(x: torch.Tensor) -> torch.Tensor:
    """``[B, L, ...]`` -> contiguous ``[1, B*L, ...]`` (a view when already contiguous): the
    flattened form in which kernels see token tensors ``[B, T, ...]`` and per-chunk tensors
    ``[B, slots, ...]`` alike."""
    x = x.contiguous()
    return x.view(1, x.shape[0] * x.shape[1], *x.shape[2:])
