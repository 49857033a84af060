"""Where time parallelism pays: torch_dplr cut into S segments per sequence against uncut, and
FLA's two routes, in one process on the same inputs.

``torch_dplr/time_parallel.py`` runs a rect call as ``B·S`` segments joined by the affine chunk
map when ``TORCH_DPLR_TIME_SEGMENTS=S``.  It doubles the chunk-local work, so it can pay only
where the serial walk along each sequence leaves SMs idle: few (sequence, head) pairs, long
sequences.  This times each shape at chunk 64 with RWKV-7 gates, no state, forward (no grad)
and forward+backward, for every S that divides the shape (``T % (S·64) == 0``), and FLA's
Triton and TileLang routes beside them; one JSON line per (shape, mode, implementation).

    python -m benchmarks.time_segments --out benchmarks/results/h200-time-segments.jsonl
"""
from __future__ import annotations

import argparse

import torch

from . import harness, inputs
from .cells import Cell, Shape, tiny
from .envvars import scoped_env
from .fla_routes import FLA, ROUTES
from .jsonl import emit
from .timing import Timer

# the envelope's long sequence and small grid, and the design shape as the control (shapes whose
# FLA tuning the carried autotune results hold)
SHAPES = (Shape(1, 65536, 32, 64), Shape(2, 4096, 8, 64), Shape(8, 4096, 32, 64))
SEGMENTS = (1, 2, 4, 8, 16)
CHUNK = 64
ENV = "TORCH_DPLR_TIME_SEGMENTS"


def run_shape(shape: Shape, timer: Timer, fla: FLA | None, out, segments=SEGMENTS) -> None:
    """Every (mode, implementation) of one shape, as the harness times its cells."""
    inp = inputs.make(shape, "rwkv7", timer.device)
    leaves = inp.leaves()
    for mode in ("fwd", "fwd_bwd"):
        cell = Cell(shape, CHUNK, "rwkv7", state=False, mode=mode)
        tensors = inp if mode == "fwd" else leaves
        for S in segments:
            if shape.T % (S * CHUNK) == 0:
                with scoped_env(ENV, str(S)):
                    out(dict(cell.fields(), impl="torch_dplr", segments=S,
                             **harness.time_torch_dplr(cell, tensors, timer)))
        for route in ROUTES if fla is not None else ():
            try:
                fields = harness.time_fla(cell, tensors, timer, fla, route)
            except Exception as exc:  # noqa: BLE001  (recorded; the other cells still run)
                fields = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            out(dict(cell.fields(), impl=f"fla_{route}", **fields))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="append JSON lines here (also printed)")
    parser.add_argument("--shapes", help="comma list of shape labels, e.g. B1-T65536-H32-D64 "
                        "(default: all of SHAPES)")
    parser.add_argument("--no-fla", action="store_true", help="time torch_dplr alone")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present; the CPU "
                        "runs shrunk shapes, a smoke test)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    wanted = None if args.shapes is None else set(args.shapes.split(","))
    fla, problem = harness.load_fla(args, device)
    if problem:
        print(problem)
    cpu = device.type == "cpu"
    timer = Timer(device, reps=3 if cpu else args.reps, warmup=0 if cpu else 3)
    name = "cpu" if cpu else torch.cuda.get_device_name(device)

    def out(rec):
        emit(dict(rec, device=name), args.out)

    for shape in SHAPES:
        if wanted is None or shape.label in wanted:
            run_shape(tiny(shape) if cpu else shape, timer, fla, out)


if __name__ == "__main__":
    main()
