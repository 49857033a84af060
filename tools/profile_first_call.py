"""Where a fresh process's first forward+backward spends its host time (cProfile).

Builds the inputs as :mod:`benchmarks.first_call` does and imports ``torch._dynamo`` as it does
(PyTorch's cost on the first custom-op call, timed apart there too), then runs the first
forward+backward under cProfile (imports and input creation are timed apart, not profiled) and
prints the functions with the most cumulative and the most own time.  Run it after the kernel
cache is filled (e.g. after ``python -m torch_dplr precompile``) to see the warm first call:

    python3 tools/profile_first_call.py --device cuda --top 40
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="8,4096,32,64", help="B,T,H,D")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    import torch

    from benchmarks import first_call
    from benchmarks.cells import Shape

    B, T, H, D = (int(x) for x in args.shape.split(","))
    device = torch.device(args.device)
    fwd_bwd, _ = first_call._steps(Shape(B, T, H, D), 64, "rwkv7", device)
    import torch._dynamo  # noqa: F401  (as benchmarks.first_call: not part of the call's time)
    setup_s = time.perf_counter() - start
    profiler = cProfile.Profile()
    profiler.enable()
    step_s = first_call._timed(fwd_bwd, device)
    profiler.disable()
    print(json.dumps({"imports_and_inputs_s": round(setup_s, 3), "first_fwd_bwd_s": round(step_s, 3)}))
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(args.top)
        print(f"== by {order}\n" + out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
