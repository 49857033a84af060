"""Where a greedy ``generate`` spends its time, on FLA's kernels and under ``patch_fla()``.

The model and call are ``benchmarks.layers``' generation record (``GENERATE``). For each of
the two runs, after one warm-up call: the wall time of one call; the device syncs it makes
(``torch.cuda.set_sync_debug_mode("warn")``, counted by the Python line that made each);
``torch.profiler``'s operators by self CPU time and by device time; and ``cProfile``'s
functions by own time. A decode loop is host-bound, so the CPU columns are the ones to read.
Then both runs' wall times over ``--reps`` calls, alternating which runs first (one call's wall
time varies by more than the two runs differ): median, min and max.

    python tools/profile_generate.py [--new-tokens 32] [--top 25] [--reps 7] > profile.txt
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.layers import GENERATE, _load_fla, generate_call  # noqa: E402


def _syncs(generate) -> collections.Counter:
    """Device syncs of one call, by the Python file and line whose call synchronized."""
    counts: collections.Counter = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            counts[f"{os.path.basename(w.filename)}:{w.lineno}"] += 1
    return counts


def _wall_ms(generate) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    generate()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _report(name: str, generate, top: int) -> None:
    generate()  # warm-up: first calls compile
    print(f"=== {name}: {_wall_ms(generate):.1f} ms wall for one call")
    syncs = _syncs(generate)
    print(f"device syncs: {sum(syncs.values())}", dict(syncs.most_common(10)))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        generate()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=top))
    print(table.table(sort_by="self_device_time_total", row_limit=top // 2))
    profiler = cProfile.Profile()
    profiler.enable()
    generate()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(text.getvalue())


def _alternating_walls(generate, patched, reps: int) -> None:
    """Wall ms of ``generate`` on FLA and under ``patched()`` (a context manager), ``reps``
    calls each, the order swapped every rep."""
    walls: dict = {"FLA": [], "patch_fla()": []}
    for rep in range(reps):
        runs = [("FLA", contextlib.nullcontext), ("patch_fla()", patched)]
        for name, context in runs if rep % 2 == 0 else runs[::-1]:
            with context():
                walls[name].append(_wall_ms(generate))
    for name, times in walls.items():
        print(f"{name}: median {statistics.median(times):.1f} ms, min {min(times):.1f}, "
              f"max {max(times):.1f} over {reps} calls")
    ratio = statistics.median(walls["FLA"]) / statistics.median(walls["patch_fla()"])
    print(f"FLA / patch_fla(): {ratio:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--new-tokens", type=int, default=GENERATE["new_tokens"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--reps", type=int, default=7,
                        help="alternating wall-time calls of each run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_generate times FLA's CUDA kernels: no CUDA GPU here")
    import torch_dplr
    fla = _load_fla()
    config = {**GENERATE, "new_tokens": args.new_tokens}
    generate = generate_call(torch.device("cuda"), **config)
    with torch.no_grad(), fla.route("triton"):
        try:
            _report("FLA", generate, args.top)
            with torch_dplr.patch_fla():
                _report("patch_fla()", generate, args.top)
            print("=== wall time, alternating")
            _alternating_walls(generate, torch_dplr.patch_fla, args.reps)
        except Exception:  # the other run's report is still worth reading
            traceback.print_exc()
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
