"""Test helpers shared by tests/, compile_tests/, the self-check and the benchmarks.

The oracle is the per-token recurrence in fp64, written here independently of the library's
kernels, with gradients from ``torch.autograd``.
"""
from __future__ import annotations

import math

import contextlib

import torch

RWKV7_BOUND = -math.exp(-0.5)  # -0.6065...: RWKV-7's w = -exp(-0.5)·sigmoid(·)
GATE_STYLES = ("rwkv7", "saturated", "unbounded")

# RMS(out - ref) / RMS(ref) bars per input dtype: (outputs o and final state, gradients).
TOLERANCES = {
    torch.bfloat16: (0.007, 0.008),
    torch.float16: (0.002, 0.002),
    torch.float32: (2e-5, 5e-5),
    torch.float64: (1e-10, 1e-10),
}

# The fused no-grad forward against the staged TileLang kernels (RMS ratio, o and final state):
# the same rounding points, so only summation order inside wgmma and the rare dtype rounding
# flips it causes differ (a first guess, to tighten after GPU runs).
FUSED_VS_STAGED_TOL = {torch.bfloat16: dict(o=5e-3, ht=1e-4), torch.float16: dict(o=2e-3, ht=1e-4)}


def rms_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``RMS(out - ref) / RMS(ref)`` in fp64 on the tensors' device (0 when both are zero)."""
    out, ref = out.detach().double(), ref.detach().double()
    denom = ref.pow(2).mean().sqrt().item()
    err = (out - ref).pow(2).mean().sqrt().item()
    return err / denom if denom > 0 else err


def make_gates(shape, style: str, generator=None, device="cpu") -> torch.Tensor:
    """Natural-log decays in fp32: RWKV-7 bounded, pinned at the bound, or unbounded logsigmoid."""
    x = torch.randn(shape, generator=generator, device=device)
    if style == "rwkv7":
        return RWKV7_BOUND * torch.sigmoid(x)
    if style == "saturated":
        return torch.full(shape, RWKV7_BOUND, device=device)
    if style == "unbounded":
        # Heavy tail: some gates reach -40, so chunk-long cumsums span hundreds of e-folds.
        return torch.nn.functional.logsigmoid(4 * x) * torch.where(x > 1.5, 3.0, 1.0)
    raise ValueError(f"unknown gate style {style!r}; expected one of {GATE_STYLES}")


def make_inputs(B, T, H, K, V=None, *, dtype=torch.float32, gates="rwkv7", seed=0,
                device="cpu", num_states=None):
    """RWKV-7-shaped inputs: q, k, v, a = -kk, b = kk·iclr, gk, initial_state.

    ``num_states`` sets the initial state's batch (sequence count for varlen).
    """
    V = K if V is None else V
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    kk = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1)
    iclr = torch.sigmoid(rand(B, T, H, K))
    tensors = dict(q=rand(B, T, H, K), k=rand(B, T, H, K) * K ** -0.5, v=rand(B, T, H, V),
                   a=-kk, b=kk * iclr)
    out = {n: x.to(device=device, dtype=dtype) for n, x in tensors.items()}
    # Gates and state stay fp32 (as models keep them) unless everything is fp64.
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    out["gk"] = make_gates((B, T, H, K), gates, gen).to(device=device, dtype=wide)
    out["initial_state"] = rand(num_states or B, H, K, V).to(device=device, dtype=wide)
    return out


