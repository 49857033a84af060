"""Where a host-bound call's time goes on a GPU host, in host microseconds per call (no sync).

Prints three JSON objects: the whole steps (no-grad forward, forward+backward, and the same
under the ``save_state`` checkpoint policy: host time of the launches and wall time); for each
``dplr`` op of a training step, its host time through the dispatcher (no grad), through
``call_op`` as the library calls it (its kernel straight where ``direct_call`` finds one) and
with the custom op's CUDA function called directly, and each TileLang launch alone with the
arguments the op passed it; and the cost of one CUDA ``torch.empty``, ``view`` and ``zero_``. Each record
names its probe, the shape, chunk size and training pass, the card and the commit.
Usage: python tools/host_probe.py [B T H D chunk]   (default: the small grid 2 4096 8 64 64)
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import torch_dplr
from torch_dplr import policies
from torch_dplr.ops.dataflow import training_pass
from torch_dplr.ops.direct_call import call_op
from torch_dplr.ops import fused, intra, state, wy
from torch_dplr.testing import RWKV7_BOUND
from benchmarks.cells import Shape
from benchmarks.harness import card_meta
from benchmarks.jsonl import emit
from benchmarks.inputs import make

KERNEL_MODULES = (intra, wy, state, fused)  # the op modules that ask kernels.kernel_for


def _sync():
    torch.cuda.synchronize()


def host_us(f, n=100, reps=5) -> float:
    """Median over ``reps`` loops of ``n`` calls of the host time per call (launches queue)."""
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        _sync()
        start = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - start) / n * 1e6)
        _sync()
    return round(statistics.median(times), 1)


def wall_us(f, n=50) -> float:
    for _ in range(3):
        f()
    _sync()
    start = time.perf_counter()
    for _ in range(n):
        f()
        _sync()
    return round((time.perf_counter() - start) / n * 1e6, 1)


class _RecordDplrCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dplr":
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _recording_launches(launches: dict):
    """Wraps each op module's ``kernel_for`` so the first launch of every kernel is kept."""
    originals = {mod: mod.kernel_for for mod in KERNEL_MODULES}

    def wrap(original):
        def kernel_for(op, *args, **kwargs):
            kernel = original(op, *args, **kwargs)
            if kernel is None:
                return None

            def launch(*launch_args):
                launches.setdefault(op, (kernel, launch_args))
                return kernel(*launch_args)
            return launch
        return kernel_for

    for mod, original in originals.items():
        mod.kernel_for = wrap(original)
    return originals


def training_steps(B: int, T: int, H: int, D: int, C: int) -> dict:
    """Eager steps of the public function at one shape on CUDA (RWKV-7 gates, initial and final
    state): ``fwd`` (no grad), ``fwd_bwd``, and ``fwd_bwd_save_state`` (under that policy)."""
    inp = make(Shape(B, T, H, D, None), "rwkv7", "cuda")
    kw = dict(chunk_size=C, lower_bound=RWKV7_BOUND, output_final_state=True, scale=1.0)
    leaves = [x.detach().requires_grad_()
              for x in (inp.q, inp.k, inp.v, inp.a, inp.b, inp.gk, inp.h0)]

    def region(q, k, v, a, b, gk, h0):
        return torch_dplr.chunk_dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, **kw)

    def fwd():
        with torch.no_grad():
            region(*leaves)

    def fwd_bwd(context_fn=None):
        if context_fn is None:
            o, ht = region(*leaves)
        else:
            o, ht = checkpoint(region, *leaves, use_reentrant=False, context_fn=context_fn)
        torch.autograd.grad([o, ht], leaves, [inp.do, inp.dht])

    save_state = policies.context_fn("save_state")
    return {"fwd": fwd, "fwd_bwd": fwd_bwd, "fwd_bwd_save_state": lambda: fwd_bwd(save_state)}


def main():
    B, T, H, D, C = (int(x) for x in (sys.argv[1:6] if len(sys.argv) > 5 else (2, 4096, 8, 64, 64)))
    steps = training_steps(B, T, H, D, C)
    meta = dict(shape=f"B{B}-T{T}-H{H}-D{D}", chunk_size=C, gates="rwkv7", state=True,
                training_pass=training_pass(), **card_meta(torch.device("cuda")))

    def record(probe: str, rec: dict) -> None:  # one JSON line, described by the run's fields
        emit({**meta, "probe": probe, **rec}, None)

    record("steps", {name: dict(host_us=host_us(f, n=30), wall_us=wall_us(f))
                     for name, f in steps.items()})

    launches: dict = {}
    originals = _recording_launches(launches)
    with _RecordDplrCalls() as recorder:
        steps["fwd_bwd"]()
    _sync()
    for mod, original in originals.items():
        mod.kernel_for = original
    rows = {}
    with torch.no_grad():
        for func, args, kwargs in recorder.calls:
            opdef = OPDEFS[func._schema.name]
            body = opdef._backend_fns.get("cuda") or opdef._init_fn  # no CUDA kernel: the one kernel
            packet = func.overloadpacket
            rows[func._schema.name] = dict(dispatch_us=host_us(lambda: func(*args, **kwargs)),
                                           call_op_us=host_us(lambda: call_op(packet, *args)),
                                           body_us=host_us(lambda: body(*args, **kwargs)))
    for op, (kernel, args) in launches.items():
        rows["launch:" + op] = dict(launch_us=host_us(lambda: kernel(*args)), nargs=len(args))
    record("ops", rows)
    x = torch.empty(10, device="cuda")
    record("tensor_ops", dict(
        empty_us=host_us(lambda: torch.empty((B, T, H, D), device="cuda", dtype=torch.bfloat16)),
        view_us=host_us(lambda: x.view(1, 10)), zero_us=host_us(lambda: x.zero_())))


if __name__ == "__main__":
    main()
