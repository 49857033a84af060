"""Shared pieces of the compile tests: graph recorders, op counting, inputs, a small RWKV-7 block.

Everything here is test infrastructure; the assertions live in the ``test_*`` modules.

Two environment variables (read once, at import) choose where and at what size the suite runs:

``TORCH_DPLR_TEST_DEVICE``
    ``cpu`` (default) or ``cuda`` (``cuda:N`` also works): the device of every tensor the tests
    create (:data:`DEVICE`).  Random values are drawn on the CPU from seeded generators and then
    moved (:func:`on_device`), so both devices see the same numbers.  With ``cuda`` requested
    and no CUDA GPU present, the whole suite is skipped (``conftest.py``).
``TORCH_DPLR_TEST_HEAD_DIM``
    The head size K = V of :func:`make_inputs` and of the block (:data:`HEAD_DIM`, default 8;
    the block's ``d_model`` follows as ``N_HEADS * HEAD_DIM``).  On CUDA, TileLang kernels run
    only for bf16/fp16 data with K = V in {64, 128} and chunk 16/32/64
    (``torch_dplr.ops.tilelang_path.kernels_apply``): use 64 or 128 to exercise them.  fp32 and
    fp64 tests run the PyTorch kernels on the GPU whatever the head size.

Example, on an H200: ``TORCH_DPLR_TEST_DEVICE=cuda TORCH_DPLR_TEST_HEAD_DIM=64 python -m pytest
-q compile_tests``.
"""
from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import torch_dplr
from torch_dplr import policies
from torch_dplr.ops import tilelang_path

dplr = torch.ops.dplr

# a chunked call's ops; every one builds its chunk tables once (dplr::chunk_tables: read by
# the forward and backward ops, kept for the backward, never rebuilt there)
CHUNK_TABLES = frozenset({dplr.chunk_tables.default})
CHUNK_FWD = frozenset({dplr.chunk_intra_fwd.default, dplr.chunk_wy_fwd.default,
                       dplr.chunk_state_fwd.default}) | CHUNK_TABLES
CHUNK_BWD = frozenset({dplr.chunk_intra_bwd.default, dplr.chunk_wy_bwd.default,
                       dplr.chunk_state_bwd.default})
CHUNK_NO_GRAD = frozenset({dplr.chunk_fwd_fused.default}) | CHUNK_TABLES  # no-grad: one op
# the two-op training pass (TORCH_DPLR_TRAINING_PASS=split, torch_dplr.ops.dataflow)
SPLIT_FWD = frozenset({dplr.chunk_fwd.default}) | CHUNK_TABLES
SPLIT_BWD = frozenset({dplr.chunk_bwd.default})
RECURRENT_FWD = frozenset({dplr.recurrent_fwd.default})
RECURRENT_BWD = frozenset({dplr.recurrent_bwd.default})
FORWARD_OPS = policies.FORWARD_OPS
BACKWARD_OPS = CHUNK_BWD | SPLIT_BWD | RECURRENT_BWD

RWKV7_BOUND = -0.6065  # -exp(-0.5), rounded towards 0 (the gate never reaches it here)


# ----------------------------------------------------------------------------------------------
# Device and sizes (environment knobs, see the module docstring)
# ----------------------------------------------------------------------------------------------

