"""Public functions: argument names and order follow flash-linear-attention, so switching is
one import.  They validate, then only compose ``torch.ops.dplr.*`` ops: under
``torch.compile(fullgraph=True)`` a model sees a graph of opaque ``dplr::`` nodes.  Eager
calls go through :func:`~torch_dplr.ops.direct_call.call_op`, which skips the dispatcher
layers that would only redispatch and records a training op's formula as a plain autograd
node (the op's own autograd layer under compile, functorch and dispatch modes).

Save-versus-recompute is not a flag here: without checkpointing, autograd keeps each stage's
outputs (FLA's ``disable_recompute=True``); wrap the model in ``torch.utils.checkpoint`` with
a policy from :mod:`torch_dplr.policies` to recompute stages instead.  A chunked call that
needs no gradient (grad disabled, or no input requiring grad) keeps nothing: it runs the one
op ``dplr::chunk_fwd_fused`` instead of the stages.  A training call composes either the six
stage ops or the two ops ``dplr::chunk_fwd`` / ``dplr::chunk_bwd``
(``TORCH_DPLR_TRAINING_PASS``, :mod:`torch_dplr.ops.dataflow`).
"""
from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers torch.ops.dplr)
from . import time_parallel
from .ops.dataflow import training_pass
from .ops.direct_call import call_op
from .validation import check_inputs

DEFAULT_CHUNK_SIZE = 64
SAFE_GATE_BOUND = -5.0  # FLA's `safe_gate=True` promises gates in [-5, 0)

__all__ = ["chunk_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_dplr_delta_rule",
           "fused_recurrent_rwkv7"]


def _reject_extra_kwargs(kwargs, fn):
    if "head_first" in kwargs:
        raise ValueError("head_first is not supported: inputs are [B, T, H, D]")
    if kwargs:
        raise TypeError(f"{fn}() got unexpected keyword arguments {sorted(kwargs)}")


def _under_autocast(data: dict) -> dict:
    """Under ``torch.autocast`` the data inputs (not the gate, not the state) run in the
    autocast dtype, as ``scaled_dot_product_attention`` does; a model's projections and its
    fp32 normalisations then meet in one dtype instead of failing the dtype check."""
    first = next(iter(data.values()))
    device = first.device.type if isinstance(first, torch.Tensor) else "cpu"
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return data
    dtype = torch.get_autocast_dtype(device)
    eligible = (torch.float32, torch.float16, torch.bfloat16)
    return {n: x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype in eligible else x
            for n, x in data.items()}


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _sentinels(q, initial_state, cu_seqlens):
    """Fixed-arity ops: absent tensors travel as size-0 tensors plus a flag."""
    cu = cu_seqlens if cu_seqlens is not None else q.new_empty(0, dtype=torch.int64)
    h0 = initial_state if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return cu, h0, initial_state is not None


