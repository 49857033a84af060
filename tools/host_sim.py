"""The host side of a CUDA call, on a CPU machine: what the Python around the kernels costs.

Five harnesses: chunked training steps (below), the same steps through the ops' eager nodes
against their own autograd layer (``eager``, :func:`eager_main`), with the op kernels called
straight against through the dispatcher (``direct``, :func:`direct_main`), decode steps
(``decode``: the per-token entries, see :func:`decode_main`), and what filling the schema
defaults costs the ops that a training step calls with grad (``schema``, :func:`schema_main`).

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
    python tools/host_sim.py eager 2 64 8 64 64   # eager nodes against the ops' autograd
    python tools/host_sim.py direct 2 64 8 64 64  # kernels called straight against dispatched
    python tools/host_sim.py decode               # decode steps, H32, batches 1/16/128, D64/128
    python tools/host_sim.py schema               # the autograd ops' schema-default filling
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils.checkpoint import checkpoint

import torch_dplr
from torch_dplr import policies
from torch_dplr.ops import direct_call
from torch_dplr.ops.dataflow import training_pass
from torch_dplr.testing import CUDA_BODY_OPS, RWKV7_BOUND, cuda_op_bodies_on_cpu

# the stage ops (the others call the stage functions directly: the no-grad op is not timed, the
# two-op pass's ops keep their bodies in both variants)
STAGE_OPS = tuple(op for op in CUDA_BODY_OPS
                  if op not in ("chunk_fwd_fused", "chunk_fwd", "chunk_bwd"))


def _no_launch(*args):
    return None


def _register_cpu(lib, bodies: dict) -> None:
    with warnings.catch_warnings():  # replacing a CPU kernel registered by the first call warns
        warnings.simplefilter("ignore")
        for name, body in bodies.items():
            lib.impl(name, body, "CPU", allow_override=True)
            direct_call.set_direct_kernel(f"dplr::{name}", "cpu", body)


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


def _alternating(variants: dict, steps: dict, blocks=8) -> dict:
    """Median host microseconds per step of each variant (a function that switches the process
    to it) over ``blocks`` blocks, alternating the variants' order block by block (this
    machine's speed drifts; alternating puts the drift on all of them)."""
    times = {variant: {name: [] for name in steps} for variant in variants}
    order = list(variants.items())
    for block in range(blocks):
        for variant, switch in order if block % 2 == 0 else order[::-1]:
            switch()
            for name, step in steps.items():
                for _ in range(3):
                    step()
                times[variant][name].append(_block_us(step))
    return {variant: {name: round(statistics.median(t), 1) for name, t in per.items()}
            for variant, per in times.items()}


def _training_steps(B: int, T: int, H: int, D: int, C: int) -> dict:
    """An eager RWKV-7 forward+backward, bare and under the ``save_state`` policy."""
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
    return {"fwd_bwd": fwd_bwd, "fwd_bwd_save_state": lambda: fwd_bwd(save_state)}


def _shape(argv) -> tuple:
    return tuple(int(x) for x in (argv[:5] if len(argv) > 4 else (2, 64, 8, 64, 64)))


def main(argv):
    B, T, H, D, C = _shape(argv)
    cuda_bodies = {name: direct_call.direct_kernel(f"dplr::{name}", "cuda") for name in STAGE_OPS}
    empty = {name: _allocating_only(name, body) for name, body in cuda_bodies.items()}
    with cuda_op_bodies_on_cpu(lambda *args, **kwargs: _no_launch):
        lib = torch.library.Library("dplr", "IMPL")  # swaps the bodies of the two variants
        variants = {"bodies": lambda: _register_cpu(lib, cuda_bodies),
                    "bodies_empty": lambda: _register_cpu(lib, empty)}
        result = {"shape": [B, T, H, D], "chunk": C, "training_pass": training_pass(),
                  **_alternating(variants, _training_steps(B, T, H, D, C))}
    print(json.dumps(result))


def eager_main(argv):
    """The same steps with each op's eager node (``torch_dplr.ops.direct_call``) against
    the op's own autograd layer (no eager node registered), in one process."""
    B, T, H, D, C = _shape(argv)
    nodes = dict(direct_call._EAGER_NODES)
    variants = {"eager_nodes": lambda: direct_call._EAGER_NODES.update(nodes),
                "op_autograd": direct_call._EAGER_NODES.clear}
    with cuda_op_bodies_on_cpu(lambda *args, **kwargs: _no_launch):
        try:
            result = {"shape": [B, T, H, D], "chunk": C, "training_pass": training_pass(),
                      **_alternating(variants, _training_steps(B, T, H, D, C))}
        finally:
            direct_call._EAGER_NODES.update(nodes)
    print(json.dumps(result))


