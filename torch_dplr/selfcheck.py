"""``python -m torch_dplr``: a self-check against the fp64 oracle, then a timing, on each device."""
from __future__ import annotations

import json
import time

import torch

from .api import chunk_rwkv7
from .testing import GATE_STYLES, RWKV7_BOUND, TOLERANCES, make_inputs, parity_errors

NAMES = "q k v a b gk".split()


def _rwkv7(q, k, v, a, b, gk, **kwargs):
    return chunk_rwkv7(q, gk, k, v, a, b, **kwargs)


def check_case(device, dtype, chunk_size, gates, cu_seqlens=None, T=96, H=2, K=32):
    """(worst error ratio over o, final state and all gradients, all finite) for one config."""
    bound = RWKV7_BOUND if gates != "unbounded" else None
    try:
        errors = parity_errors(1, T, H, K, dtype=dtype, gates=gates, chunk_size=chunk_size,
                               cu_seqlens=cu_seqlens, lower_bound=bound, device=device,
                               fn=_rwkv7, scale=1.0)
    except AssertionError:  # a non-finite output or gradient
        return float("inf"), False
    return max(errors.values()), True


def self_check(device, emit) -> bool:
    ok = True
    dtype = torch.bfloat16
    out_bar, grad_bar = TOLERANCES[dtype]
    # on a GPU, a head size the TileLang kernels take (K = 64), so the check covers them
    K = 64 if device.type == "cuda" else 32
    for chunk_size in (16, 32, 64):
        for gates in GATE_STYLES:
            for cu in (None, [0, 1, 40, 96]):
                worst, finite = check_case(device, dtype, chunk_size, gates, cu, K=K)
                passed = finite and worst <= max(out_bar, grad_bar)
                ok &= passed
                emit({"check": "parity", "device": str(device), "dtype": "bf16",
                      "chunk_size": chunk_size, "gates": gates, "varlen": cu is not None,
                      "worst_error_ratio": round(worst, 5), "pass": passed})
    return ok


def _time(fn, device, reps):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def timing(device, emit):
    """Forward and forward+backward of chunk_rwkv7 at a size that suits the device."""
    B, T, H, K = (8, 4096, 32, 64) if device.type == "cuda" else (1, 1024, 4, 64)
    reps = 5 if device.type == "cuda" else 2
    dtype = torch.bfloat16
    inp = make_inputs(B, T, H, K, dtype=dtype, device=device)
    q, k, v, a, b, gk = (inp[n] for n in NAMES)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, a, b, gk)]

    def fwd():
        with torch.no_grad():
            chunk_rwkv7(q, gk, k, v, a, b, lower_bound=RWKV7_BOUND)

    def fwd_bwd():
        o, _ = chunk_rwkv7(leaves[0], leaves[5], *leaves[1:5], lower_bound=RWKV7_BOUND)
        o.sum().backward()

    for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        emit({"timing": mode, "device": str(device), "B": B, "T": T, "H": H, "D": K,
              "chunk_size": 64, "dtype": "bf16", "ms": round(_time(fn, device, reps), 2)})


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m torch_dplr",
                                     description="Self-check against the fp64 oracle, then time "
                                                 "chunk_rwkv7, on every device present.")
    parser.add_argument("--json", action="store_true", help="print JSON lines only")
    parser.add_argument("--no-timing", action="store_true", help="skip the timing")
    args = parser.parse_args(argv)

    def emit(record):
        if args.json:
            print(json.dumps(record), flush=True)
        elif "check" in record:
            print(f"[{'PASS' if record['pass'] else 'FAIL'}] {record['device']} {record['dtype']} "
                  f"chunk={record['chunk_size']:<2} gates={record['gates']:<9} "
                  f"varlen={str(record['varlen']):<5} worst error ratio {record['worst_error_ratio']:.4f}",
                  flush=True)
        else:
            print(f"[time] {record['device']} {record['timing']:<7} B{record['B']} T{record['T']} "
                  f"H{record['H']} D{record['D']} chunk {record['chunk_size']}: {record['ms']:.2f} ms",
                  flush=True)

    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    ok = True
    for device in devices:
        ok &= self_check(device, emit)
        if not args.no_timing:
            timing(device, emit)
    print(json.dumps({"self_check": "pass" if ok else "FAIL"}) if args.json else
          f"self-check: {'all passed' if ok else 'FAILURES above'}")
    return 0 if ok else 1
