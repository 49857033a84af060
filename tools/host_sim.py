"""The host side of a CUDA call, on a CPU machine: what the Python around the kernels costs.

Every ``dplr`` op's CUDA function runs as its CPU kernel and every TileLang launch is a no-op
(``torch_dplr.testing.cuda_op_bodies_on_cpu``), so a step runs the op bodies,
the dispatcher, autograd and the checkpoint machinery exactly as on the GPU's host, minus the
launches.  Prints one JSON line: host microseconds per step for forward+backward and
forward+backward under the ``save_state`` policy (``"bodies"``), and the same with each stage
op's body replaced by one that only allocates its outputs (``"bodies_empty"``): what is left is
PyTorch's custom-op, autograd and checkpoint machinery plus the public function, which no
trimming inside the ops reaches.  Medians over 8 blocks of 100 steps each, the two variants
alternating block by block.  Tensors are kept short (T = 64 by default) so that no real
work (gradient accumulation, zero fills) hides the host cost.  Absolute figures are this CPU's (the
H200's host runs the same Python about 2-3x slower, and launches for real: compare with
tools/host_probe.py there), and they drift between runs: compare the variants of one run.

    python tools/host_sim.py                      # B2 T64 H8 D64, chunk 64
    python tools/host_sim.py 2 64 8 64 16
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import warnings

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils.checkpoint import checkpoint

import torch_dplr
from torch_dplr import policies
from torch_dplr.testing import CUDA_BODY_OPS, RWKV7_BOUND, cuda_op_bodies_on_cpu

# the stage ops (the no-grad op is not timed: its body calls the stage functions directly)
STAGE_OPS = tuple(op for op in CUDA_BODY_OPS if op != "chunk_fwd_fused")


def _no_launch(*args):
    return None


def _register_cpu(lib, bodies: dict) -> None:
    with warnings.catch_warnings():  # replacing a CPU kernel registered by the first call warns
        warnings.simplefilter("ignore")
        for name, body in bodies.items():
            lib.impl(name, body, "CPU", allow_override=True)


def _allocating_only(name: str, body):
    """A body that allocates what ``body`` returned on its first call, and does nothing else."""
    specs = []

    def run(*args):
        if not specs:
            specs.extend((x.shape, x.dtype) for x in body(*args))
        return tuple(torch.empty(shape, dtype=dtype) for shape, dtype in specs)
    return run


def _block_us(step, n=100) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n * 1e6


def _time_both(lib, real: dict, empty: dict, steps: dict, blocks=8) -> dict:
    """Median host microseconds per step over ``blocks`` blocks of each variant, alternating
    (this machine's speed drifts; alternating puts the drift on both)."""
    times = {variant: {name: [] for name in steps} for variant in ("bodies", "bodies_empty")}
    for block in range(blocks):
        order = (("bodies", real), ("bodies_empty", empty))
        for variant, bodies in order if block % 2 == 0 else reversed(order):
            _register_cpu(lib, bodies)
            for name, step in steps.items():
                for _ in range(3):
                    step()
                times[variant][name].append(_block_us(step))
    return {variant: {name: round(statistics.median(t), 1) for name, t in per.items()}
            for variant, per in times.items()}


def main():
    B, T, H, D, C = (int(x) for x in (sys.argv[1:6] if len(sys.argv) > 5 else (2, 64, 8, 64, 64)))
    cuda_bodies = {name: OPDEFS[f"dplr::{name}"]._backend_fns["cuda"] for name in STAGE_OPS}
    gen = torch.Generator().manual_seed(0)
    q, k, v, a, b = (torch.randn(B, T, H, D, generator=gen).bfloat16().requires_grad_()
                     for _ in range(5))
    w = (-0.6 * torch.rand(B, T, H, D, generator=gen)).requires_grad_()
    leaves = (q, w, k, v, a, b)
    do = torch.randn(B, T, H, D, generator=gen).bfloat16()

    def region(*xs):
        return torch_dplr.chunk_rwkv7(*xs, chunk_size=C, lower_bound=RWKV7_BOUND)

    def fwd_bwd(context_fn=None):
        if context_fn is None:
            o, _ = region(*leaves)
        else:
            o, _ = checkpoint(region, *leaves, use_reentrant=False, context_fn=context_fn)
        torch.autograd.grad(o, leaves, do)

    save_state = policies.context_fn("save_state")
    steps = {"fwd_bwd": fwd_bwd, "fwd_bwd_save_state": lambda: fwd_bwd(save_state)}
    empty = {name: _allocating_only(name, body) for name, body in cuda_bodies.items()}
    with cuda_op_bodies_on_cpu(lambda *args, **kwargs: _no_launch):
        lib = torch.library.Library("dplr", "IMPL")  # swaps the bodies of the two variants
        result = {"shape": [B, T, H, D], "chunk": C,
                  **_time_both(lib, cuda_bodies, empty, steps)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
