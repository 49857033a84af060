"""Which pieces of which sequences a rank holds, and what it exchanges: pure host logic.

The packed token sequence (global ``cu_seqlens``) is cut into contiguous shares, one per rank
in group order.  A rank's *pieces* are the parts of sequences inside its share, in order, with
the empty sequences it owns.  Only two pieces per rank can involve other ranks:

- the first piece *carries in* when its sequence began on an earlier rank: its true start
  state comes from the exchange;
- the last piece *carries out* when its sequence goes on past the share: the rank publishes
  the affine map of its share for that sequence (its *record*).

Records, one per rank, as affine maps ``h -> M·h + c`` of the state crossing the rank:

- ``"reset"``: the carried sequence starts on this rank, so its state leaving the rank is
  known: ``M = 0``, ``c`` = the end state of the last piece;
- ``"through"``: the rank holds a single piece, in the middle of a sequence: ``(M, c)`` of
  that piece;
- ``"identity"``: an empty share passes the state on unchanged;
- ``"none"``: nothing leaves the rank (its last sequence ends in it); no rank reads it.

A scan over the records in rank order gives every rank the state entering its share: a
``"reset"`` cuts the chain, so each rank sees only its own sequence's history.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

RECORD_KINDS = ("reset", "through", "identity", "none")


@dataclass(frozen=True)
class Piece:
    seq: int            # index of the sequence in the global cu_seqlens
    start: int          # token offsets inside the rank's share: [start, end)
    end: int
    starts_here: bool   # the sequence begins in this share
    ends_here: bool     # the sequence ends in this share


@dataclass(frozen=True)
class RankPlan:
    rank: int
    token_range: tuple[int, int]   # global offsets [start, end) of the share
    pieces: tuple[Piece, ...]
    carry_in: int                  # tokens of the first piece that continue an earlier rank's
    record: str                    # one of RECORD_KINDS
    record_piece: int              # the piece whose end state is the record's offset (-1: none)
    num_seqs: int                  # sequences in the global layout

    @property
    def local_cu_seqlens(self) -> tuple[int, ...]:
        """Offsets of the pieces for the rank's call (one empty sequence if it has none)."""
        if not self.pieces:
            return (0, 0)
        return (0,) + tuple(p.end for p in self.pieces)

    @property
    def initial_rows(self) -> tuple[int, ...]:
        """Per sequence of the rank's call: the global initial-state row it starts from, or
        -1 for a zero start (the carry-in piece, whose start state comes later)."""
        if not self.pieces:
            return (-1,)
        return tuple(p.seq if p.starts_here else -1 for p in self.pieces)

    @property
    def final_sources(self) -> tuple[int, ...]:
        """Per global sequence: the row of ``[end states of the call's sequences..., true end
        of the carry-in piece]`` that is its final state, or -1 when it ends elsewhere."""
        sources = [-1] * self.num_seqs
        for i, p in enumerate(self.pieces):
            if p.ends_here:
                sources[p.seq] = i if p.starts_here else len(self.local_cu_seqlens) - 1
        return tuple(sources)

    @property
    def initial_state_rows(self) -> tuple[int, ...]:
        """Sequences whose initial state this rank applies."""
        return tuple(p.seq for p in self.pieces if p.starts_here)

    @property
    def final_state_rows(self) -> tuple[int, ...]:
        """Sequences whose final state this rank returns."""
        return tuple(p.seq for p in self.pieces if p.ends_here)


def even_shares(num_tokens: int, world_size: int) -> tuple[int, ...]:
    """Contiguous shares as equal as possible, the longer ones first."""
    base, extra = divmod(num_tokens, world_size)
    return tuple(base + (r < extra) for r in range(world_size))


def _share_bounds(shares, rank):
    start = sum(shares[:rank])
    return start, start + shares[rank]


def _seq_at(cu, token):
    """The (non-empty) sequence that holds ``token``."""
    return bisect.bisect_right(cu, token) - 1


def _empty_seq_owner(cu, shares, n):
    """An empty sequence belongs to the rank holding the token at its offset (the last rank
    for one at the very end)."""
    offset = cu[n]
    end = 0
    for r, share in enumerate(shares):
        end += share
        if offset < end:
            return r
    return len(shares) - 1


def carries_in(cu: tuple[int, ...], shares: tuple[int, ...], rank: int) -> bool:
    start, end = _share_bounds(shares, rank)
    return start < end and cu[_seq_at(cu, start)] < start


def plan_rank(cu: tuple[int, ...], shares: tuple[int, ...], rank: int) -> RankPlan:
    """The plan of ``rank`` for the global layout ``cu`` split into ``shares``."""
    start, end = _share_bounds(shares, rank)
    N = len(cu) - 1
    # candidates: from the sequence before the first one that starts at or after the share's
    # start, to the last one that starts at or before its end
    first = max(bisect.bisect_left(cu, start) - 1, 0)
    last = min(bisect.bisect_right(cu, end) - 1, N - 1)
    pieces = []
    for n in range(first, last + 1):
        s, e = cu[n], cu[n + 1]
        if s == e:
            if _empty_seq_owner(cu, shares, n) != rank:
                continue
            lo = hi = s - start
        else:
            lo, hi = max(s, start) - start, min(e, end) - start
            if lo >= hi:
                continue
        pieces.append(Piece(n, lo, hi, s >= start, e <= end))
    nonempty = [i for i, p in enumerate(pieces) if p.end > p.start]
    carry_in = 0
    if nonempty and not pieces[nonempty[0]].starts_here:
        carry_in = pieces[nonempty[0]].end - pieces[nonempty[0]].start
    record, record_piece = "none", -1
    if start == end:
        record = "identity"
    elif not pieces[nonempty[-1]].ends_here:
        record_piece = nonempty[-1]
        record = "through" if (len(nonempty) == 1 and carry_in) else "reset"
    return RankPlan(rank, (start, end), tuple(pieces), carry_in, record, record_piece, N)