def direct_main(argv):
    """The training steps and the B1 D64 decode calls with the op kernels called straight
    (``torch_dplr.ops.direct_call``) against through the dispatcher below autograd, in one
    process, alternating."""
    B, T, H, D, C = _shape(argv)
    with cuda_op_bodies_on_cpu(lambda *args, **kwargs: _no_launch), per_token_bodies_on_cpu():
        names = [f"dplr::{name}" for name in STAGE_OPS + PER_TOKEN_OPS]
        kernels = {name: direct_call.direct_kernel(name, "cpu") for name in names}

        def dispatched():
            for name in names:
                direct_call.set_direct_kernel(name, "cpu", None)

        def direct():
            for name, fn in kernels.items():
                direct_call.set_direct_kernel(name, "cpu", fn)
        steps = _training_steps(B, T, H, D, C)
        decode = decode_steps(decode_inputs(1, 1, 32, 64))
        steps.update({f"decode_{name}": decode[name]
                      for name in ("fused_recurrent_rwkv7", "rwkv7_decode")})
        # (the two contexts restore the recorded kernels on exit)
        result = {"shape": [B, T, H, D], "chunk": C, "training_pass": training_pass(),
                  "decode_shape": [1, 1, 32, 64],
                  **_alternating({"direct": direct, "dispatched": dispatched}, steps)}
    print(json.dumps(result))


# ---- decode steps -------------------------------------------------------------------------

# the ops whose CUDA function launches the per-token Triton kernel
PER_TOKEN_OPS = ("recurrent_fwd", "decode_pool")


class _NoLaunchKernel:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](...)`` does nothing, so the
    launch wrapper's own Python (config, grid) still runs."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def per_token_bodies_on_cpu():
    """Inside, CPU calls of the per-token ops run their CUDA functions through the path they
    take on a GPU (the dispatcher, or the direct call of ``torch_dplr.ops.direct_call``), with
    the Triton launch a no-op.  ``TRITON_INTERPRET=1`` is what lets a CPU tensor pass the
    bodies' "Triton runs here" check."""
    from csrc_triton import recurrent as kernel_module
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved_kernel = kernel_module.recurrent_fwd_kernel
    opdefs = [OPDEFS[f"dplr::{name}"] for name in PER_TOKEN_OPS]
    saved_fns = [opdef._backend_fns[None] for opdef in opdefs]
    names = [f"dplr::{name}" for name in PER_TOKEN_OPS]
    direct = direct_call.direct_kernels(
        "cpu", {name: direct_call.direct_kernel(name, "cuda") for name in names})
    try:
        os.environ["TRITON_INTERPRET"] = "1"
        kernel_module.recurrent_fwd_kernel = _NoLaunchKernel()
        for opdef in opdefs:  # the device-less kernel is the one CPU tensors dispatch to
            opdef._backend_fns[None] = opdef._backend_fns["cuda"]
        with direct:
            yield
    finally:
        for opdef, fn in zip(opdefs, saved_fns):
            opdef._backend_fns[None] = fn
        kernel_module.recurrent_fwd_kernel = saved_kernel
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


def decode_inputs(B: int, T: int, H: int, D: int, seed=0) -> dict:
    """benchmarks/decode.py's values on the CPU: bf16 r, k, v, a, b, fp32 RWKV-7 gates and
    state, plus a state pool holding the B states in slots 0..B-1."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    kk = torch.nn.functional.normalize(rand(B, T, H, D), dim=-1)
    state = rand(B, H, D, D) * 0.1
    return dict(r=rand(B, T, H, D).bfloat16(), w=RWKV7_BOUND * torch.sigmoid(rand(B, T, H, D)),
                k=(rand(B, T, H, D) * D ** -0.5).bfloat16(), v=rand(B, T, H, D).bfloat16(),
                a=(-kk).bfloat16(), b=(kk * torch.sigmoid(rand(B, T, H, D))).bfloat16(),
                kk=kk.bfloat16(), iclr=torch.sigmoid(rand(B, T, H, D)).bfloat16(),
                state=state, pool=state.clone(),
                slots=torch.arange(B, dtype=torch.int32))


def decode_steps(x: dict) -> dict:
    """The eager calls benchmarks/decode.py times, plus the other per-token entries."""
    args = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    mul_args = [x[n] for n in ("r", "w", "k", "v", "kk", "iclr")]
    dplr_args = [x[n] for n in ("r", "k", "v", "a", "b", "w")]
    state = x["state"]
    return {
        "fused_recurrent_rwkv7": lambda: torch_dplr.fused_recurrent_rwkv7(
            *args, scale=1.0, initial_state=state, output_final_state=True),
        "fused_mul_recurrent_rwkv7": lambda: torch_dplr.fused_mul_recurrent_rwkv7(
            *mul_args, scale=1.0, initial_state=state, output_final_state=True),
        "fused_recurrent_dplr_delta_rule": lambda: torch_dplr.fused_recurrent_dplr_delta_rule(
            *dplr_args, scale=1.0, initial_state=state, output_final_state=True),
        "rwkv7_decode": lambda: torch_dplr.rwkv7_decode(*args, x["pool"], x["slots"],
                                                        check_values=False),
    }


def _keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks in its heap, as the CUDA caching allocator
    does: by default it maps and unmaps every large block (a B128 final state is 64 MiB at
    D64), ~10-20 us of system calls per functional call that a GPU host does not spend.
    Returns whether the allocator took the settings (it is glibc's only)."""
    import ctypes
    import ctypes.util
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
    except (OSError, AttributeError):
        return False


