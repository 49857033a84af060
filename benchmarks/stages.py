"""Where the time goes: the stage ops of the chunked path, each timed on its own.

For one stage cell (shape, chunk size, gate style, state) it takes the harness's inputs
(:mod:`benchmarks.inputs`: the recipe of ``torch_dplr.testing.make_inputs``) and runs the six
``torch.ops.dplr`` stage ops once, in the order and with the arguments that
``torch_dplr.api._chunk`` and the ops' autograd functions use, so each op's inputs are what the
ops before it produced (the backward ops get the output gradient ``do`` and, with state, the
final-state gradient ``dht``).  Then it times each op alone with the harness's
:class:`~benchmarks.timing.Timer` (CUDA events, warm-up, median, L2 flushed between reps).
``chunk_state_fwd`` is timed twice: keeping ``h`` / ``v_new`` for the backward (``:keep``, what
a training call runs) and not (``:nokeep``).  ``chunk_fwd_fused`` is the no-grad call's one op:
its fused kernel where that applies (``fused_kernel`` true), else the three staged forward ops.

One ``stage`` record per op: ``ms``; ``bytes``, its compulsory traffic (the nbytes of its
tensor inputs and outputs: every input read once, every output written once; a kernel that
re-reads or spills moves more); ``gb_s`` = bytes / time; ``bw_fraction`` = gb_s / 4300, the HBM
bandwidth an H200 sustains.  One ``stage_sum`` record per path compares the sum over the path's
ops with the public function timed end to end by the same timer: ``fwd`` (the fused op where
its kernel applies, else intra, WY, state without activations) against a no-grad call,
``fwd_bwd`` (intra, WY, state with activations and the three backward ops) against
forward+backward without checkpointing.  ``glue_ms``, the
difference, is what runs outside the stage ops: dispatch and autograd, allocation, zero-filled
missing gradients, the sum of the two ``dv`` parts.  ``io_bytes`` is the public call's own
inputs and outputs moved once, the floor of a fully fused implementation.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import torch_dplr

from . import calls
from .cells import Cell
from .inputs import Inputs
from .timing import Timer

HBM_GB_S = 4300.0  # what an H200 sustains (issue 4)
STAGE_SUM = "stage_sum"
RECORD_MODES = ("stage", STAGE_SUM)
KEEP, NO_KEEP = "chunk_state_fwd:keep", "chunk_state_fwd:nokeep"
FUSED = "chunk_fwd_fused"
OPS = ("chunk_intra_fwd", "chunk_wy_fwd", KEEP, NO_KEEP, "chunk_state_bwd", "chunk_wy_bwd",
       "chunk_intra_bwd", FUSED)
# The ops each end-to-end path runs (a no-grad forward keeps no activations; where the fused
# kernel applies it is the one op FUSED instead, see path_ops).
PATHS = {"fwd": ("chunk_intra_fwd", "chunk_wy_fwd", NO_KEEP),
         "fwd_bwd": ("chunk_intra_fwd", "chunk_wy_fwd", KEEP, "chunk_state_bwd", "chunk_wy_bwd",
                     "chunk_intra_bwd")}


def traffic_bytes(*groups) -> int:
    """Sum of the nbytes of the tensors in ``groups`` (non-tensors count nothing)."""
    return sum(x.nbytes for group in groups for x in group if isinstance(x, torch.Tensor))


@dataclasses.dataclass
class StageCall:
    """One stage op with its arguments, and the outputs of one run of it."""

    op: str
    fn: Callable
    args: tuple
    outputs: tuple = ()

    def __call__(self):
        return self.fn(*self.args)

    @property
    def bytes(self) -> int:
        return traffic_bytes(self.args, self.outputs)


def _sentinels(cell: Cell, inp: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens, initial state and final-state gradient, size 0 when absent (as the API passes)."""
    none = inp.q.new_empty(0, dtype=torch.float32)
    cu = inp.cu_seqlens if inp.cu_seqlens is not None else inp.q.new_empty(0, dtype=torch.int64)
    return cu, inp.h0 if cell.state else none, inp.dht if cell.state else none


def _gate_bound(cell: Cell, inp: Inputs) -> float:
    """The declared gate bound the ops get (-inf: none), as the API passes it."""
    bound = calls.call_kwargs(cell, inp)["lower_bound"]
    return float("-inf") if bound is None else float(bound)


