"""Chunk tables for the GPU kernels, built without a host sync, in fixed sizes.

Every TileLang kernel sees one list of sequences (token tensors ``[1, T, H, D]``): a rect
batch ``[B, T, ...]`` is passed as the ``B`` sequences ``cu_seqlens = [0, T, 2T, ...]`` of a
flattened ``[1, B*T, ...]`` view, which is how the kernels come in one variant for both
layouts.  Kernels over chunk slots read ``chunk_start``/``chunk_len`` (a slot past the last
real chunk has length 0); kernels over sequences read ``cu_seqlens`` and ``chunk_offsets``
(the slot of each sequence's first chunk).  Slot numbering matches the ops' per-chunk tensors:
rect ``b * ceil(T/C) + c`` (so ``[B, slots, ...]`` flattens to ``[1, B*slots, ...]``), varlen
``chunk_offsets[n] + c`` inside ``ceil(T/C) + N - 1`` slots.

Varlen tables take about 15 small launches on the device (they depend on ``cu_seqlens``'
values); rect tables depend on (B, T, C) alone and arrive in one asynchronous copy from a host
copy.  The public functions build them once per call as one packed int32 tensor
(``dplr::chunk_tables``, :func:`packed_tables`) and every stage op of the call, forward and
backward, reads it (:func:`tables_for`): on small grids and varlen calls that host time is not
hidden behind the kernels.  An op called without them builds its own.
``chunk_tables`` is an op of its own so that a compiled graph or a selective-checkpoint region
sees one node, not a dozen small ones (each a dispatch through the checkpoint's mode).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..reference.layout import chunk_slots_per_batch
from .shapes import varlen_sequences


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


def _rect_packed_closed_form(B: int, T: int, chunk_size: int, device) -> torch.Tensor:
    """The packed tables of ``B`` sequences of ``T`` (:func:`packed_tables`), computed on
    ``device`` in a dozen tiny ops."""
    nt = chunk_slots_per_batch(T, chunk_size, None)
    seq = torch.arange(B + 1, device=device, dtype=torch.int32)
    slot = torch.arange(B * nt, device=device, dtype=torch.int32)
    offset_in_seq = (slot % nt) * chunk_size
    start = (slot // nt) * T + offset_in_seq
    length = (T - offset_in_seq).clamp_(max=chunk_size)
    return torch.cat([seq * T, seq * nt, start, length])


@functools.lru_cache(maxsize=1024)
def _rect_packed_on_host(B: int, T: int, chunk_size: int, pinned: bool) -> torch.Tensor:
    """The packed rect tables in host memory (page-locked when ``pinned``), built once per
    shape and never written again: every call copies from it."""
    packed = _rect_packed_closed_form(B, T, chunk_size, "cpu")
    return packed.pin_memory() if pinned else packed


def _rect_packed(B: int, T: int, chunk_size: int, device: torch.device) -> torch.Tensor:
    # On CUDA one asynchronous copy from a pinned host copy (no host sync) instead of a dozen
    # launches: dplr::chunk_tables takes 31-34 us of host time a call on the H200's host, against
    # 112-207 us for the launches (tools/host_probe.py), which small grids do not hide.  Not
    # while a CUDA graph is captured: the graph would read the host buffer at every replay, and
    # an evicted one is freed; the closed form runs there, inside the graph.  No device tensor
    # is kept across calls (a kept one could sit in a CUDA-graph pool: torch.compile's
    # reduce-overhead mode allocates from it while warming up too; a cache of that kind fails
    # test_cuda_graphs_reduce_overhead).
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        return _rect_packed_on_host(B, T, chunk_size, True).to(device, non_blocking=True)
    if device.type == "cpu":
        return _rect_packed_on_host(B, T, chunk_size, False).clone()
    return _rect_packed_closed_form(B, T, chunk_size, device)


def packed_sizes(cu_seqlens: torch.Tensor, B, T, chunk_size: int) -> tuple:
    """Entries of each part of the packed tables ``[cu_seqlens | chunk_offsets | chunk_start |
    chunk_len]``: ``(N + 1, N + 1, slots, slots)``.  Shapes only (SymInts welcome)."""
    N = varlen_sequences(cu_seqlens)
    per_batch = chunk_slots_per_batch(T, chunk_size, N)
    seqs, slots = (B, B * per_batch) if N is None else (N, per_batch)
    return (seqs + 1, seqs + 1, slots, slots)


def packed_tables(cu_seqlens: torch.Tensor, B: int, T: int, chunk_size: int,
                  device: torch.device) -> torch.Tensor:
    """A call's chunk tables as one int32 tensor ``[cu_seqlens | chunk_offsets | chunk_start |
    chunk_len]`` (:func:`packed_sizes`) on ``device``: rect (``cu_seqlens.numel() == 0``:
    ``B`` sequences of ``T``) or varlen.  The ``tables`` argument of the stage ops."""
    if cu_seqlens.numel() == 0:
        return _rect_packed(B, T, chunk_size, torch.device(device))
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences are packed along T), got B={B}")
    start, length, offsets = varlen_chunk_tables(cu_seqlens, T, chunk_size)
    return torch.cat([cu_seqlens.to(torch.int32), offsets, start, length])


def _unpack(tables: torch.Tensor, sizes: tuple) -> KernelTables:
    cu, offsets, start, length = tables.split(sizes)
    return KernelTables(cu, start, length, offsets)


def kernel_tables(cu_seqlens: torch.Tensor, B: int, T: int, chunk_size: int,
                  device: torch.device) -> KernelTables:
    """The tables of a rect or varlen call (:func:`packed_tables`), as views of one tensor."""
    return _unpack(packed_tables(cu_seqlens, B, T, chunk_size, device),
                   packed_sizes(cu_seqlens, B, T, chunk_size))


@torch.library.custom_op("dplr::chunk_tables", mutates_args=())
def chunk_tables(cu_seqlens: torch.Tensor, batch_size: int, seq_len: int,
                 chunk_size: int) -> torch.Tensor:
    """The packed chunk tables of a call (:func:`packed_tables`) on ``cu_seqlens``' device
    (rect calls pass an empty ``cu_seqlens`` on the inputs' device).  Integer in and out:
    nothing to differentiate, so no autograd formula."""
    return packed_tables(cu_seqlens, batch_size, seq_len, chunk_size, cu_seqlens.device)


@chunk_tables.register_fake
def _(cu_seqlens, batch_size, seq_len, chunk_size):
    size = sum(packed_sizes(cu_seqlens, batch_size, seq_len, chunk_size))
    return cu_seqlens.new_empty(size, dtype=torch.int32)


def tables_for(tables: torch.Tensor | None, cu_seqlens: torch.Tensor, B: int, T: int,
               chunk_size: int, device: torch.device) -> KernelTables:
    """The tables of an op call: views of the packed ``tables`` its caller built once for the
    whole call (``dplr::chunk_tables``), or built here when it is None (a direct op call)."""
    if tables is None:
        return kernel_tables(cu_seqlens, B, T, chunk_size, device)
    sizes = packed_sizes(cu_seqlens, B, T, chunk_size)
    if tables.dtype != torch.int32 or tables.shape != (sum(sizes),):
        raise ValueError(f"tables: expected int32 [{sum(sizes)}] for {sizes[0] - 1} sequence(s) "
                         f"of chunk size {chunk_size}, got {tables.dtype} {list(tables.shape)} "
                         "(build it with dplr::chunk_tables)")
    return _unpack(tables, sizes)


def as_one_sequence_list(x: torch.Tensor) -> torch.Tensor:
    """``[B, L, ...]`` -> contiguous ``[1, B*L, ...]`` (a view when already contiguous): the
    flattened form in which kernels see token tensors ``[B, T, ...]`` and per-chunk tensors
    ``[B, slots, ...]`` alike."""
    # is_contiguous() and view(-1) rather than contiguous() and a computed length: a training
    # step flattens ~90 tensors; this form takes 1.2 instead of 2.9 us a call on a CPU tensor
    if not x.is_contiguous():
        x = x.contiguous()
    if x.numel():
        return x.view(1, -1, *x.shape[2:])
    return x.view(1, x.shape[0] * x.shape[1], *x.shape[2:])  # -1 is ambiguous when empty
