"""torch_dplr.cp.plan: how a packed layout is cut into per-rank pieces (host logic only)."""
import random

import pytest

from torch_dplr.cp.plan import carries_in, even_shares, plan_rank


def random_layout(rng):
    N = rng.randint(1, 7)
    lengths = [rng.choice([0, 1, 3, 17, 40, 70]) for _ in range(N)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    W = rng.randint(1, 5)
    cuts = sorted(rng.randint(0, cu[-1]) for _ in range(W - 1))
    bounds = [0] + cuts + [cu[-1]]
    shares = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    return tuple(cu), tuple(shares)


LAYOUTS = [((0, 150), (75, 75)), ((0, 150), (38, 38, 37, 37)),
           ((0, 3, 50, 50, 97, 160), (20, 0, 45, 95)), ((0, 10, 150, 150), (30, 0, 50, 70)),
           ((0, 70, 150, 150), (150, 0)), ((0, 0), (0, 0)), ((0, 5, 5, 37, 90, 91, 150), (60, 90))]
LAYOUTS += [random_layout(random.Random(seed)) for seed in range(200)]


@pytest.mark.parametrize("cu,shares", LAYOUTS)
def test_pieces_cover_every_token_once_and_own_every_state_once(cu, shares):
    N, W = len(cu) - 1, len(shares)
    plans = [plan_rank(cu, shares, r) for r in range(W)]
    covered = {n: [] for n in range(N)}
    for plan in plans:
        start, end = plan.token_range
        local = plan.local_cu_seqlens
        assert local[0] == 0 and local[-1] == end - start
        assert all(x <= y for x, y in zip(local, local[1:]))
        for p in plan.pieces:
            covered[p.seq].append((start + p.start, start + p.end))
            assert p.starts_here == (cu[p.seq] >= start)
            assert p.ends_here == (cu[p.seq + 1] <= end)
    for n in range(N):
        spans = sorted(covered[n])
        if cu[n] == cu[n + 1]:
            assert len(spans) == 1 and spans[0] == (cu[n], cu[n])  # one owner, even when empty
            continue
        assert spans[0][0] == cu[n] and spans[-1][1] == cu[n + 1]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
    for rows in ("initial_state_rows", "final_state_rows"):
        owned = sorted(n for plan in plans for n in getattr(plan, rows))
        assert owned == list(range(N)), rows


@pytest.mark.parametrize("cu,shares", LAYOUTS)
def test_carries_and_records_chain_each_sequence(cu, shares):
    W = len(shares)
    plans = [plan_rank(cu, shares, r) for r in range(W)]
    for r, plan in enumerate(plans):
        assert (plan.carry_in > 0) == carries_in(cu, shares, r)
        if plan.carry_in:
            first = next(p for p in plan.pieces if p.end > p.start)
            assert not first.starts_here and plan.carry_in == first.end - first.start
            # walking back over the records reaches the rank where the sequence began, and
            # every rank on the way passes the state on
            s = r - 1
            while plans[s].record in ("identity", "through"):
                s -= 1
            assert plans[s].record == "reset"
            assert first.seq in [p.seq for p in plans[s].pieces if p.starts_here]
        if plan.record == "identity":
            assert shares[r] == 0
        if plan.record in ("reset", "through"):
            carried = plan.pieces[plan.record_piece]
            assert not carried.ends_here
            assert carried.starts_here == (plan.record == "reset")
        final = plan.final_sources
        for i, p in enumerate(plan.pieces):
            if p.ends_here:
                assert final[p.seq] == (i if p.starts_here else len(plan.local_cu_seqlens) - 1)


def test_even_shares():
    assert even_shares(10, 4) == (3, 3, 2, 2)
    assert even_shares(3, 4) == (1, 1, 1, 0)
    assert sum(even_shares(1 << 20, 64)) == 1 << 20