def _median_us(step, blocks: int, n: int) -> float:
    for _ in range(3):
        step()
    return round(statistics.median(_block_us(step, n) for _ in range(blocks)), 1)


def decode_records(batches=(1, 16, 128), head_dims=(64, 128), heads=32, tokens=1, blocks=7,
                   calls=200, no_grad=False):
    """Yields one record per (head dim, batch): host microseconds per call of each per-token
    entry, the median over ``blocks`` blocks of ``calls`` calls."""
    grad = torch.no_grad if no_grad else contextlib.nullcontext
    with per_token_bodies_on_cpu(), grad():
        for D in head_dims:
            for B in batches:
                steps = decode_steps(decode_inputs(B, tokens, heads, D))
                rec = dict(B=B, T=tokens, H=heads, D=D)
                rec.update({name: _median_us(step, blocks, calls) for name, step in steps.items()})
                yield rec


def decode_main(argv=None):
    """Host microseconds per decode call (T tokens per request) of each per-token entry, one
    JSON line per (head dim, batch), as benchmarks/decode.py calls them (grad mode on, no
    input requiring grad; ``--no-grad``: under ``torch.no_grad()``).  Freed memory stays in
    malloc's heap (:func:`_keep_freed_memory`) so that allocating the large fp32 final states
    costs what the CUDA caching allocator charges, not a system call."""
    parser = argparse.ArgumentParser(prog="host_sim.py decode", description=decode_main.__doc__)
    parser.add_argument("--batches", default="1,16,128")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--no-grad", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kept = _keep_freed_memory()
    for rec in decode_records(tuple(map(int, args.batches.split(","))),
                              tuple(map(int, args.head_dims.split(","))), args.heads,
                              args.tokens, args.blocks, args.calls, args.no_grad):
        print(json.dumps(dict(rec, heap_kept=kept)), flush=True)


# ---- the schema defaults of autograd ops ----------------------------------------------------

# the ops a training step calls with grad (their autograd wrapper fills the schema defaults)
AUTOGRAD_OPS = ("chunk_intra_fwd", "chunk_wy_fwd", "chunk_state_fwd", "chunk_fwd")


def schema_main():
    """Host microseconds of ``torch._library.utils.fill_defaults`` on each op's schema (what
    PyTorch's wrapper of a ``register_autograd`` op with ``setup_context`` runs on every call
    with grad; it reads the schema's argument list once per argument), one JSON line."""
    from torch._library.utils import fill_defaults
    rec = {}
    for name in AUTOGRAD_OPS:
        schema = getattr(torch.ops.dplr, name).default._schema
        args = tuple(range(len(schema.arguments)))
        rec[name] = {"arguments": len(args),
                     "fill_defaults_us": _median_us(lambda: fill_defaults(schema, args, {}), 9, 2000)}
    print(json.dumps(rec))


if __name__ == "__main__":
    # one thread, as the GPU's host runs the step: the CPU ops that stand in for GPU work
    # (adding two gradients of a leaf) would otherwise wait on a busy second core for ms
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["decode"]:
        decode_main(sys.argv[2:])
    elif sys.argv[1:2] == ["schema"]:
        schema_main()
    elif sys.argv[1:2] == ["eager"]:
        eager_main(sys.argv[2:])
    elif sys.argv[1:2] == ["direct"]:
        direct_main(sys.argv[2:])
    else:
        main(sys.argv[1:])
