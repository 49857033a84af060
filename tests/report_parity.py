"""Worst error ratio per output over a parity matrix: ``python tests/report_parity.py [--device cuda]``.

Prints one JSON line per configuration and, last, the worst ratio per output and dtype.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from torch_dplr.testing import parity_errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--T", type=int, default=200)
    parser.add_argument("--H", type=int, default=2)
    parser.add_argument("--K", type=int, default=64)
    args = parser.parse_args()
    worst = {}
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    layouts = {"rect": (2, None), "varlen": (1, [0, 1, 2, 70, args.T])}
    for dtype, C, gates, layout in itertools.product(dtypes, (16, 32, 64),
                                                     ("rwkv7", "saturated", "unbounded"), layouts):
        B, cu = layouts[layout]
        errors = parity_errors(B, args.T, args.H, args.K, dtype=dtype, gates=gates, chunk_size=C,
                               cu_seqlens=cu, device=args.device)
        print(json.dumps({"dtype": str(dtype)[6:], "chunk_size": C, "gates": gates,
                          "layout": layout, **{k: round(v, 6) for k, v in errors.items()}}))
        for name, e in errors.items():
            key = f"{str(dtype)[6:]}/{name}"
            worst[key] = max(worst.get(key, 0.0), e)
    print(json.dumps({"worst": {k: round(v, 6) for k, v in sorted(worst.items())}}))


if __name__ == "__main__":
    main()
