"""Host cost of how a rect call gets its chunk tables, A/B in one process on a CUDA host.

``torch_dplr.ops.varlen`` copies a rect call's packed tables from a pinned host copy (one
asynchronous copy); the alternative computes them on the device in a dozen tiny launches
(``_rect_packed_closed_form``, which CUDA-graph capture uses).  This script times eager
steps of the public function with each, in alternating blocks (so drift on the host falls on
both), and prints the median wall microseconds per step (synchronized every block of 30): the
no-grad forward, forward+backward, and forward+backward under the ``save_state`` policy.
Small grids are host-bound, so that is where it shows.  Not a test.

    python tools/ab_chunk_tables.py                 # the small grid: B2 T4096 H8 D64, chunk 64
    python tools/ab_chunk_tables.py 2 4096 8 64 16
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from host_probe import training_steps  # tools/ is this script's folder: first on sys.path
from torch_dplr.ops import varlen

BLOCKS, STEPS = 8, 30


def _wall_us(step) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / STEPS * 1e6


def main():
    B, T, H, D, C = (int(x) for x in (sys.argv[1:6] if len(sys.argv) > 5 else (2, 4096, 8, 64, 64)))
    steps = training_steps(B, T, H, D, C)
    variants = {"async_copy": varlen._rect_packed,
                "closed_form": varlen._rect_packed_closed_form}
    for step in steps.values():  # kernels loaded, host copy built, allocator warm
        for _ in range(5):
            step()
    times = {name: {v: [] for v in variants} for name in steps}
    try:
        for block in range(BLOCKS):
            order = list(variants) if block % 2 == 0 else list(reversed(variants))
            for variant in order:
                varlen._rect_packed = variants[variant]
                for name, step in steps.items():
                    times[name][variant].append(_wall_us(step))
    finally:
        varlen._rect_packed = variants["async_copy"]
    print(json.dumps({"shape": [B, T, H, D], "chunk": C, **{
        name: {v: round(statistics.median(t), 1) for v, t in per.items()}
        for name, per in times.items()}}))


if __name__ == "__main__":
    main()