def _test_device() -> torch.device:
    device = torch.device(os.environ.get("TORCH_DPLR_TEST_DEVICE") or "cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"TORCH_DPLR_TEST_DEVICE={device}: expected cpu or cuda")
    return device


DEVICE = _test_device()
ON_CUDA = DEVICE.type == "cuda"
N_HEADS = 2
HEAD_DIM = int(os.environ.get("TORCH_DPLR_TEST_HEAD_DIM") or 8)
D_MODEL = N_HEADS * HEAD_DIM
CHUNK_SIZE = 16  # the chunk size of chunk_fn and of the block


def device_unavailable() -> str | None:
    """Why the requested test device cannot run (None when it can)."""
    if ON_CUDA and not torch.cuda.is_available():
        return "TORCH_DPLR_TEST_DEVICE=cuda, but no CUDA GPU is available"
    return None


def on_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` (made on the CPU) on the test device; the same tensor when that is the CPU.
    Call before ``requires_grad_`` so the result is a leaf."""
    return t.to(DEVICE)


def index_tensor(values) -> torch.Tensor:
    """An int64 tensor (cu_seqlens) on the test device."""
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def runs_tilelang_kernels(dtype: torch.dtype, chunk_size: int = CHUNK_SIZE) -> bool:
    """Whether a call at ``dtype`` and the test head size takes the TileLang kernels on the
    test device: the static half of ``kernels_apply`` (it also needs an sm_90 GPU with
    TileLang installed and ``TORCH_DPLR_DISABLE_TILELANG`` unset, assumed here)."""
    return (ON_CUDA and dtype in tilelang_path.KERNEL_DTYPES
            and HEAD_DIM in tilelang_path.HEAD_DIMS and chunk_size in tilelang_path.CHUNK_SIZES
            and os.environ.get("TORCH_DPLR_DISABLE_TILELANG") != "1")


# Extra bf16 cases that only mean something on a GPU (the TileLang kernels take bf16 data); on
# the CPU the suite keeps its fp32-only cases.
INDUCTOR_DTYPES = (torch.float32, torch.bfloat16) if ON_CUDA else (torch.float32,)


def dtype_id(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``, for test ids."""
    return str(dtype).removeprefix("torch.")


# Tolerances for "compiled equals eager" (assert_close rtol, atol; a third entry, where present,
# adds that fraction of max |expected| to atol).  The recording backends run the very same
# kernels as eager, so fp32 is held to round-off; Inductor fuses the elementwise ops around the
# dplr nodes and may reassociate them.  In bf16 Inductor also rounds a fused chain once where
# eager rounds after every op, so the dplr ops' inputs differ by an ulp here and there, and a
# parameter gradient (a sum over all tokens) then differs by a few ulps of its LARGEST entries,
# not of each entry: hence the scaled atol.  (Measured with Inductor on the CPU at head dims
# 8, 64 and 128: at most 8e-3 of max |expected|, ~2 bf16 ulps; not yet measured on a GPU.)
TOL = {torch.bfloat16: (8e-3, 1e-3), torch.float32: (1e-5, 1e-6),
       torch.float64: (1e-10, 1e-12)}
INDUCTOR_TOL = {torch.bfloat16: (1.6e-2, 1e-3, 2e-2), torch.float32: (2e-4, 2e-5),
                torch.float64: (1e-9, 1e-11)}


# ----------------------------------------------------------------------------------------------
# Op counting
# ----------------------------------------------------------------------------------------------

def as_overload(target):
    """Dynamo graphs hold ``OpOverloadPacket``s, AOT graphs ``OpOverload``s: map both to one."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.default
    return target


def op_counts(gm: torch.fx.GraphModule, namespace: str | None = "dplr") -> Counter:
    """Calls of each op overload in ``gm`` and every nested graph (checkpoint subgraphs)."""
    counts: Counter = Counter()
    for mod in gm.modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            if node.op != "call_function":
                continue
            target = as_overload(node.target)
            if not isinstance(target, torch._ops.OpOverload):
                continue
            if namespace is None or target.namespace == namespace:
                counts[target] += 1
    return counts


def total_counts(graphs, namespace: str | None = "dplr") -> Counter:
    counts: Counter = Counter()
    for gm in graphs:
        counts += op_counts(gm, namespace)
    return counts


def find_nodes(graphs, target):
    return [n for gm in graphs for mod in gm.modules() if isinstance(mod, torch.fx.GraphModule)
            for n in mod.graph.nodes if n.op == "call_function" and as_overload(n.target) == target]


class DispatchCounter(TorchDispatchMode):
    """Counts every op overload dispatched while active (the ops a custom op's body runs are
    not seen: the mode is off while it handles the outer call)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def namespace(self, ns: str = "dplr") -> Counter:
        return Counter({op: n for op, n in self.counts.items() if op.namespace == ns})


# ----------------------------------------------------------------------------------------------
# Graph-recording backends
# ----------------------------------------------------------------------------------------------

@dataclass
class GraphRecorder:
    """A ``torch.compile`` backend that records every graph it is handed.

    ``dynamo``: the graphs Dynamo captured (one per compiled frame; a recompile adds one).
    ``forward`` / ``backward`` / ``inference``: the graphs AOT autograd produced after
    partitioning (the min-cut partitioner, as Inductor uses), run as they are.
    With ``inductor=True`` the same graphs are recorded on their way into Inductor
    (``compile_fx`` with a recording ``inner_compile``), so the compiled code is Inductor's.
    """

    inductor: bool = False
    dynamo: list = field(default_factory=list)
    forward: list = field(default_factory=list)
    backward: list = field(default_factory=list)
    inference: list = field(default_factory=list)

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm)
        if self.inductor:
            return self._inductor(gm, example_inputs)
        return aot_autograd(fw_compiler=self._record(self.forward),
                            bw_compiler=self._record(self.backward),
                            inference_compiler=self._record(self.inference),
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

    @staticmethod
    def _record(graphs):
        def compiler(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    def _inductor(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(graph, inputs, **kwargs):
            if kwargs.get("is_backward"):
                self.backward.append(graph)
            elif kwargs.get("is_inference"):
                self.inference.append(graph)
            else:
                self.forward.append(graph)
            return compile_fx_inner(graph, inputs, **kwargs)

        # A hit in the AOT autograd cache would skip inner_compile (and the recording).
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    @property
    def frames(self) -> int:
        return len(self.dynamo)

    def counts(self, which: str, namespace: str | None = "dplr") -> Counter:
        return total_counts(getattr(self, which), namespace)


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

ARG_NAMES = ("q", "k", "v", "a", "b", "gk")


def make_inputs(B=2, T=40, H=N_HEADS, K=HEAD_DIM, V=HEAD_DIM, dtype=torch.float32,
                cu_seqlens=None, initial_state=False, seed=0, requires_grad=True) -> dict:
    """DPLR inputs in RWKV-7's style (a = -kk, b = kk * iclr) with an unbounded logsigmoid gate.

    Returns a dict with q, k, v, a, b, gk, initial_state (or None) and cu_seqlens (or None),
    all on the test device (computed on the CPU, then moved: the same values on any device).
    """
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    kk = F.normalize(rand(B, T, H, K), dim=-1)
    x = dict(q=rand(B, T, H, K), k=rand(B, T, H, K) * K ** -0.5, v=rand(B, T, H, V), a=-kk,
             b=kk * torch.rand(B, T, H, K, generator=g, dtype=dtype),
             gk=F.logsigmoid(rand(B, T, H, K) + 2.0))
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    x["initial_state"] = rand(N, H, K, V) if initial_state else None
    x = {name: None if t is None else on_device(t).requires_grad_(requires_grad)
         for name, t in x.items()}
    x["cu_seqlens"] = None if cu_seqlens is None else index_tensor(cu_seqlens)
    return x


def differentiable(inputs: dict) -> list:
    return [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def run_and_grad(fn, tensors, *args, forward_ctx=None, backward_ctx=None, **kwargs):
    """Calls ``fn(*args, **kwargs)``, backpropagates a fixed random-weighted loss over all
    outputs, returns ``(outputs, grads of tensors)``.  Grads are cleared before and after.

    ``forward_ctx`` / ``backward_ctx``: context managers active around the call / the backward
    only (e.g. a :class:`DispatchCounter`).
    """
    for t in tensors:
        t.grad = None
    with forward_ctx or contextlib.nullcontext():
        out = fn(*args, **kwargs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    loss = weighted_loss(outs)
    with backward_ctx or contextlib.nullcontext():
        loss.backward()
    grads = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    return [o.detach() for o in outs], grads


def weighted_loss(outs):
    """A loss whose gradient w.r.t. each output is a fixed pseudo-random tensor (not all ones:
    sums hide errors that cancel across positions)."""
    total = 0
    for i, o in enumerate(outs):
        # Drawn in fp32 whatever o's dtype (bf16 draws differ across torch versions), so an
        # autocast run and its fp32 reference weigh their outputs alike.
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(100 + i))
        total = total + (o * w.to(o.device, o.dtype)).sum()
    return total


def assert_all_close(actual, expected, tol=TOL):
    assert len(actual) == len(expected)
    for i, (x, y) in enumerate(zip(actual, expected)):
        assert (x is None) == (y is None), f"entry {i}: one side is None"
        if x is None:
            continue
        rtol, atol, *of_max = tol[y.dtype]
        if of_max and y.numel():
            atol += of_max[0] * y.detach().abs().max().item()
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"entry {i}: {m}")


# ----------------------------------------------------------------------------------------------
# Functions and models under test
# ----------------------------------------------------------------------------------------------

def chunk_fn(q, k, v, a, b, gk, initial_state=None, cu_seqlens=None, output_final_state=True,
             chunk_size=CHUNK_SIZE):
    return torch_dplr.chunk_dplr_delta_rule(q, k, v, a, b, gk, initial_state=initial_state,
                                            output_final_state=output_final_state,
                                            cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def two_chunk_calls(q, k, v, a, b, gk, initial_state=None, cu_seqlens=None):
    """Two dplr calls in one region; the second consumes the first's output and state."""
    o1, h1 = chunk_fn(q, k, v, a, b, gk, initial_state, cu_seqlens)
    o2, h2 = chunk_fn(k, q, torch.tanh(o1), a, b, gk, h1, cu_seqlens)
    return o2, h2


def recurrent_fn(q, k, v, a, b, gk, initial_state=None, cu_seqlens=None):
    return torch_dplr.fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk,
                                                      initial_state=initial_state,
                                                      output_final_state=True,
                                                      cu_seqlens=cu_seqlens)


class RWKV7TimeMix(nn.Module):
    """A minimal RWKV-7 time-mix block: token shift, r/k/v/decay/iclr projections, DPLR
    attention through ``chunk_rwkv7`` and an output projection."""

    def __init__(self, d_model=D_MODEL, n_heads=N_HEADS, head_dim=HEAD_DIM, chunk_size=CHUNK_SIZE,
                 dtype=torch.float32):
        super().__init__()
        self.H, self.K, self.chunk_size = n_heads, head_dim, chunk_size
        inner = n_heads * head_dim
        self.mix = nn.Parameter(torch.full((5, d_model), 0.5, dtype=dtype))
        self.r, self.k, self.v, self.w, self.iclr = (
            nn.Linear(d_model, inner, bias=False, dtype=dtype) for _ in range(5))
        self.out = nn.Linear(inner, d_model, bias=False, dtype=dtype)

    def forward(self, x, state=None, cu_seqlens=None):
        B, T, _ = x.shape
        shifted = F.pad(x, (0, 0, 1, -1)) - x  # x_{t-1} - x_t (sequence boundaries ignored)
        xr, xk, xv, xw, xa = (x + shifted * m for m in self.mix)
        heads = lambda t: t.view(B, T, self.H, self.K)  # noqa: E731
        r, k, v = heads(self.r(xr)), heads(self.k(xk)), heads(self.v(xv))
        w = -math.exp(-0.5) * torch.sigmoid(heads(self.w(xw)))
        kk = F.normalize(k, dim=-1)
        a, b = -kk, kk * torch.sigmoid(heads(self.iclr(xa)))
        o, final_state = torch_dplr.chunk_rwkv7(r, w, k, v, a, b, initial_state=state,
                                                output_final_state=state is not None,
                                                cu_seqlens=cu_seqlens, lower_bound=RWKV7_BOUND,
                                                chunk_size=self.chunk_size)
        y = self.out(o.reshape(B, T, self.H * self.K))
        return y if state is None else (y, final_state)


def checkpointed(fn, policy, extra_save_ops=()):
    """``fn`` under non-reentrant activation checkpointing with a torch_dplr policy."""
    context_fn = policies.context_fn(policy, extra_save_ops)

    def wrapped(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return wrapped


def make_block(seed=0, dtype=torch.float32, **kwargs) -> RWKV7TimeMix:
    """The block, initialized on the CPU from ``seed`` and moved to the test device."""
    torch.manual_seed(seed)
    block = RWKV7TimeMix(dtype=dtype, **kwargs)
    with torch.no_grad():  # give the decay projection a spread of gates, not all ~sigmoid(0)
        block.w.weight.mul_(3.0)
    return block.to(DEVICE)


def block_input(B=2, T=40, d_model=D_MODEL, dtype=torch.float32, seed=1, requires_grad=True):
    x = torch.randn(B, T, d_model, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return on_device(x).requires_grad_(requires_grad)
