"""Registers and spills of the split training pass's Triton kernels, compiled for sm_90a on any
machine (no GPU: Triton's compiler and its bundled ``cuobjdump``).

Runs the split forward and backward (``csrc_triton.state_sweep.split_forward``,
``csrc_triton.chunk_grads.split_backward``) on small CPU tensors with every ``kernel[grid]``
launch captured instead of run, compiles each captured launch as the GPU would (same
constexprs, warps and stages) and prints one JSON line per launch: the kernel, its constexprs,
``regs`` per thread, ``stack`` bytes per thread (spilled registers live there) and ``smem``.
A kernel at 255 registers with a stack is spilling, and runs one program per SM or fewer.

    python tools/triton_registers.py [--chunk 64] [--warps 4,8] [--state-split 1,0]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.int32: "i32", torch.int64: "i64"}


class _Captured:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](*args, **kwargs)`` records the
    call instead of launching it."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def _signature(fn, args, kwargs):
    """Triton's (signature, constexprs, attrs, options) of one captured launch, specialized as
    the JIT specializes a launch: a pointer 16-byte aligned or an integer divisible by 16 is
    marked divisible by 16 (the compiler vectorizes and folds address math on it)."""
    signature, constexprs, attrs = {}, {}, {}
    names = fn.arg_names
    values = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
    for index, (name, param) in enumerate(zip(names, fn.params)):
        value = values[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name], divisible = "i1", False
        elif isinstance(value, float):
            signature[name], divisible = "fp32", False
        else:
            signature[name], divisible = "i32", value % 16 == 0
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return signature, constexprs, attrs, options


def resources(fn, signature, constexprs, attrs, options) -> dict:
    """Compile for sm_90a and read the cubin's resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage",
                                f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    return dict(zip(("regs", "stack", "smem"), map(int, found.groups())))


def split_pass_launches(chunk: int, num_warps: int, state_split: bool):
    """The launches of one split forward (states kept) and backward at ``chunk``, bf16,
    H = 32, D = 64, a declared bound (the design shape's heads and dims, two chunks)."""
    from csrc_triton import chunk_grads, chunk_terms, state_sweep, tile_terms
    from torch_dplr.ops.varlen import kernel_tables

    B, T, H, D = 1, 2 * chunk, 32, 64
    tokens = [torch.zeros(1, B * T, H, D, dtype=torch.bfloat16) for _ in range(5)]
    q, k, v, a, b = tokens
    gk = torch.zeros(1, B * T, H, D)
    tables = kernel_tables(torch.zeros(0, dtype=torch.int64), B, T, chunk, torch.device("cpu"))
    slots = tables.chunk_start.shape[0]
    h0 = torch.zeros(B, H, D, D)
    states = torch.zeros(1, slots, H, D, D)
    grads = [torch.empty_like(t) for t in (q, k, v, a, b, gk)]
    calls = []
    kernels = [(tile_terms, "tile_terms_kernel"), (chunk_terms, "chunk_terms_kernel"),
               (state_sweep, "state_sweep_kernel"), (chunk_grads, "grad_walk_kernel"),
               (chunk_grads, "chunk_grads_kernel")]
    with contextlib.ExitStack() as stack:
        for module, name in kernels:
            stack.enter_context(mock.patch.object(module, name,
                                                  _Captured(getattr(module, name), calls)))
        state_sweep.split_forward(q, k, v, a, b, gk, h0, tables, torch.empty_like(v),
                                  torch.empty_like(h0), states,
                                  torch.zeros(B, H, dtype=torch.int32), 0.125, chunk, True, True,
                                  True, num_warps=num_warps, state_split=state_split)
        chunk_grads.split_backward(q, k, v, a, b, gk, states, torch.empty_like(v), h0, tables,
                                   *grads, torch.empty_like(h0), 0.125, chunk, True, True, True,
                                   num_warps=num_warps, state_split=state_split)
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--state-split", default="1,0")
    args = parser.parse_args()
    seen = set()
    for warps in map(int, args.warps.split(",")):
        for split in map(int, args.state_split.split(",")):
            for fn, call_args, kwargs in split_pass_launches(args.chunk, warps, bool(split)):
                signature, constexprs, attrs, options = _signature(fn, call_args, kwargs)
                key = (fn.__name__, tuple(sorted(constexprs.items())), tuple(options.items()))
                if key in seen:  # the backward launches the forward's terms kernels again
                    continue
                seen.add(key)
                print(json.dumps({"kernel": fn.__name__, **options, **constexprs,
                                  **resources(fn, signature, constexprs, attrs, options)}),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
