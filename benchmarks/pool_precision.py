"""What a bf16 state pool costs in accuracy: decode steps over a bf16 pool and over an fp32
pool, both against the same steps in fp64.

``torch_dplr.dplr_decode`` over a bf16 pool reads each state into fp32, advances it and rounds
it to bf16 once per call; over an fp32 pool it keeps fp32. This runs ``--steps`` decode calls
of one token each (``torch_dplr.testing.make_inputs``' RWKV-7 inputs: bf16 data, ``a = -kk``,
``b = kk·iclr``, decays ``exp(-0.6065·sigmoid(x))``, scale 1) from a zero state and records,
after selected steps, the RMS error of that step's outputs and of the states relative to the
fp64 run (RMS(err) / RMS(ref)). The numbers are those of the rounding points, which the GPU
kernel shares: the PyTorch kernel computes them here (``--device cuda`` runs the Triton
kernel).

    python -m benchmarks.pool_precision --out benchmarks/results/cpu-pool-precision.jsonl
"""
from __future__ import annotations

import argparse

import torch

import torch_dplr
from torch_dplr.testing import make_inputs, rms_ratio

from .jsonl import emit

REPORT_AT = (1, 4, 16, 64, 256, 1024, 4096)


def measure(steps: int, B: int, H: int, D: int, device, seed: int = 0):
    """Yield a record at each step of :data:`REPORT_AT` up to ``steps``."""
    pools = {name: torch_dplr.new_state_pool(B, H, D, device=device, dtype=dtype)
             for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32),
                                 ("bf16", torch.bfloat16))}
    slots = torch.arange(B, dtype=torch.int32, device=device)
    with torch.no_grad():
        for t in range(1, steps + 1):
            x = make_inputs(B, 1, H, D, dtype=torch.bfloat16, seed=seed + t, device=device)
            step = [x[n] for n in ("q", "k", "v", "a", "b", "gk")]
            outs = {}
            for name, pool in pools.items():
                args = [a.double() for a in step] if name == "fp64" else step
                outs[name] = torch_dplr.dplr_decode(*args, pool, slots, scale=1.0,
                                                    check_values=False)
            if t in REPORT_AT:
                rec = dict(step=t, B=B, H=H, D=D)
                for name in ("fp32", "bf16"):
                    rec[f"{name}_pool_o"] = rms_ratio(outs[name], outs["fp64"])
                    rec[f"{name}_pool_state"] = rms_ratio(pools[name], pools["fp64"])
                yield rec


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="append JSON lines here (also printed)")
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    for rec in measure(args.steps, args.batch, args.heads, args.head_dim, device):
        emit(dict(rec, device=name), args.out, digits=7)


if __name__ == "__main__":
    main()
