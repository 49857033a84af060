"""Token <-> chunk bookkeeping shared by every PyTorch reference stage.

Every stage works on a padded chunk layout ``[num_slots, C, H, D]``: chunk slot ``s`` holds
``C`` consecutive tokens of one sequence, rows past the sequence end are zero.  Zero rows are
exact no-ops for the DPLR recurrence (gate 0 -> decay 1, k = a = b = 0), so padding never
changes a result.  Slot numbering is the one the ops expose for per-chunk tensors
(``h``, ``gl``): rect ``b * ceil(T/C) + c``; varlen ``chunk_offsets[n] + c`` inside the
upper bound ``ceil(T/C) + N - 1`` (unused trailing slots stay zero).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def chunk_slots_per_batch(T, chunk_size: int, num_seqs_varlen):
    """Per-chunk tensors have shape ``[B, slots, ...]``; ``num_seqs_varlen`` is None for rect.

    Works on SymInts: fakes call it with symbolic T.
    """
    nt = (T + chunk_size - 1) // chunk_size
    return nt if num_seqs_varlen is None else nt + num_seqs_varlen - 1


@dataclass(frozen=True)
class ChunkLayout:
    num_tokens: int          # B * T, the index of the appended zero row
    num_slots: int           # chunk slots, the index of the appended zero chunk
    token_index: torch.Tensor  # [num_slots, C] flat token per chunk row, pad -> num_tokens
    seq_slots: torch.Tensor    # [N, max_chunks] slot of chunk c of sequence n, pad -> num_slots
    valid_rows: torch.Tensor   # [num_slots * C] bool, rows that map to a real token

    def to_chunks(self, x: torch.Tensor, dtype: torch.dtype, zero_slot: bool = False) -> torch.Tensor:
        """``[B, T, H, D]`` -> ``[num_slots (+1 all-zero slot), C, H, D]`` in ``dtype``."""
        flat = x.reshape(self.num_tokens, *x.shape[2:]).to(dtype)
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        index = self.token_index
        if zero_slot:  # gathered in the same pass rather than concatenated afterwards
            index = torch.cat([index, index.new_full((1, index.shape[1]), self.num_tokens)])
        return flat[index]

    def from_chunks(self, xc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Scatter ``[num_slots, C, H, D]`` back into the caller-allocated ``out [B, T, H, D]``."""
        rows = xc.reshape(-1, *xc.shape[2:])[self.valid_rows]
        idx = self.token_index.reshape(-1)[self.valid_rows]
        out.view(self.num_tokens, *out.shape[2:]).index_copy_(0, idx, rows.to(out.dtype))
        return out


def chunk_layout(B: int, T: int, chunk_size: int, cu_seqlens: torch.Tensor, device) -> ChunkLayout:
    """Layout for rect (``cu_seqlens.numel() == 0``) or varlen inputs."""
    cu = tuple(cu_seqlens.tolist()) if cu_seqlens.numel() else None
    return _cached_layout(B, T, chunk_size, cu, torch.device(device))


def check_cu_seqlens_values(cu: tuple, T: int) -> None:
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if any(y < x for x, y in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {list(cu)}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens must end at the token count T={T}, got {cu[-1]}")


@functools.lru_cache(maxsize=64)
def _cached_layout(B, T, C, cu, device) -> ChunkLayout:
    if cu is None:
        nt = (T + C - 1) // C
        starts = torch.arange(B, device=device)[:, None] * T + torch.arange(nt, device=device) * C
        ends = torch.arange(B, device=device)[:, None] * T + T
        starts, ends = starts.reshape(-1), ends.expand(B, nt).reshape(-1)
        seq_slots = torch.arange(B * nt, device=device).reshape(B, nt)
        num_slots = B * nt
    else:
        check_cu_seqlens_values(cu, T)
        bounds = torch.tensor(cu, dtype=torch.long, device=device)
        lens = bounds[1:] - bounds[:-1]
        nchunks = (lens + C - 1) // C
        offsets = torch.cat([nchunks.new_zeros(1), torch.cumsum(nchunks, 0)])
        used = int(offsets[-1])
        N = len(cu) - 1
        num_slots = chunk_slots_per_batch(T, C, N)
        seq_of_slot = torch.repeat_interleave(torch.arange(N, device=device), nchunks)
        c_in_seq = torch.arange(used, device=device) - offsets[seq_of_slot]
        starts = bounds[seq_of_slot] + c_in_seq * C
        ends = bounds[seq_of_slot + 1]
        pad = num_slots - used
        starts = torch.cat([starts, starts.new_zeros(pad)])
        ends = torch.cat([ends, ends.new_zeros(pad)])
        max_chunks = int(nchunks.max()) if N else 0
        c = torch.arange(max_chunks, device=device)
        seq_slots = torch.where(c < nchunks[:, None], offsets[:-1, None] + c, num_slots)
        B = 1
    num_tokens = B * T
    rows = starts[:, None] + torch.arange(C, device=device)
    valid = rows < ends[:, None]
    token_index = torch.where(valid, rows, num_tokens)
    return ChunkLayout(num_tokens, num_slots, token_index, seq_slots, valid.reshape(-1))


def sequence_index(B: int, T: int, cu_seqlens: torch.Tensor, reverse: bool, device) -> torch.Tensor:
    """``[N, L]`` flat token index per sequence step (pad -> ``B*T``), for the per-token path.

    With ``reverse`` the steps walk each sequence from its end; padding always comes last.
    """
    if cu_seqlens.numel() == 0:
        starts = torch.arange(B, device=device) * T
        lens = torch.full((B,), T, device=device)
    else:
        cu = tuple(cu_seqlens.tolist())
        check_cu_seqlens_values(cu, T)
        bounds = torch.tensor(cu, dtype=torch.long, device=device)
        starts, lens = bounds[:-1], bounds[1:] - bounds[:-1]
        B = 1
    L = int(lens.max()) if lens.numel() else 0
    t = torch.arange(L, device=device)
    pos = (lens[:, None] - 1 - t) if reverse else t.expand(len(lens), L)
    return torch.where(t < lens[:, None], starts[:, None] + pos, B * T)
