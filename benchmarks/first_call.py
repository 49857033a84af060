"""First-call cost of torch_dplr, measured in this (fresh) process; prints one JSON line.

The harness runs it twice as a subprocess: with ``TILELANG_CACHE_DIR`` pointing at an empty
folder (cold: every kernel compiles) and again on the folder the first run filled (warm: kernels
load from disk).  In order it times, each synchronized on the host clock:

- ``dynamo_import_s``: ``import torch._dynamo``.  PyTorch does this on the first call of any
  ``torch.library.custom_op`` (its op bodies run under ``torch._disable_dynamo``, which imports
  Dynamo lazily), so an eager process pays it inside the first call of torch_dplr or of any other
  custom-op library, while a process that uses ``torch.compile`` has paid it already.  It is
  timed apart, before the call, so that the call's time is torch_dplr's own;
- ``fwd_bwd_s``: the first forward+backward (RWKV-7 gates, initial and final state), so every
  kernel a training step needs is built or loaded inside it; ``kernels_s``: the part of it
  spent compiling or loading kernels (TileLang import included);
- ``fwd_s``: then a no-grad forward (which may use kernels of its own, e.g. a fused forward);
- ``new_layout_s``: then forward+backward at a new B and T, at a new varlen layout and at a
  single sequence (a small grid), which must compile nothing (a few ms when it holds, seconds
  when something recompiles).

With ``--profile N`` the first forward+backward runs under cProfile and ``profile`` holds the
N functions with the most time of their own (C functions included: a kernel launch, the
autograd engine) and the N with the most time under them: where a warm first call's time goes
beyond ``kernels_s`` (the harness runs it as a third process, apart from the timed two, since
the profiler slows Python).

    python -m benchmarks.first_call --device cuda --shape 8,4096,32,64 --chunk-size 64
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import pstats
import time
from pathlib import Path

T0 = time.perf_counter()

import torch  # noqa: E402

from .cells import Cell, Shape  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _steps(shape: Shape, chunk_size: int, gates: str, device):
    """(forward+backward step, no-grad forward step) of chunk_rwkv7/chunk_dplr_delta_rule."""
    import torch_dplr

    from . import calls, inputs
    cell = Cell(shape, chunk_size, gates, True, "fwd_bwd")
    entry = calls.ENTRY[gates]
    fn = calls.in_dplr_order(entry, getattr(torch_dplr, entry))
    inp = inputs.make(shape, gates, device)
    leaves = inp.leaves()
    return (calls.fwd_bwd_step(fn, leaves, calls.call_kwargs(cell, leaves)),
            calls.fwd_step(fn, inp, calls.call_kwargs(cell, inp)))


def new_layouts(shape: Shape) -> tuple[Shape, Shape, Shape]:
    """A rect shape with another B and T (not a chunk multiple), a new varlen layout, and one
    sequence: a small grid (H (sequence, head) pairs), which on the H200 runs the split state
    backward (``ops.state.few_pairs``) at the envelope's H <= 32."""
    return (Shape(max(1, shape.B // 4), shape.T // 4 + 7, shape.H, shape.D),
            Shape(1, shape.T // 2, shape.H, shape.D, N=5),
            Shape(1, shape.T // 8 + 3, shape.H, shape.D))


def _where(key) -> str:
    path, line, name = key
    return name if path == "~" else f"{Path(path).name}:{line}({name})"  # "~": a C function


def profile_summary(profile: cProfile.Profile, top: int) -> dict:
    """The ``top`` functions by own time and by cumulative time, as [where, seconds] pairs."""
    entries = pstats.Stats(profile).stats.items()  # (path, line, name) -> (cc, nc, tt, ct, callers)

    def ranked(col):
        best = sorted(entries, key=lambda kv: kv[1][col], reverse=True)[:top]
        return [[_where(key), round(stat[col], 3)] for key, stat in best]
    return {"by_self": ranked(2), "by_cumulative": ranked(3)}


def measure(shape: Shape, chunk_size: int, gates: str, device, profile_top: int = 0) -> dict:
    device = torch.device(device)
    fwd_bwd, fwd = _steps(shape, chunk_size, gates, device)
    from torch_dplr.ops import kernels

    result = {"import_s": round(time.perf_counter() - T0, 3)}
    start = time.perf_counter()
    importlib.import_module("torch._dynamo")  # see the module doc: PyTorch's cost, not ours
    result["dynamo_import_s"] = round(time.perf_counter() - start, 3)
    profile = cProfile.Profile() if profile_top else None
    if profile is not None:
        profile.enable()
    result["fwd_bwd_s"] = round(_timed(fwd_bwd, device), 3)
    if profile is not None:
        profile.disable()
        result["profile"] = profile_summary(profile, profile_top)
    result["kernels_s"] = round(kernels.seconds_getting_kernels(), 3)
    result["fwd_s"] = round(_timed(fwd, device), 3)
    new = 0.0
    for other in new_layouts(shape):
        step, _ = _steps(other, chunk_size, gates, device)
        new += _timed(step, device)
    result["new_layout_s"] = round(new, 3)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_call",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="8,4096,32,64", help="B,T,H,D")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--gates", default="rwkv7")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the first forward+backward: its top N functions")
    args = parser.parse_args(argv)
    B, T, H, D = (int(x) for x in args.shape.split(","))
    print(json.dumps(measure(Shape(B, T, H, D), args.chunk_size, args.gates, args.device,
                             args.profile)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