@torch.no_grad()
def stage_calls(cell: Cell, inp: Inputs) -> dict[str, StageCall]:
    """Runs every op of OPS once on realistic inputs; returns them ready to be timed again."""
    dplr = torch.ops.dplr
    kwargs = calls.call_kwargs(cell, inp)
    scale, C = kwargs["scale"], cell.chunk_size
    bound = _gate_bound(cell, inp)
    cu, h0, dht = _sentinels(cell, inp)
    q, k, v, a, b, gk = inp.q, inp.k, inp.v, inp.a, inp.b, inp.gk
    # the chunk tables, built once as the public functions do (not part of any stage's time)
    tables = dplr.chunk_tables(cu, q.shape[0], q.shape[1], C)
    done = {}

    def run(op, fn, *args):
        done[op] = StageCall(op, fn, args)
        done[op].outputs = tuple(done[op]())
        return done[op].outputs

    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = run(
        "chunk_intra_fwd", dplr.chunk_intra_fwd, q, k, a, b, gk, cu, scale, C, bound, tables)
    A_ab_inv, w, u = run("chunk_wy_fwd", dplr.chunk_wy_fwd, A_ab, A_ak, ag, v, cu, C, tables)
    state_args = (qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0, cu, C, cell.state)
    _, _, h, v_new = run(KEEP, dplr.chunk_state_fwd, *state_args, True, tables)
    run(NO_KEEP, dplr.chunk_state_fwd, *state_args, False, tables)
    dqg, dkg, dbg, dw, du, _, dA_qk, dA_qb, dgl, _ = run(
        "chunk_state_bwd", dplr.chunk_state_bwd, qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new,
        inp.do, dht, h0, cu, C, cell.state, cell.state, tables)
    dA_ab, dA_ak, dag, _ = run("chunk_wy_bwd", dplr.chunk_wy_bwd, A_ab_inv, A_ak, ag, v, dw, du,
                               cu, C, tables)
    run("chunk_intra_bwd", dplr.chunk_intra_bwd, q, k, a, b, gk, cu, gl, dgl, dA_qk, dA_qb, dA_ak,
        dA_ab, dqg, dkg, dag, dbg, scale, C, bound, tables)
    run(FUSED, dplr.chunk_fwd_fused, q, k, v, a, b, gk, h0, cu, scale, C, bound, cell.state,
        tables)
    return done


def fused_kernel_runs(cell: Cell, inp: Inputs) -> bool:
    """Whether ``chunk_fwd_fused`` runs its fused kernel for this cell (CUDA only)."""
    if inp.q.device.type != "cuda":
        return False
    from torch_dplr.ops.fused import fused_kernel

    cu, _, _ = _sentinels(cell, inp)
    return fused_kernel(inp.q, inp.v, inp.gk, cu, cell.chunk_size, _gate_bound(cell, inp)) is not None


def path_ops(path: str, fused: bool) -> tuple[str, ...]:
    return (FUSED,) if path == "fwd" and fused else PATHS[path]


def io_bytes(cell: Cell, inp: Inputs, path: str) -> int:
    """The public call's inputs and outputs, each moved once (o and the gradients: like their inputs)."""
    data = (inp.q, inp.k, inp.v, inp.a, inp.b, inp.gk) + ((inp.h0,) if cell.state else ())
    fwd = traffic_bytes(data, (inp.v,), (inp.h0,) if cell.state else ())  # + o, final state
    if path == "fwd":
        return fwd
    return fwd + traffic_bytes((inp.do,), (inp.dht,) if cell.state else (), data)  # + grads


def _bandwidth(nbytes: int | None, ms: float | None) -> dict:
    if not nbytes or not ms:
        return {"gb_s": None, "bw_fraction": None}
    gb_s = nbytes / (ms * 1e6)
    return {"gb_s": round(gb_s, 1), "bw_fraction": round(gb_s / HBM_GB_S, 4)}


def _base(cell: Cell, meta: dict, suffix: str, mode: str) -> dict:
    return {**cell.fields(), **meta, "cell": f"{cell.id}/{suffix}", "stage_cell": cell.id,
            "mode": mode}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _timed_ms(timer: Timer, fn: Callable, grad: bool) -> dict:
    """{"ms": median} or {"error": why}; a failure (e.g. out of memory) must not end the run."""
    try:
        with torch.set_grad_enabled(grad):
            m = timer.measure(fn)
        return {"ms": round(m.ms, 4), "reps": m.reps,
                "spread_ms": [round(m.min_ms, 4), round(m.max_ms, 4)]}
    except Exception as exc:  # noqa: BLE001
        return {"error": _error(exc)}


def stage_record(cell: Cell, call: StageCall, timer: Timer, meta: dict) -> dict:
    timed = _timed_ms(timer, call, grad=False)
    record = {**_base(cell, meta, call.op, "stage"), "op": call.op, "ms": timed.get("ms"),
              "bytes": call.bytes, **_bandwidth(call.bytes, timed.get("ms"))}
    record.update({k: v for k, v in timed.items() if k in ("reps", "spread_ms")})
    if "error" in timed:
        record["stage_error"] = timed["error"]
    return record


