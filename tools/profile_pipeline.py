"""Per-kernel device time of one torch_dplr call at a benchmark shape (torch.profiler).

Prints, for a no-grad forward and a forward+backward, every CUDA kernel's total time and call
count, the host time of the call, and writes the tables as JSON lines when --out is given.
Usage: python tools/profile_pipeline.py [--B 8 --T 4096 --H 32 --D 64 --chunk 64] [--out f.jsonl]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torch_dplr
from torch_dplr.testing import RWKV7_BOUND
from benchmarks.cells import Shape
from benchmarks.inputs import make


def run(step, label, out):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [dict(kernel=e.key[:90], device_ms=e.device_time_total / 1e3, calls=e.count)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["device_ms"])
    print(f"== {label}: host {host_ms:.2f} ms (launch, no sync), wall {wall_ms:.2f} ms")
    for r in rows[:25]:
        print(f"  {r['device_ms']:8.3f} ms  x{r['calls']:<3d} {r['kernel']}")
    if out:
        out.write(json.dumps(dict(label=label, host_ms=host_ms, wall_ms=wall_ms, rows=rows)) + "\n")


def main():
    p = argparse.ArgumentParser()
    for n, d in (("B", 8), ("T", 4096), ("H", 32), ("D", 64), ("chunk", 64)):
        p.add_argument(f"--{n}", type=int, default=d)
    p.add_argument("--out")
    args = p.parse_args()
    inp = make(Shape(args.B, args.T, args.H, args.D), "rwkv7", "cuda")
    kw = dict(chunk_size=args.chunk, lower_bound=RWKV7_BOUND, output_final_state=True,
              initial_state=inp.h0)
    out = open(args.out, "w") if args.out else None
    fn = torch_dplr.chunk_dplr_delta_rule

    def fwd():
        with torch.no_grad():
            fn(inp.q, inp.k, inp.v, inp.a, inp.b, inp.gk, **kw)

    leaves = [x.detach().requires_grad_() for x in (inp.q, inp.k, inp.v, inp.a, inp.b, inp.gk)]

    def fwd_bwd():
        for x in leaves:  # a fresh step: no gradient accumulation kernels in the profile
            x.grad = None
        o, ht = fn(*leaves, **kw)
        torch.autograd.backward((o, ht), (inp.do, inp.dht))

    run(fwd, f"fwd B{args.B} T{args.T} H{args.H} D{args.D} c{args.chunk}", out)
    run(fwd_bwd, f"fwd_bwd B{args.B} T{args.T} H{args.H} D{args.D} c{args.chunk}", out)
    if out:
        out.close()


if __name__ == "__main__":
    main()
