"""Times ``dplr::chunk_state_bwd`` with each of its GPU implementations on the same inputs.

The op picks the split kernels (csrc_tl/state_bwd_split.py) when a call has at most SMs/4
(sequence, head) pairs and the single kernel (csrc_tl/state_bwd.py) otherwise
(``torch_dplr.ops.state._split_backward_pays``).  This script overrides that choice both ways
for each shape, times the op with the benchmark's stage calls and timer (L2 flushed), checks
that the two agree, and prints one JSON line per shape.  Not a test; it chose the rule.

    python tools/ab_state_bwd.py                       # the envelope's shapes, chunk 64
    python tools/ab_state_bwd.py --chunk 16 --shapes 2,4096,8,64 1,65536,32,64
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.cells import SHAPES, Cell, Shape
from benchmarks.inputs import make
from benchmarks.stages import stage_calls
from benchmarks.timing import Timer
from torch_dplr.ops import state

OP = "chunk_state_bwd"


def _timed(cell, inp, timer, split: bool):
    chosen = state._split_backward_pays
    state._split_backward_pays = lambda *shapes: split
    try:
        call = stage_calls(cell, inp)[OP]
        return timer.measure(call).ms, call.outputs
    finally:
        state._split_backward_pays = chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", help="B,T,H,D[,N] (default: the envelope's shapes)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--gates", default="rwkv7")
    args = p.parse_args(argv)
    shapes = SHAPES
    if args.shapes:
        shapes = [Shape(*(int(x) for x in s.split(","))) for s in args.shapes]
    timer = Timer("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in shapes:
        cell = Cell(shape, args.chunk, args.gates, True, "stage")
        inp = make(shape, args.gates, "cuda")
        single_ms, single = _timed(cell, inp, timer, split=False)
        split_ms, split = _timed(cell, inp, timer, split=True)
        agree = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-3)
                    for a, b in zip(single, split))
        pairs = shape.num_states * shape.H
        print(json.dumps({"shape": shape.label, "chunk": args.chunk, "pairs": pairs,
                          "dispatch_picks_split": state.few_pairs(pairs, sms),
                          "single_ms": round(single_ms, 4), "split_ms": round(split_ms, 4),
                          "agree": agree}), flush=True)
        del inp
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
