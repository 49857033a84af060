"""Packed-sequence bookkeeping: which keys each token may see.

Token ``t`` of a sequence ``[cu[n], cu[n+1])`` sees the keys ``cu[n] <= s <= t`` (causal,
its own sequence only).  Tokens at ``t >= cu[-1]`` belong to no sequence (padding): they see
no key.  An empty ``cu_seqlens`` (the size-0 sentinel) means one sequence of all ``T`` tokens.
"""
from __future__ import annotations

import torch


def check_cu_seqlens_values(cu: list, T: int) -> None:
    """Raises ``ValueError`` unless ``cu`` starts at 0, never decreases and ends at most at T."""
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if any(y < x for x, y in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {list(cu)}")
    if cu[-1] > T:
        raise ValueError(f"cu_seqlens must end at most at the token count T={T}, got {cu[-1]}")


def key_starts(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """``[T]`` int64: the first key token ``t`` may see; ``t + 1`` (nothing) for padding.

    Non-decreasing in ``t``, so the smallest start of a block of queries is its first row's.
    """
    t = torch.arange(T, device=device)
    if cu_seqlens.numel() == 0:
        return torch.zeros(T, dtype=torch.int64, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    n = cu.numel() - 1
    # the sequence holding t: how many sequence ends are <= t (empty sequences count as ended)
    seq = torch.searchsorted(cu[1:], t, right=True)
    return torch.where(seq < n, cu[seq.clamp(max=max(n - 1, 0))], t + 1)


def checked_key_starts(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """:func:`key_starts` after checking ``cu_seqlens``'s values on the host (op bodies do
    this: while torch.compile traces, the public functions cannot)."""
    if cu_seqlens.numel():
        check_cu_seqlens_values(cu_seqlens.tolist(), T)
    return key_starts(cu_seqlens, T, device)


def check_index_range(indices: torch.Tensor, T: int) -> None:
    """Op bodies' last guard: every index in ``[-1, T)`` (a host read)."""
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= T):
        raise ValueError(f"indices must lie in [-1, T={T}), got values in "
                         f"[{int(indices.min())}, {int(indices.max())}]")
