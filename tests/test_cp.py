"""Context parallelism across processes: every rank's share of o, the final states and every
gradient against the single-process call on the concatenated tokens.

The test spawns one process group per world size (torch.multiprocessing) and runs every case
in it; each case's assertions then read what the ranks reported.  By default: gloo on the CPU,
worlds of 2 and 4.  Environment knobs (read at import):

``TORCH_DPLR_CP_BACKEND``
    ``gloo`` (default) or ``nccl``: NCCL with CUDA tensors, one process per GPU (rank r on
    ``cuda:r``); worlds larger than the GPU count are skipped.
``TORCH_DPLR_CP_WORLD_SIZES``
    comma-separated world sizes (default ``2,4``).
``TORCH_DPLR_CP_HEAD_DIM``
    K = V of the bf16 cases (default 16; 64 or 128 run the TileLang kernels on an H200).
``TORCH_DPLR_CP_LENGTH_SCALE``
    multiplies every layout's offsets (default 1; e.g. 16 for thousands of tokens per rank).

``python tests/test_cp.py`` prints the worst error ratio per output and world.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

import torch_dplr
from torch_dplr.testing import TOLERANCES, make_inputs, recurrence_oracle, rms_ratio

BACKEND = os.environ.get("TORCH_DPLR_CP_BACKEND") or "gloo"
WORLD_SIZES = tuple(int(w) for w in
                    (os.environ.get("TORCH_DPLR_CP_WORLD_SIZES") or "2,4").split(","))
BF16_HEAD_DIM = int(os.environ.get("TORCH_DPLR_CP_HEAD_DIM") or 16)
LENGTH_SCALE = int(os.environ.get("TORCH_DPLR_CP_LENGTH_SCALE") or 1)
GROUP_TIMEOUT_S = 240      # a collective that waits longer fails the case instead of hanging
WORLD_DEADLINE_S = 1200    # the whole spawned group

EXACT = 1e-10              # fp64 against the single-process fp64 call
GRAD_NAMES = ("q", "k", "v", "a", "b", "gk", "initial_state")


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parity:
    """One CP call against the single-process call: fp64 -> the fp64 call (``EXACT``); bf16 ->
    the fp64 recurrence (the suite's bars)."""
    cu: tuple                      # global layout (offsets; scaled by LENGTH_SCALE)
    shares: dict = field(default_factory=dict)   # world size -> shares (default: even)
    chunk_size: int = 64
    dtype: str = "float64"
    K: int = 8
    V: int = 8
    H: int = 2
    gates: str = "rwkv7"
    entry: str = "dplr"            # or "rwkv7" (q=r, gk=w, scale 1)
    use_initial_state: bool = True
    output_final_state: bool = True

    def layout(self, world):
        cu = tuple(x * LENGTH_SCALE for x in self.cu)
        shares = self.shares.get(world)
        return cu, (None if shares is None else tuple(x * LENGTH_SCALE for x in shares))


RECT = (0, 150)
VARLEN = (0, 5, 5, 37, 90, 91, 150)        # an empty sequence, a 1-token one, one crossing ranks
PARITY = {
    **{f"rect_fp64_c{c}": Parity(RECT, chunk_size=c) for c in (16, 32, 64)},
    **{f"varlen_fp64_c{c}": Parity(VARLEN, {2: (60, 90), 4: (20, 41, 29, 60)}, chunk_size=c)
       for c in (16, 32, 64)},
    # empty shares; a sequence over three ranks with an empty one between; pieces of 3 tokens
    "empty_shares_fp64": Parity((0, 3, 50, 50, 97, 160), {2: (0, 160), 4: (20, 0, 45, 95)},
                                chunk_size=16),
    "span_over_empty_share_fp64": Parity((0, 10, 150, 150), {2: (150, 0), 4: (30, 0, 50, 70)},
                                         chunk_size=32, gates="unbounded"),
    "short_pieces_fp64": Parity((0, 40, 41, 120), {2: (39, 81), 4: (5, 34, 2, 79)}, chunk_size=64),
    "k_ne_v_fp64": Parity(VARLEN, {4: (20, 41, 29, 60)}, chunk_size=16, K=16, V=12),
    "rwkv7_entry_fp64": Parity(VARLEN, {2: (60, 90)}, chunk_size=32, entry="rwkv7"),
    "no_states_fp64": Parity(VARLEN, chunk_size=16, use_initial_state=False,
                             output_final_state=False),
    "bf16_rect_c64": Parity((0, 256), chunk_size=64, dtype="bfloat16", K=BF16_HEAD_DIM,
                            V=BF16_HEAD_DIM),
    "bf16_varlen_c16": Parity((0, 64, 65, 200, 256), {2: (100, 156), 4: (50, 70, 60, 76)},
                              chunk_size=16, dtype="bfloat16", K=BF16_HEAD_DIM, V=BF16_HEAD_DIM),
}
WORLD_OF_ONE = Parity(VARLEN, chunk_size=16)
SMALLEST_WORLD = min(WORLD_SIZES)   # also runs the world-of-one and opcheck cases


# ----------------------------------------------------------------------------------------------
# What each rank runs
# ----------------------------------------------------------------------------------------------

def _device(rank):
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _inputs(case: Parity, cu, device):
    dtype = getattr(torch, case.dtype)
    inp = make_inputs(1, cu[-1], case.H, case.K, case.V, dtype=dtype, gates=case.gates, seed=11,
                      num_states=len(cu) - 1)
    gen = torch.Generator().manual_seed(12)
    inp["do"] = torch.randn(1, cu[-1], case.H, case.V, generator=gen, dtype=torch.float64)
    inp["dht"] = torch.randn(len(cu) - 1, case.H, case.K, case.V, generator=gen,
                             dtype=torch.float64)
    return {n: x.to(device) for n, x in inp.items()}


def _call(case: Parity, tensors, initial_state, **kw):
    q, k, v, a, b, gk = tensors
    if case.entry == "rwkv7":
        return torch_dplr.chunk_rwkv7(q, gk, k, v, a, b, initial_state=initial_state,
                                      output_final_state=case.output_final_state,
                                      chunk_size=case.chunk_size, **kw)
    return torch_dplr.chunk_dplr_delta_rule(q, k, v, a, b, gk, initial_state=initial_state,
                                            output_final_state=case.output_final_state,
                                            chunk_size=case.chunk_size, **kw)


def _leaves(inp, names, shard):
    return {n: (shard(inp[n]) if n != "initial_state" else inp[n]).detach().clone().requires_grad_()
            for n in names}


def _names(case):
    return GRAD_NAMES if case.use_initial_state else GRAD_NAMES[:6]


def _loss(o, ht, do, dht):
    loss = (o.double() * do).sum()
    return loss if ht is None else loss + (ht.double() * dht).sum()


def _cp_run(case, ctx, inp, fn=None):
    """The CP call on this rank's share: outputs and the gradients of every leaf."""
    names = _names(case)
    leaves = _leaves(inp, names, ctx.shard)
    run = fn or (lambda *t, h0: _call(case, t, h0, cp_context=ctx))
    o, ht = run(*(leaves[n] for n in names[:6]), h0=leaves.get("initial_state"))
    grads = torch.autograd.grad(_loss(o, ht, ctx.shard(inp["do"]), inp["dht"]),
                                [leaves[n] for n in names])
    return o, ht, dict(zip(names, grads))


def _reference(case, cu, inp):
    """The single-process call on all tokens (fp64), or the fp64 recurrence (bf16)."""
    names = _names(case)
    leaves = _leaves(inp, names, lambda x: x)
    t = [leaves[n] for n in names[:6]]
    h0 = leaves.get("initial_state")
    cu_t = torch.tensor(cu, device=inp["q"].device)
    if case.dtype == "float64":
        o, ht = _call(case, t, h0, cu_seqlens=cu_t)
    else:
        scale = 1.0 if case.entry == "rwkv7" else case.K ** -0.5
        o, ht = recurrence_oracle(*[x.double() for x in t], scale,
                                  None if h0 is None else h0.double(), cu_t)
        ht = ht if case.output_final_state else None
    leaves = t + ([h0] if h0 is not None else [])
    grads = torch.autograd.grad(_loss(o, ht, inp["do"], inp["dht"]), leaves)
    return o, ht, dict(zip(names, grads))


def _sums(out, ref):
    """Squared error and squared reference, summed (combined over ranks by the test)."""
    out, ref = out.detach().double(), ref.detach().double()
    return [float((out - ref).pow(2).sum()), float(ref.pow(2).sum())]


def _compare(ctx, got, want):
    """Per output: sums over this rank's share (states: over the rows this rank owns), and
    whether every row it does not own is exactly zero."""
    (o, ht, grads), (o_ref, ht_ref, grads_ref) = got, want
    out = {"o": _sums(o, ctx.shard(o_ref))}
    zero_elsewhere = {}
    if ht_ref is not None:
        rows = list(ctx.final_state_rows)
        out["final_state"] = _sums(ht[rows], ht_ref[rows])
        others = [n for n in range(ctx.num_seqs) if n not in rows]
        zero_elsewhere["final_state"] = bool((ht[others] == 0).all())
    for n, g in grads.items():
        if n == "initial_state":
            rows = list(ctx.initial_state_rows)
            out["dinitial_state"] = _sums(g[rows], grads_ref[n][rows])
            others = [i for i in range(ctx.num_seqs) if i not in rows]
            zero_elsewhere["dinitial_state"] = bool((g[others] == 0).all())
        else:
            out["d" + n] = _sums(g, ctx.shard(grads_ref[n]))
    return {"sums": out, "zero_elsewhere": zero_elsewhere,
            "final_rows": list(ctx.final_state_rows), "initial_rows": list(ctx.initial_state_rows)}


def _close(got, want):
    """Max RMS ratio between two (o, ht, grads) results of the same rank."""
    (o, ht, g), (o2, ht2, g2) = got, want
    worst = rms_ratio(o, o2)
    if ht is not None:
        worst = max(worst, rms_ratio(ht, ht2))
    return max([worst] + [rms_ratio(g[n], g2[n]) for n in g])


def run_parity(case, world, rank, device):
    cu, shares = case.layout(world)
    ctx = torch_dplr.cp.build_context(None, list(cu), shares=shares)
    inp = _inputs(case, cu, device)
    return _compare(ctx, _cp_run(case, ctx, inp), _reference(case, cu, inp))


class GraphRecorder:
    """A torch.compile backend (AOT autograd, no codegen) that keeps the op counts of every
    forward and backward graph it compiles."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        self.forward, self.backward = [], []

        def keep(into):
            def compiler(gm, example_inputs):
                into.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
                return make_boxed_func(gm.forward)
            return compiler
        self.backend = aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward),
                                    partition_fn=min_cut_rematerialization_partition)

    def count(self, graphs, name):
        return sum(op.startswith(name) for g in graphs for op in g)


COMPILE_LAYOUTS = (  # (cu, shares per world): lengths and counts of shares, pieces, sequences
    (VARLEN, {2: (60, 90), 4: (20, 41, 29, 60)}),
    ((0, 7, 7, 44, 100, 101, 160), {2: (70, 90), 4: (22, 45, 33, 60)}),
    ((0, 9, 30, 50, 120, 121, 170, 180), {2: (80, 100), 4: (25, 50, 40, 65)}),
    # every size changes again, but no rank's structure does (pieces, carries, which sizes
    # are 0 or 1: Dynamo gives those their own graphs)
    ((0, 11, 35, 60, 140, 141, 195, 207), {2: (90, 117), 4: (29, 55, 50, 73)}),
)
COMPILE_BACKENDS = {SMALLEST_WORLD: ("aot_eager", "inductor")}  # others: aot_eager (CI time)


def run_compile(world, rank, device):
    """torch.compile(fullgraph=True) of a CP call, with a new context (layout) per step: the
    graphs hold the exchange ops, results equal eager, and after the one recompile that makes
    the sizes symbolic (Dynamo's automatic dynamic shapes) a new layout compiles nothing."""
    out = {}
    for backend in COMPILE_BACKENDS.get(world, ("aot_eager",)):
        torch._dynamo.reset()
        recorder = GraphRecorder() if backend == "aot_eager" else None

        def step(*t, h0, ctx, case):
            return _call(case, t, h0, cp_context=ctx)
        compiled = torch.compile(step, fullgraph=True,
                                 backend=recorder.backend if recorder else backend)
        graphs, errors = [], []
        # Inductor compiles C++ on the CPU: one layout (the recompiles are counted above)
        for cu, shares in COMPILE_LAYOUTS if recorder else COMPILE_LAYOUTS[:1]:
            case = Parity(cu, shares, chunk_size=16)
            cu, shares = case.layout(world)
            ctx = torch_dplr.cp.build_context(None, list(cu), shares=shares)
            inp = _inputs(case, cu, device)
            got = _cp_run(case, ctx, inp, fn=lambda *t, h0: compiled(*t, h0=h0, ctx=ctx, case=case))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            errors.append(_close(got, _cp_run(case, ctx, inp)))
        out[backend] = {"errors": errors, "new_graphs": [g - graphs[0] for g in graphs]}
        if recorder:
            out[backend]["join_fwd"] = recorder.count(recorder.forward, "dplr.cp_join.")
            out[backend]["join_bwd"] = recorder.count(recorder.backward, "dplr.cp_join_bwd.")
            out[backend]["join_in_bwd_graph"] = recorder.count(recorder.backward, "dplr.cp_join.")
    return out


def run_policies(world, rank, device):
    """Checkpointing (each shipped policy, and plain recompute-everything) eagerly, and one
    policy compiled: gradients equal the uncheckpointed CP call."""
    case = PARITY["varlen_fp64_c32"]
    cu, shares = case.layout(world)
    ctx = torch_dplr.cp.build_context(None, list(cu), shares=shares)
    inp = _inputs(case, cu, device)
    plain = _cp_run(case, ctx, inp)

    def call(*t, h0):
        return _call(case, t, h0, cp_context=ctx)

    out, collectives = {}, {}
    with CountCollectives() as counter:
        _cp_run(case, ctx, inp)
    collectives["none"] = counter.calls
    keep_exchange = torch_dplr.policies.context_fn("recompute_all",
                                                   extra_save_ops=(torch.ops.dplr.cp_join,))
    for policy in (*torch_dplr.policies.POLICIES, None, "keep_exchange"):
        kw = {"context_fn": keep_exchange if policy == "keep_exchange" else
              torch_dplr.policies.context_fn(policy)} if policy else {}
        fn = functools.partial(checkpoint, call, use_reentrant=False, **kw)
        with CountCollectives() as counter:
            out[policy or "checkpoint"] = _close(_cp_run(case, ctx, inp, fn=fn), plain)
        collectives[policy or "checkpoint"] = counter.calls
    torch._dynamo.reset()
    recorder = GraphRecorder()
    save_state = torch_dplr.policies.context_fn("save_state")
    compiled = torch.compile(functools.partial(checkpoint, call, use_reentrant=False,
                                               context_fn=save_state),
                             fullgraph=True, backend=recorder.backend)
    out["save_state_compiled"] = _close(_cp_run(case, ctx, inp, fn=compiled), plain)
    return {"errors": out, "collectives": collectives,
            "join_recomputed": recorder.count(recorder.backward, "dplr.cp_join.")}


def run_world_of_one(world, rank, device):
    """A group of one rank: the CP path equals the plain call exactly."""
    case = WORLD_OF_ONE
    cu, _ = case.layout(world)
    groups = [dist.new_group([r]) for r in range(world)]   # every rank creates every group
    ctx = torch_dplr.cp.build_context(groups[rank], list(cu))
    inp = _inputs(case, cu, device)
    got = _cp_run(case, ctx, inp)
    o, ht, g = _reference(case, cu, inp)
    same = torch.equal(got[0], o) and torch.equal(got[1], ht) and all(
        torch.equal(got[2][n], g[n]) for n in g)
    return {"bitwise_equal": same, "error": _close(got, (o, ht, g))}


class CountCollectives:
    """Counts the c10d collectives this process starts (all the CP code uses)."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        self.saved = dist.all_gather_into_tensor

        def counted(*args, **kwargs):
            self.calls += 1
            return self.saved(*args, **kwargs)
        dist.all_gather_into_tensor = counted
        return self

    def __exit__(self, *exc):
        dist.all_gather_into_tensor = self.saved


def run_bad_inputs(world, rank, device):
    """Every rank makes the same bad call (so a collective would not hang); each must raise
    the expected error, naming the argument, before starting any collective."""
    cu = (0, 40, 100)
    ctx = torch_dplr.cp.build_context(None, list(cu))
    start, end = ctx.token_range
    x = make_inputs(1, 100, 2, 8, dtype=torch.float64, num_states=2)
    x = {n: t.to(device) for n, t in x.items()}
    args = [ctx.shard(x[n]) for n in ("q", "k", "v", "a", "b", "gk")]
    longer = [torch.zeros(1, end - start + 1, 2, 8, dtype=torch.float64, device=device)] * 6
    dplr, rwkv7 = torch_dplr.chunk_dplr_delta_rule, torch_dplr.chunk_rwkv7
    build = torch_dplr.cp.build_context
    bad = {
        "shares_sum": lambda: build(None, list(cu), shares=[50] * (world - 1) + [51]),
        "shares_count": lambda: build(None, list(cu), shares=[100] + [0] * world),
        "cu_not_monotonic": lambda: build(None, [0, 50, 40, 100]),
        "share_length": lambda: dplr(*longer, cp_context=ctx),
        "batch_not_one": lambda: dplr(*[torch.cat([t, t]) for t in args], cp_context=ctx),
        "cu_seqlens_given": lambda: dplr(*args, cp_context=ctx,
                                         cu_seqlens=torch.tensor(cu, device=device)),
        "initial_state_local_rows": lambda: dplr(*args, cp_context=ctx,
                                                 initial_state=x["initial_state"][:1]),
        "not_a_context": lambda: dplr(*args, cp_context=object()),
        "rwkv7_share_length": lambda: rwkv7(*longer, cp_context=ctx),
        "wrong_group_member": None,  # filled below
    }
    first_only = dist.new_group([0])    # every rank creates it; only rank 0 is a member
    bad["wrong_group_member"] = (lambda: build(first_only, list(cu))) if rank != 0 else None
    out = {}
    for name, call in bad.items():
        if call is None:
            continue
        with CountCollectives() as counter:
            try:
                call()
                out[name] = {"raised": None}
            except Exception as err:  # noqa: BLE001  (the test inspects the type)
                out[name] = {"raised": type(err).__name__, "message": str(err)}
        out[name]["collectives"] = counter.calls
    # ranks that disagree on the layout: found by build_context's one collective, on every rank
    shares = list(torch_dplr.cp.even_shares(100, world))
    if rank == world - 1:
        shares[0], shares[-1] = shares[0] - 1, shares[-1] + 1
    for name, kw in (("ranks_disagree_cu", dict(cu_seqlens=[0, 40 + rank, 100])),
                     ("ranks_disagree_shares", dict(cu_seqlens=list(cu), shares=shares))):
        try:
            build(None, **kw)
            out[name] = {"raised": None}
        except Exception as err:  # noqa: BLE001
            out[name] = {"raised": type(err).__name__, "message": str(err)}
    return out


def run_opcheck(world, rank, device):
    """torch.library.opcheck on the exchange ops (every rank runs the same checks)."""
    H, K, V, T = 2, 4, 3, 9
    L = 0 if rank == 0 else 5
    gen = torch.Generator().manual_seed(rank)

    def rand(*s, dtype=torch.float64):
        return torch.randn(*s, generator=gen, dtype=dtype).to(device).requires_grad_()
    join_args = (rand(1, T, H, V), rand(1, L, H, K), rand(1, H, K, K) * 0.3, rand(1, H, K, V),
                 rand(H, K, K + V) * 0.3, dist.group.WORLD.group_name, rank, world)
    join_args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a
                      for a in join_args)
    torch.library.opcheck(torch.ops.dplr.cp_join, join_args)
    o, y, h, transitions = torch.ops.dplr.cp_join(*join_args)
    bwd_args = (rand(1, T, H, V).detach(), rand(1, H, K, V).detach(), join_args[1].detach(),
                join_args[2].detach(), h.detach(), transitions.detach(), *join_args[5:])
    torch.library.opcheck(torch.ops.dplr.cp_join_bwd, bwd_args)
    return {"passed": True}


def run_no_grad(world, rank, device):
    """Without autograd (the fused no-grad forward on each rank): the same o and final states."""
    case = PARITY["varlen_fp64_c16"]
    cu, shares = case.layout(world)
    ctx = torch_dplr.cp.build_context(None, list(cu), shares=shares)
    inp = _inputs(case, cu, device)
    t = [ctx.shard(inp[n]) for n in GRAD_NAMES[:6]]
    with torch.no_grad():
        o, ht = _call(case, t, inp["initial_state"], cp_context=ctx)
    o_ref, ht_ref, _ = _reference(case, cu, inp)
    rows = list(ctx.final_state_rows)
    return {"o": rms_ratio(o, ctx.shard(o_ref)) if o.numel() else 0.0,
            "final_state": rms_ratio(ht[rows], ht_ref[rows]) if rows else 0.0}


def cases_for(world):
    cases = {name: functools.partial(run_parity, case) for name, case in PARITY.items()}
    cases.update(compile=run_compile, policies=run_policies, bad_inputs=run_bad_inputs,
                 no_grad=run_no_grad)
    if world == SMALLEST_WORLD:
        cases.update(world_of_one=run_world_of_one, opcheck=run_opcheck)
    return cases


def _worker(rank, world, init_file, out_dir):
    import warnings
    warnings.filterwarnings("ignore")
    # compiled code of this run only (a cache entry may predate an op's current definition)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(out_dir, f"inductor{rank}")
    device = _device(rank)
    torch.set_num_threads(1)   # the ranks share the machine's cores
    dist.init_process_group(BACKEND, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    results = {}
    try:
        for name, run in cases_for(world).items():
            start = time.perf_counter()
            try:
                results[name] = {"result": run(world, rank, device)}
            except Exception:  # noqa: BLE001  (reported to the test, which fails the case)
                results[name] = {"error": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - start
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The spawned groups and the assertions
# ----------------------------------------------------------------------------------------------

def _skip_reason(world):
    if BACKEND == "nccl" and torch.cuda.device_count() < world:
        return f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} present"
    if BACKEND not in ("gloo", "nccl"):
        return f"TORCH_DPLR_CP_BACKEND={BACKEND}: expected gloo or nccl"
    return None


@functools.lru_cache(maxsize=None)
def world_results(world):
    """Spawn ``world`` ranks once, run every case, return ``{case: [per-rank result]}``."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = mp.start_processes(_worker, args=(world, init_file, tmp), nprocs=world,
                                   join=False, start_method="spawn")
        deadline = time.monotonic() + WORLD_DEADLINE_S
        try:
            while not procs.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world}-rank group did not finish in "
                                       f"{WORLD_DEADLINE_S} s")
        finally:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return {name: [ranks[name] for ranks in per_rank] for name in per_rank[0]}


