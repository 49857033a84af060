"""Times stage ops with kernel schedule knobs other than the defaults, to choose defaults.

For each candidate ``op:knob=value[,knob=value]`` the dispatch's kernel configuration of that op
(:func:`torch_dplr.ops.kernels.pipeline`) gets the knobs added, and the stage op is timed with
the benchmark's stage calls and timer (same inputs, L2 flushed) next to the default; its
outputs are compared with the default's. One JSON line per candidate. Not a test.

    python tools/tune_knobs.py intra_fwd:threads=256 fused_fwd:trim_chain=true [--T 4096 --D 64 ...]
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.cells import Cell, Shape
from benchmarks.harness import card_meta
from benchmarks.inputs import make
from benchmarks.stages import FUSED, stage_calls
from benchmarks.timing import Timer
from torch_dplr.ops import kernels


STAGE_CALL = {"fused_fwd": FUSED}  # kernel name -> stage call name, where they differ


def _value(text: str):
    """A knob's value from the command line: a bool, an int, or the string as given."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text) if text.lstrip("-").isdigit() else text


def parse(candidate: str) -> tuple[str, dict]:
    op, _, knobs = candidate.partition(":")
    values = dict(kv.split("=") for kv in knobs.split(",") if kv)
    return op, {k: _value(v) for k, v in values.items()}


def with_knobs(op: str, knobs: dict):
    """A pipeline() whose config of ``op`` carries ``knobs`` (the kernel cache keys on them)."""
    default = kernels.pipeline

    def patched(*key):
        table = dict(default(*key))
        if op in table:  # configurations without this kernel (the fused one needs a bound) keep theirs
            factory, config = table[op]
            table[op] = (factory, {**config, **knobs})
        return table
    return default, patched


def run_op(cell, inp, op):
    calls = stage_calls(cell, inp)
    name = STAGE_CALL.get(op, f"chunk_{op}")
    return calls[name] if name in calls else calls[f"{name}:keep"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("candidates", nargs="+")
    for n, d in (("B", 8), ("T", 4096), ("H", 32), ("D", 64), ("chunk", 64)):
        p.add_argument(f"--{n}", type=int, default=d)
    args = p.parse_args()
    cell = Cell(Shape(args.B, args.T, args.H, args.D), args.chunk, "rwkv7", False, "stage")
    inp = make(cell.shape, "rwkv7", "cuda")
    timer = Timer("cuda")
    meta = card_meta(torch.device("cuda"))  # the card and commit each record names
    for candidate in args.candidates:
        op, knobs = parse(candidate)
        base = run_op(cell, inp, op)
        base_ms = timer.measure(base).ms
        default, patched = with_knobs(op, knobs)
        kernels.pipeline, kernels._kernels = patched, {}
        try:
            tuned = run_op(cell, inp, op)
            ms = timer.measure(tuned).ms
            same = all(torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-3, equal_nan=True)
                       for x, y in zip(tuned.outputs, base.outputs))
            record = dict(op=op, knobs=knobs, default_ms=round(base_ms, 4), ms=round(ms, 4),
                          matches_default=same)
        except Exception as exc:  # noqa: BLE001 (a knob this config rejects: say so, go on)
            record = dict(op=op, knobs=knobs, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            kernels.pipeline, kernels._kernels = default, {}
        print(json.dumps({"cell": cell.id, **record, **meta}), flush=True)


if __name__ == "__main__":
    main()