def end_to_end_steps(cell: Cell, inp: Inputs) -> dict[str, tuple[Callable, bool]]:
    """The public function as the harness times it: (step, grad) per path."""
    entry = calls.ENTRY[cell.gates]
    fn = calls.in_dplr_order(entry, getattr(torch_dplr, entry))
    leaves = inp.leaves()
    return {"fwd": (calls.fwd_step(fn, inp, calls.call_kwargs(cell, inp)), False),
            "fwd_bwd": (calls.fwd_bwd_step(fn, leaves, calls.call_kwargs(cell, leaves)), True)}


def sum_record(cell: Cell, path: str, ops: dict[str, dict], end_to_end: dict, nbytes: int,
               meta: dict, fused: bool = False) -> dict:
    """A path's stages (their records in ``ops``) against its end-to-end time."""
    names = path_ops(path, fused)
    parts = [ops[op] for op in names]
    stages_ms = None if any(p["ms"] is None for p in parts) else round(sum(p["ms"] for p in parts), 4)
    e2e = end_to_end.get("ms")
    stage_bytes = sum(p["bytes"] for p in parts)
    record = {**_base(cell, meta, path, STAGE_SUM), "path": path, "ops": list(names),
              "stages_ms": stages_ms, "end_to_end_ms": e2e,
              "glue_ms": None if stages_ms is None or e2e is None else round(e2e - stages_ms, 4),
              "bytes": stage_bytes, **_bandwidth(stage_bytes, stages_ms), "io_bytes": nbytes}
    if "error" in end_to_end:
        record["end_to_end_error"] = end_to_end["error"]
    return record


def measure(cell: Cell, inp: Inputs, timer: Timer, meta: dict) -> list[dict]:
    """The stage cell's records: one ``stage`` record per op of OPS, one ``stage_sum`` per path.

    ``inp``: the inputs without grad (the end-to-end forward+backward makes its own leaves).
    """
    try:
        stage_ops = stage_calls(cell, inp)
    except Exception as exc:  # noqa: BLE001  (e.g. out of memory: say so and go on)
        return [{**_base(cell, meta, "inputs", "stage"), "op": None, "ms": None, "bytes": None,
                 "gb_s": None, "bw_fraction": None, "stage_error": _error(exc)}]
    ops = {op: stage_record(cell, stage_ops[op], timer, meta) for op in OPS}
    del stage_ops
    fused = fused_kernel_runs(cell, inp)
    ops[FUSED]["fused_kernel"] = fused
    sums = []
    for path, (step, grad) in end_to_end_steps(cell, inp).items():
        end_to_end = _timed_ms(timer, step, grad)
        sums.append(sum_record(cell, path, ops, end_to_end, io_bytes(cell, inp, path), meta, fused))
    return list(ops.values()) + sums


def done_stage_cells(records: list[dict]) -> set[str]:
    """Stage cells whose records are all present and free of errors (``--resume`` skips them)."""
    by_cell: dict[str, list[dict]] = {}
    for r in records:
        if r.get("mode") in RECORD_MODES and r.get("stage_cell"):
            by_cell.setdefault(r["stage_cell"], []).append(r)
    expected = set(OPS) | {f"{STAGE_SUM}:{p}" for p in PATHS}

    def complete(rs):
        seen = {r.get("op") if r["mode"] == "stage" else f"{STAGE_SUM}:{r.get('path')}" for r in rs}
        return seen == expected and not any(k.endswith("_error") for r in rs for k in r)
    return {cell for cell, rs in by_cell.items() if complete(rs)}


def progress_line(record: dict) -> str:
    def num(key, fmt):
        return "-" if record.get(key) is None else fmt.format(record[key])
    if record["mode"] == STAGE_SUM:
        return (f"{record['cell']:<60} stages {num('stages_ms', '{:.3f}')} ms, end to end "
                f"{num('end_to_end_ms', '{:.3f}')} ms, glue {num('glue_ms', '{:.3f}')} ms")
    error = f"  stage_error: {record['stage_error']}" if record.get("stage_error") else ""
    mb = None if record.get("bytes") is None else record["bytes"] / 1e6
    return (f"{record['cell']:<60} {num('ms', '{:8.3f}')} ms  {'-' if mb is None else f'{mb:9.1f}'} MB"
            f"  {num('gb_s', '{:7.0f}')} GB/s  {num('bw_fraction', '{:.0%}')} of {HBM_GB_S:.0f}{error}")