def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                          output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
                          safe_gate=False, chunk_size=None, disable_recompute=False,
                          cp_context=None, lower_bound=None, **kwargs):
    r"""Chunked DPLR delta rule.

    ``S_t = diag(exp(gk_t)) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.

    Args:
        q, k, a, b: ``[B, T, H, K]``; v: ``[B, T, H, V]``; all one dtype (bf16/fp16/fp32/fp64).
        gk: ``[B, T, H, K]`` natural-log decay (``gk <= 0``), any float dtype.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with cu_seqlens).
        output_final_state: also return the fp32 final state ``[N, H, K, V]``.
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences (requires B == 1).
        cu_seqlens_cpu: CPU copy of ``cu_seqlens``; lets validation read it without a sync.
        safe_gate: promise ``-5 <= gk`` (same as ``lower_bound=-5``).
        chunk_size: 16, 32 or 64 (default 64).
        disable_recompute: accepted for compatibility, no effect: recompute is a checkpoint
            policy here (see :mod:`torch_dplr.policies`).
        cp_context: a :func:`torch_dplr.cp.build_context` context: the inputs are this
            rank's share ``[1, T_rank, H, D]`` of the packed tokens, ``o`` its share of the
            result (see ``docs/context_parallel.md``).
        lower_bound: a promise ``lower_bound <= gk`` (negative); lets GPU kernels use a faster
            exact scheme.  Results never depend on it.

    Returns:
        ``(o [B, T, H, V], final_state or None)``.
    """
    _reject_extra_kwargs(kwargs, "chunk_dplr_delta_rule")
    if cp_context is not None:
        return _context_parallel(dict(q=q, k=k, v=v, a=a, b=b, gk=gk), "gk", scale, initial_state,
                                 output_final_state, cu_seqlens, cu_seqlens_cpu, safe_gate,
                                 chunk_size, lower_bound, cp_context)
    q, k, v, a, b = _under_autocast(dict(q=q, k=k, v=v, a=a, b=b)).values()
    check_inputs(dict(q=q, k=k, v=v, a=a, b=b, gk=gk), gate="gk", value="v", scale=scale,
                 initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                 chunk_size=chunk_size, lower_bound=lower_bound)
    return _chunk(q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens,
                  safe_gate, chunk_size, lower_bound)


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                disable_recompute=False, cp_context=None, lower_bound=None, **kwargs):
    """RWKV-7 time mixing: :func:`chunk_dplr_delta_rule` with ``q=r, gk=w`` and ``scale=1``.

    RWKV-7's gate ``w = -exp(-0.5)·sigmoid(·)`` is bounded: pass ``lower_bound=-0.6065``.
    """
    _reject_extra_kwargs(kwargs, "chunk_rwkv7")
    if cp_context is not None:
        return _context_parallel(dict(r=r, k=k, v=v, a=a, b=b, w=w), "w", scale, initial_state,
                                 output_final_state, cu_seqlens, cu_seqlens_cpu, safe_gate,
                                 chunk_size, lower_bound, cp_context)
    r, k, v, a, b = _under_autocast(dict(r=r, k=k, v=v, a=a, b=b)).values()
    check_inputs(dict(r=r, k=k, v=v, a=a, b=b, w=w), gate="w", value="v", scale=scale,
                 initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                 chunk_size=chunk_size, lower_bound=lower_bound)
    return _chunk(r, k, v, a, b, w, scale, initial_state, output_final_state, cu_seqlens,
                  safe_gate, chunk_size, lower_bound)


def _context_parallel(tensors, gate, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, safe_gate, chunk_size, lower_bound, cp_context):
    # imported here: torch_dplr.cp composes the public functions of this module
    from .cp.chunk import chunk_context_parallel
    return chunk_context_parallel(tensors, gate=gate, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                  cu_seqlens_cpu=cu_seqlens_cpu, safe_gate=safe_gate,
                                  chunk_size=chunk_size, lower_bound=lower_bound,
                                  cp_context=cp_context)


def _chunk(q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, safe_gate,
           chunk_size, lower_bound):
    C = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    bound = float("-inf") if lower_bound is None else float(lower_bound)
    if safe_gate:
        bound = max(bound, SAFE_GATE_BOUND)
    S = time_parallel.segments_for(q, cu_seqlens, C)
    if S > 1:
        def run(*tensors):
            return _chunk_ops(*tensors, None, scale, C, bound, True)
        o, final_state = time_parallel.segmented(run, q, k, v, a, b, gk, initial_state, S)
        return o, (final_state if output_final_state else None)
    return _chunk_ops(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, C, bound,
                      output_final_state)