def recurrence_oracle(q, k, v, a, b, gk, scale, initial_state=None, cu_seqlens=None):
    """fp64 per-token recurrence; returns (o, final_state) differentiable w.r.t. the inputs."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, a, b, gk = (x.double() for x in (q, k, v, a, b, gk))
    bounds = [(n, n * T, (n + 1) * T) for n in range(B)] if cu_seqlens is None else \
        [(n, s, e) for n, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))]
    flat = [x.reshape(B * T, H, -1) for x in (q, k, v, a, b, gk)]
    outs, finals = [None] * (B * T), []
    for n, start, end in bounds:
        S = initial_state[n].double() if initial_state is not None else \
            q.new_zeros(H, K, V)
        for t in range(start, end):
            qt, kt, vt, at, bt, gt = (x[t] for x in flat)
            S = torch.exp(gt)[..., None] * S + bt[..., None] * (at[..., None] * S).sum(-2, keepdim=True) \
                + kt[..., None] * vt[:, None, :]
            outs[t] = scale * (qt[..., None] * S).sum(-2)
        finals.append(S)
    o = torch.stack(outs).reshape(B, T, H, V) if outs else q.new_zeros(B, T, H, V)
    return o, torch.stack(finals)


GRAD_NAMES = ("q", "k", "v", "a", "b", "gk", "initial_state")


def parity_errors(B, T, H, K, V=None, *, dtype=torch.float32, gates="rwkv7", chunk_size=64,
                  cu_seqlens=None, use_state=True, lower_bound=None, seed=0, device="cpu",
                  fn=None, scale=None):
    """Error ratios {name: RMS(err)/RMS(ref)} for o, final state and every input gradient.

    The oracle sees the same (dtype-rounded) inputs upcast to fp64, so the ratios measure
    the op's own error.
    """
    if fn is None:
        from .api import chunk_dplr_delta_rule as fn
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    inp = make_inputs(B, T, H, K, V, dtype=dtype, gates=gates, seed=seed, device=device,
                      num_states=N)
    if not use_state:
        inp["initial_state"] = None
    names = [n for n in GRAD_NAMES if inp[n] is not None]
    ours = {n: inp[n].detach().clone().requires_grad_() for n in names}
    theirs = {n: inp[n].detach().double().clone().requires_grad_() for n in names}
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    scale_ = K ** -0.5 if scale is None else scale
    o, ht = fn(ours["q"], ours["k"], ours["v"], ours["a"], ours["b"], ours["gk"], scale=scale_,
               initial_state=ours.get("initial_state"), output_final_state=True,
               cu_seqlens=cu, chunk_size=chunk_size, lower_bound=lower_bound)
    o_ref, ht_ref = recurrence_oracle(theirs["q"], theirs["k"], theirs["v"], theirs["a"],
                                      theirs["b"], theirs["gk"], scale_,
                                      theirs.get("initial_state"), cu)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64).to(device)
    dht = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64).to(device)
    loss = (o.double() * do).sum() + (ht.double() * dht).sum()
    grads = torch.autograd.grad(loss, [ours[n] for n in names])
    ref_grads = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(),
                                    [theirs[n] for n in names])
    errors = {"o": rms_ratio(o, o_ref), "final_state": rms_ratio(ht, ht_ref)}
    for n, g, r in zip(names, grads, ref_grads):
        if not torch.isfinite(g).all():
            raise AssertionError(f"non-finite gradient for {n}")
        errors["d" + n] = rms_ratio(g, r)
    if not (torch.isfinite(o).all() and torch.isfinite(ht).all()):
        raise AssertionError("non-finite output")
    return errors


# The PyTorch stage kernels a CUDA op falls back to (module, function name).
PYTORCH_STAGES = (("intra", "chunk_intra_fwd_reference"), ("intra", "chunk_intra_bwd_reference"),
                  ("wy", "chunk_wy_fwd_reference"), ("wy", "chunk_wy_bwd_reference"),
                  ("state", "chunk_state_fwd_reference"), ("state", "chunk_state_bwd_reference"))
# (dplr::chunk_fwd_fused has no PyTorch fallback of its own on CUDA: without its kernel it
# composes the stage ops, which the entries above guard.)


@contextlib.contextmanager
def forbid_pytorch_stages():
    """Inside, a CUDA op that would fall back to a PyTorch stage kernel raises instead: proof
    that a call ran the TileLang kernels only (GPU tests, the sanitizer driver)."""
    import importlib

    def failing(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"{name} ran: the TileLang kernel was not used")
        return fail

    saved = []
    try:
        for module_name, name in PYTORCH_STAGES:
            module = importlib.import_module(f"torch_dplr.ops.{module_name}")
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, failing(name))
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@contextlib.contextmanager
def exact_intra_schemes():
    """Inside, calls whose gate bound does not license the intra kernels' centred schemes run
    the exact tiled ones throughout, as they do at chunk 64 (GPU tests: the reference for the
    checked centred schemes, ``torch_dplr.ops.kernels.intra_schemes``)."""
    from .ops import kernels

    saved = kernels.CHECKED_CENTRED_CHUNKS
    kernels.CHECKED_CENTRED_CHUNKS = ()
    kernels.forget_gate_kernel_choices()
    try:
        yield
    finally:
        kernels.CHECKED_CENTRED_CHUNKS = saved
        kernels.forget_gate_kernel_choices()


# the ops whose CUDA function launches TileLang kernels (the stage ops, the no-grad op, the
# two-op training pass)
CUDA_BODY_OPS = ("chunk_intra_fwd", "chunk_wy_fwd", "chunk_state_fwd", "chunk_intra_bwd",
                 "chunk_wy_bwd", "chunk_state_bwd", "chunk_fwd_fused", "chunk_fwd", "chunk_bwd")


@contextlib.contextmanager
def cuda_op_bodies_on_cpu(kernel_for, sm_count=lambda: 132):
    """Inside, CPU calls of the ``dplr`` ops run their CUDA functions, as on an sm_90 GPU: each
    kernel comes from ``kernel_for(op, chunk_size, K, V, dtype, gate_dtype, lower_bound)``
    (standing in for ``ops.kernels.kernel_for``: e.g. a launch that checks its arguments, or one
    that does nothing) and the GPU has ``sm_count()`` SMs.  The launch path's host code, on a
    machine without a GPU (tests/test_launch_args.py, tools/host_sim.py).  Which configurations
    take the kernels is decided as on the GPU, and the calls that skip the dispatcher on a GPU
    skip it here too (``ops.direct_call``: the CUDA functions are the CPU's direct kernels)."""
    import importlib

    from torch._library.custom_ops import OPDEFS

    from .ops import direct_call

    mods = {name: importlib.import_module(f"torch_dplr.ops.{name}")
            for name in ("intra", "wy", "state", "fused", "tilelang_path")}
    patches = [(mods["tilelang_path"], "tilelang_usable", lambda device: True)]
    patches += [(mods[m], "kernel_for", kernel_for) for m in ("intra", "wy", "state", "fused")]
    for m in ("state", "fused"):
        patches += [(mods[m], "device_index", lambda device: 0),
                    (mods[m], "sm_count", lambda index: sm_count())]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    names = [f"dplr::{op}" for op in CUDA_BODY_OPS]
    direct = {name: direct_call.direct_kernel(name, "cuda") for name in names}
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        with torch.library._scoped_library("dplr", "IMPL") as lib, \
                direct_call.direct_kernels("cpu", direct):
            for name in names:
                lib.impl(name.split("::")[1], OPDEFS[name]._backend_fns["cuda"], "CPU")
            yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
