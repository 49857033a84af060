"""Per-kernel device time of one torch_dplr call at a benchmark shape (torch.profiler).

Prints, for a no-grad forward and a forward+backward, every CUDA kernel's total time and call
count, the host time of the call and the host operations that took most of it (self CPU time:
custom-op dispatch, table building, launches), and writes the tables as JSON lines when --out
is given.  ``--N`` packs ``N`` varlen sequences into one row of ``T`` tokens (``--B`` is then 1).
``--cprofile STEPS`` then runs that many steady-state steps of each under cProfile and prints
the Python functions with the most own and cumulative time (where the host time of a
host-bound call goes: op bodies, table building, TileLang's launch wrapper, autograd).
``--policy NAME`` runs the forward+backward under non-reentrant checkpointing with that
``torch_dplr.policies`` policy (as the benchmark's ``save_state`` cells do).  ``--compile``
runs both steps under ``torch.compile(fullgraph=True)`` (the benchmark times eager calls; a
compiled step skips the public function's Python and the per-op autograd wrappers, but each
op's own Python still runs); ``--compile-mode reduce-overhead`` replays them as CUDA graphs,
which skips the host work altogether.
Usage: python tools/profile_pipeline.py [--B 8 --T 4096 --H 32 --D 64 --chunk 64] [--N 64] [--out f.jsonl]
       [--cprofile 50] [--policy save_state] [--compile [--compile-mode reduce-overhead]]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

import torch_dplr
from torch_dplr import policies
from torch_dplr.testing import RWKV7_BOUND
from benchmarks.cells import Shape
from benchmarks.inputs import make


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(step, label, out):
    for _ in range(3):
        step()
    _sync()
    t0 = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - t0) * 1e3
    _sync()
    wall_ms = (time.perf_counter() - t0) * 1e3
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    with profile(activities=activities) as prof:
        step()
        _sync()
    events = prof.key_averages()
    rows = [dict(kernel=e.key[:90], device_ms=e.device_time_total / 1e3, calls=e.count)
            for e in events if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["device_ms"])
    # host: self CPU time per operation (the profiler's own overhead inflates these a little)
    host = [dict(op=e.key[:90], self_cpu_ms=e.self_cpu_time_total / 1e3, calls=e.count)
            for e in events if e.self_cpu_time_total > 0]
    host.sort(key=lambda r: -r["self_cpu_ms"])
    print(f"== {label}: host {host_ms:.2f} ms (launch, no sync), wall {wall_ms:.2f} ms")
    for r in rows[:25]:
        print(f"  {r['device_ms']:8.3f} ms  x{r['calls']:<3d} {r['kernel']}")
    print("  host, self CPU time:")
    for r in host[:15]:
        print(f"  {r['self_cpu_ms']:8.3f} ms  x{r['calls']:<3d} {r['op']}")
    if out:
        out.write(json.dumps(dict(label=label, host_ms=host_ms, wall_ms=wall_ms, rows=rows,
                                  host=host)) + "\n")


def python_profile(step, label, steps, top=30):
    """cProfile of ``steps`` steady-state calls of ``step`` (synchronized once at the end)."""
    step()
    _sync()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    _sync()
    print(f"== cProfile {label}: {steps} steps, {(time.perf_counter() - t0) * 1e3 / steps:.2f} ms "
          "per step under the profiler")
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        print(f"-- by {order}\n" + text.getvalue())


def main():
    p = argparse.ArgumentParser()
    for n, d in (("B", 8), ("T", 4096), ("H", 32), ("D", 64), ("chunk", 64), ("N", None)):
        p.add_argument(f"--{n}", type=int, default=d)
    p.add_argument("--out", help="JSON lines, appended")
    p.add_argument("--cprofile", type=int, default=0, metavar="STEPS")
    p.add_argument("--policy", help="a torch_dplr.policies name: checkpoint the forward+backward")
    p.add_argument("--compile", action="store_true",
                   help="both steps under torch.compile(fullgraph=True), as a compiled model runs "
                        "them (the checkpoint inside the compiled function)")
    p.add_argument("--compile-mode", help="torch.compile's mode, e.g. reduce-overhead (CUDA graphs)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    args = p.parse_args()
    shape = Shape(1 if args.N else args.B, args.T, args.H, args.D, args.N)
    inp = make(shape, "rwkv7", args.device)
    kw = dict(chunk_size=args.chunk, lower_bound=RWKV7_BOUND, output_final_state=True,
              initial_state=inp.h0, cu_seqlens=inp.cu_seqlens,
              cu_seqlens_cpu=inp.cu_seqlens_cpu)
    out = open(args.out, "a") if args.out else None
    fn = torch_dplr.chunk_dplr_delta_rule

    leaves = [x.detach().requires_grad_() for x in (inp.q, inp.k, inp.v, inp.a, inp.b, inp.gk)]

    context_fn = policies.context_fn(args.policy) if args.policy else None

    def region(*xs):
        return fn(*xs, **kw)

    def forward(*xs):
        if context_fn is None:
            return region(*xs)
        return checkpoint(region, *xs, use_reentrant=False, context_fn=context_fn)

    no_grad_forward = region
    if args.compile:  # compiled once here, outside the timed and profiled steps
        forward = torch.compile(forward, fullgraph=True, mode=args.compile_mode)
        no_grad_forward = torch.compile(region, fullgraph=True, mode=args.compile_mode)

    def fwd():
        with torch.no_grad():
            no_grad_forward(inp.q, inp.k, inp.v, inp.a, inp.b, inp.gk)

    def fwd_bwd():
        for x in leaves:  # a fresh step: no gradient accumulation kernels in the profile
            x.grad = None
        o, ht = forward(*leaves)
        torch.autograd.backward((o, ht), (inp.do, inp.dht))

    tag = " ".join([shape.label, f"c{args.chunk}"] + ["compiled"] * args.compile
                   + [args.compile_mode] * bool(args.compile and args.compile_mode))
    bwd_tag = f"{tag} {args.policy}" if args.policy else tag
    run(fwd, f"fwd {tag}", out)
    run(fwd_bwd, f"fwd_bwd {bwd_tag}", out)
    if args.cprofile:
        python_profile(fwd, f"fwd {tag}", args.cprofile)
        python_profile(fwd_bwd, f"fwd_bwd {bwd_tag}", args.cprofile)
    if out:
        out.close()


if __name__ == "__main__":
    main()