def _chunk_ops(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, C, bound,
               output_final_state):
    """The chunked call as ``dplr::`` ops (``scale``, ``C``, ``bound`` resolved)."""
    cu, h0, use_h0 = _sentinels(q, initial_state, cu_seqlens)
    # the GPU kernels' chunk tables, built once for every op of the call (forward and backward;
    # the PyTorch kernels ignore them, built anyway so a graph is the same on every device)
    tables = call_op(torch.ops.dplr.chunk_tables, cu, q.shape[0], q.shape[1], C)
    if not _needs_grad(q, k, v, a, b, gk, initial_state):
        # nothing to keep for a backward: one op (one fused kernel on CUDA where it applies).
        # Grad mode and requires_grad are static to Dynamo: a compiled no-grad graph holds
        # this node, a training graph the staged ones.
        o, final_state = call_op(torch.ops.dplr.chunk_fwd_fused, q, k, v, a, b, gk, h0, cu,
                                 scale, C, bound, use_h0, tables)
        return o, (final_state if output_final_state else None)
    if training_pass() == "split":
        # the two-op pass (torch_dplr.ops.dataflow): chunk-local terms never leave a kernel
        o, final_state, _ = call_op(torch.ops.dplr.chunk_fwd, q, k, v, a, b, gk, h0, cu, scale,
                                    C, bound, use_h0, tables)
        return o, (final_state if output_final_state else None)
    gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = call_op(
        torch.ops.dplr.chunk_intra_fwd, q, k, a, b, gk, cu, scale, C, bound, tables)
    _, w, u = call_op(torch.ops.dplr.chunk_wy_fwd, A_ab, A_ak, ag, v, cu, C, tables)
    o, final_state, _, _ = call_op(torch.ops.dplr.chunk_state_fwd, qg, kg, bg, w, u, v, A_qk,
                                   A_qb, gl, h0, cu, C, use_h0, True, tables)
    return o, (final_state if output_final_state else None)


def fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                                    output_final_state=False, reverse=False, cu_seqlens=None,
                                    **kwargs):
    """Per-token form of :func:`chunk_dplr_delta_rule` (decode, short sequences).

    ``reverse=True`` walks each sequence from its last token.  Backward keeps every state of
    the sweep (``O(T·K·V)`` memory per sequence and head): use the chunked form for training.
    """
    _reject_extra_kwargs(kwargs, "fused_recurrent_dplr_delta_rule")
    q, k, v, a, b = _under_autocast(dict(q=q, k=k, v=v, a=a, b=b)).values()
    check_inputs(dict(q=q, k=k, v=v, a=a, b=b, gk=gk), gate="gk", value="v", scale=scale,
                 initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=None)
    return _recurrent(q, k, v, a, b, gk, scale, initial_state, output_final_state, reverse,
                      cu_seqlens)


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None,
                          output_final_state=True, cu_seqlens=None, **kwargs):
    """RWKV-7 per-token form: :func:`fused_recurrent_dplr_delta_rule` with ``q=r, gk=w``."""
    _reject_extra_kwargs(kwargs, "fused_recurrent_rwkv7")
    r, k, v, a, b = _under_autocast(dict(r=r, k=k, v=v, a=a, b=b)).values()
    check_inputs(dict(r=r, k=k, v=v, a=a, b=b, w=w), gate="w", value="v", scale=scale,
                 initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=None)
    return _recurrent(r, k, v, a, b, w, scale, initial_state, output_final_state, False,
                      cu_seqlens)


def _recurrent(q, k, v, a, b, gk, scale, initial_state, output_final_state, reverse,
               cu_seqlens, rwkv7_pair=False):
    """The per-token op on validated inputs (``rwkv7_pair``: ``a``, ``b`` are RWKV-7's
    ``kk``, ``a``).  A decode step's host time is not hidden behind its one small kernel, so
    the op is called through :func:`call_op`."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    cu, h0, use_h0 = _sentinels(q, initial_state, cu_seqlens)
    o, final_state = call_op(torch.ops.dplr.recurrent_fwd, q, k, v, a, b, gk, h0, cu, scale,
                             use_h0, bool(reverse), rwkv7_pair)
    return o, (final_state if output_final_state else None)
