"""Timing one callable: CUDA events around each repetition, median, L2 flushed between reps.

Protocol per (implementation, cell): one first call (compiles, autotunes; timed on the host
clock and reported apart), up to ``warmup`` more calls (the first of them always runs: the
number of repetitions is sized on it), then ``reps`` repetitions, each after zeroing a buffer
larger than the L2 cache so every rep reads its inputs from HBM.  The number of repetitions
shrinks so that they fit ``cap_s`` seconds (the per-cell time cap); a call slower than the cap
is timed once.  Peak memory is measured in one extra call:
``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus what was
allocated before the call (so it counts what the call itself allocates: outputs, kept
intermediates, gradients), in MB (1e6 bytes).  On the CPU the host clock times each rep and
peak memory is not measured.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 * 2 ** 20  # H200: 60 MB of L2


@dataclasses.dataclass
class Measurement:
    ms: float  # median over reps
    reps: int
    first_call_s: float
    min_ms: float
    max_ms: float
    peak_mb: float | None

    def fields(self, prefix: str) -> dict:
        return {f"{prefix}_ms": round(self.ms, 4), f"{prefix}_peak_mb": _round(self.peak_mb),
                f"{prefix}_reps": self.reps, f"{prefix}_first_call_s": round(self.first_call_s, 3),
                f"{prefix}_spread_ms": [round(self.min_ms, 4), round(self.max_ms, 4)]}


def _round(x, nd=1):
    return None if x is None else round(x, nd)


class Timer:
    def __init__(self, device, reps=20, warmup=3, cap_s=20.0, flush_l2=True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.reps, self.warmup, self.cap_s = reps, warmup, cap_s
        self._flush = (torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=self.device)
                       if self.cuda and flush_l2 else None)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _wall(self, fn: Callable) -> float:
        self._sync()
        start = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - start

    def _rep_ms(self, fn: Callable, count: int) -> list[float]:
        if not self.cuda:
            return [self._wall(fn) * 1e3 for _ in range(count)]
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(count)]
        for start, end in events:
            if self._flush is not None:
                self._flush.zero_()
            start.record()
            fn()
            end.record()
        self._sync()
        return [start.elapsed_time(end) for start, end in events]

    def peak_mb(self, fn: Callable) -> float | None:
        if not self.cuda:
            return None
        self._sync()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        self._sync()
        return (torch.cuda.max_memory_allocated(self.device) - before) / 1e6

    def measure(self, fn: Callable) -> Measurement:
        first_s = self._wall(fn)
        # the rep count comes from a steady call, never from the first one, which may compile
        # or autotune (FLA's first calls can take 20-160 s; counting reps from them would leave
        # a cell with one rep, timed right after tuning)
        last_s = self._wall(fn) if self.warmup else first_s
        for _ in range(self.warmup - 1):
            if last_s > self.cap_s:
                break
            last_s = self._wall(fn)
        reps = max(1, min(self.reps, int(self.cap_s / max(last_s, 1e-6))))
        times = self._rep_ms(fn, reps)
        return Measurement(statistics.median(times), reps, first_s, min(times), max(times),
                           self.peak_mb(fn))