def case_result(world, name):
    reason = _skip_reason(world)
    if reason:
        pytest.skip(reason)
    ranks = world_results(world)[name]
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, f"case {name} failed on {len(errors)} rank(s):\n{errors[0]}"
    return [r["result"] for r in ranks]


def error_ratios(ranks):
    """RMS(err)/RMS(ref) per output over all ranks' shares together."""
    totals = {}
    for r in ranks:
        for name, (err2, ref2) in r["sums"].items():
            e, t = totals.get(name, (0.0, 0.0))
            totals[name] = (e + err2, t + ref2)
    return {n: math.sqrt(e / t) if t > 0 else math.sqrt(e) for n, (e, t) in totals.items()}


def _parity_params():
    return [pytest.param(w, name, id=f"w{w}-{name}") for w in WORLD_SIZES for name in PARITY]


@pytest.mark.parametrize("world,name", _parity_params())
def test_parity(world, name):
    case = PARITY[name]
    ranks = case_result(world, name)
    ratios = error_ratios(ranks)
    expected = {"o", "dq", "dk", "dv", "da", "db", "dgk"}
    expected |= {"final_state"} if case.output_final_state else set()
    expected |= {"dinitial_state"} if case.use_initial_state else set()
    assert set(ratios) == expected
    if case.dtype == "float64":
        bad = {n: e for n, e in ratios.items() if not e <= EXACT}
    else:
        out_tol, grad_tol = TOLERANCES[getattr(torch, case.dtype)]
        bad = {n: e for n, e in ratios.items()
               if not e <= (out_tol if n in ("o", "final_state") else grad_tol)}
    assert not bad, f"error ratios over the bar: {bad} (all: {ratios})"
    # every sequence's final state on exactly one rank, its initial state read on exactly one
    num_seqs = len(case.cu) - 1
    for rows in ("final_rows", "initial_rows"):
        assert sorted(n for r in ranks for n in r[rows]) == list(range(num_seqs)), rows
    for r in ranks:
        assert all(r["zero_elsewhere"].values()), r["zero_elsewhere"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_compile_fullgraph(world):
    for r in case_result(world, "compile"):
        for backend in COMPILE_BACKENDS.get(world, ("aot_eager",)):
            assert all(e <= 1e-12 for e in r[backend]["errors"]), (backend, r[backend])
        # a size that changes recompiles once, to a symbolic size (the share length, the
        # sequence count); the last layout changes every size and compiles nothing new
        new = r["aot_eager"]["new_graphs"]
        assert len(new) == len(COMPILE_LAYOUTS) and new[-1] == new[-2] <= 2, r["aot_eager"]
        if world > 1:
            assert r["aot_eager"]["join_fwd"] >= 1 and r["aot_eager"]["join_bwd"] >= 1
            assert r["aot_eager"]["join_in_bwd_graph"] == 0  # kept for the backward, not rerun


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_no_grad_forward(world):
    for r in case_result(world, "no_grad"):
        assert r["o"] <= EXACT and r["final_state"] <= EXACT, r


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_checkpoint_policies(world):
    for r in case_result(world, "policies"):
        errors = r["errors"]
        assert set(errors) == {"recompute_all", "save_state", "save_all", "checkpoint",
                               "keep_exchange", "save_state_compiled"}
        assert all(e <= 1e-12 for e in errors.values()), errors
        # one all-gather each way per step; a policy that recomputes dplr::cp_join (the
        # shipped ones, plain checkpointing) runs its forward all-gather once more, on every
        # rank; keeping it (extra_save_ops) does not
        calls = r["collectives"]
        if world == 1:  # no sequence crosses a rank boundary: nothing is exchanged
            assert set(calls.values()) == {0}, calls
            continue
        assert calls["none"] == calls["keep_exchange"] == 2, calls
        assert all(calls[p] == 3 for p in ("recompute_all", "save_state", "save_all",
                                           "checkpoint")), calls
        assert r["join_recomputed"] == 1


@pytest.mark.parametrize("world", [SMALLEST_WORLD])
def test_world_of_one_is_the_plain_call(world):
    for r in case_result(world, "world_of_one"):
        assert r["bitwise_equal"], r


@pytest.mark.parametrize("world", [SMALLEST_WORLD])
def test_exchange_ops_opcheck(world):
    assert all(r["passed"] for r in case_result(world, "opcheck"))


BAD_INPUTS = {  # case -> (error type, words the message must contain)
    "shares_sum": ("ValueError", "shares must add up"),
    "shares_count": ("ValueError", "one token count per rank"),
    "cu_not_monotonic": ("ValueError", "cu_seqlens must be non-decreasing"),
    "share_length": ("ValueError", "q holds"),
    "batch_not_one": ("ValueError", "B=2"),
    "cu_seqlens_given": ("ValueError", "cu_seqlens must not be passed with cp_context"),
    "initial_state_local_rows": ("ValueError", "initial_state holds every sequence"),
    "not_a_context": ("TypeError", "cp_context must come from"),
    "rwkv7_share_length": ("ValueError", "r holds"),
    "wrong_group_member": ("ValueError", "not a member"),
}


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_inputs_raise_before_any_collective(world):
    for rank, r in enumerate(case_result(world, "bad_inputs")):
        for name, (kind, words) in BAD_INPUTS.items():
            if name == "wrong_group_member" and rank == 0:
                continue
            got = r[name]
            assert got["raised"] == kind and words in got["message"], (rank, name, got)
            assert got["collectives"] == 0, (rank, name, got)
        disagreements = (("ranks_disagree_cu", "disagree on cu_seqlens"),
                         ("ranks_disagree_shares", "disagree on shares")) if world > 1 else ()
        for name, words in disagreements:
            got = r[name]
            assert got["raised"] == "ValueError" and words in got["message"], (rank, got)


def main():
    """Print the worst error ratio per output for every world size (the parity cases)."""
    for world in WORLD_SIZES:
        if _skip_reason(world):
            print(f"world {world}: skipped ({_skip_reason(world)})")
            continue
        results = world_results(world)
        for dtype in ("float64", "bfloat16"):
            worst = {}
            for name, case in PARITY.items():
                if case.dtype != dtype:
                    continue
                ranks = [r["result"] for r in results[name]]
                for out, e in error_ratios(ranks).items():
                    worst[out] = max(worst.get(out, 0.0), e)
            print(f"world {world} {dtype}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
        slowest = {name: max(r["seconds"] for r in ranks) for name, ranks in results.items()}
        print(f"world {world}: seconds per case (slowest rank): "
              + ", ".join(f"{n} {t:.1f}" for n, t in slowest.items()))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
