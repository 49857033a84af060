"""Worst error ratio per output over a parity matrix:
``python tests/report_parity.py [--device cuda] [--T 2048 --H 16 --K 64 128 --dtypes bfloat16]``.

Prints one JSON line per configuration and, last, the worst ratio per output and dtype.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from torch_dplr.testing import RWKV7_BOUND, parity_errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--T", type=int, default=200)
    parser.add_argument("--H", type=int, default=2)
    parser.add_argument("--K", type=int, nargs="+", default=[64])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    worst = {}
    dtypes = [getattr(torch, d) for d in args.dtypes]
    layouts = {"rect": (2, None), "varlen": (1, [0, 1, 2, 70, args.T])}
    for dtype, K, C, gates, layout in itertools.product(
            dtypes, args.K, (16, 32, 64), ("rwkv7", "saturated", "unbounded"), layouts):
        B, cu = layouts[layout]
        # bounded gate styles declare RWKV-7's bound, so GPU kernels take the centred scheme
        bound = None if gates == "unbounded" else RWKV7_BOUND
        errors = parity_errors(B, args.T, args.H, K, dtype=dtype, gates=gates, chunk_size=C,
                               cu_seqlens=cu, device=args.device, lower_bound=bound)
        print(json.dumps({"dtype": str(dtype)[6:], "K": K, "chunk_size": C, "gates": gates,
                          "layout": layout, **{k: round(v, 6) for k, v in errors.items()}}),
              flush=True)
        for name, e in errors.items():
            key = f"{str(dtype)[6:]}/{name}"
            worst[key] = max(worst.get(key, 0.0), e)
    print(json.dumps({"worst": {k: round(v, 6) for k, v in sorted(worst.items())}}))


if __name__ == "__main__":
    main()
