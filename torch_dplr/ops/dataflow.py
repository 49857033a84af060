"""``dplr::chunk_fwd`` / ``dplr::chunk_bwd``: the chunked training pass as two ops.

The six stage ops (``chunk_intra_fwd``, ``chunk_wy_fwd``, ``chunk_state_fwd`` and their
backward ops) hand every chunk-local term to the next stage through HBM and keep them for the
backward: 12.5 GB per forward+backward at B8 T4096 H32 D64 (docs/training_dataflow.md).  These
two ops keep nothing of the chunk-local terms between the passes:

- ``chunk_fwd`` returns ``o``, the final state and the state at every chunk start (fp32
  ``[B, slots, H, K, V]``, the layout of ``chunk_state_fwd``'s ``h``): nothing else of the
  forward survives it;
- ``chunk_bwd`` takes the inputs, the kept states, ``do`` and ``dht`` and recomputes every
  chunk-local term.

Save-versus-recompute stays a checkpoint policy: ``save_state`` keeps ``chunk_fwd``'s outputs
(the states), ``recompute_all`` runs the forward again inside the backward.

Kernels.  On CUDA the two ops run the six stage kernels inside their bodies, called as
functions past the dispatcher: three custom-op calls a forward+backward (with the chunk
tables) instead of seven.  That saves host time under a checkpoint policy (no ``dplr`` op is
replayed), not without one, where the stage bodies dominate it (tools/host_probe.py,
docs/training_dataflow.md); and it costs GPU time: the backward runs the three forward stage
kernels again before the three backward ones (the states ``chunk_fwd`` kept are not read on
this path).  Where the TileLang stage kernels do not apply
but the Triton split kernels do (bf16 data at K = V = 32, :func:`runs_split_kernels`) those
run: every 16-row tile's terms in parallel, then one walk of the state per (sequence, head)
(forward, :func:`csrc_triton.state_sweep.split_forward`), and in the backward the terms
again, a walk of the state gradient alone from the kept states, then every chunk's gradients
in parallel (:func:`csrc_triton.chunk_grads.split_backward`), within bf16 rounding of the
staged ops in every gate regime.  Elsewhere (other dtypes or head dims, the CPU) the stage
functions fall back to their PyTorch kernels: the same results, never a wrong one.

Which pass a public call composes (:func:`training_pass`) is decided when the call is made (when
a compiled graph is traced) from ``TORCH_DPLR_TRAINING_PASS``: ``stages`` (the default) or
``split`` (these two ops).
"""
import os
from typing import Optional

import torch
from torch import Tensor

from .chunked import without_autocast
from .direct_call import call_op, register_autograd, register_kernel
from .intra import (chunk_intra_bwd_cuda, chunk_intra_bwd_reference, chunk_intra_fwd_cuda,
                    chunk_intra_fwd_reference)
from .shapes import (allocate, chunk_bwd_shapes, chunk_fwd_shapes, num_sequences,
                     zeros_for_missing)
from .state import (chunk_state_bwd_cuda, chunk_state_bwd_reference, chunk_state_fwd_cuda,
                    chunk_state_fwd_reference)
from .tilelang_path import kernels_apply
from .triton_path import sweep_kernels_apply
from .varlen import as_one_sequence_list as flat
from .varlen import tables_for
from .wy import (chunk_wy_bwd_cuda, chunk_wy_bwd_reference, chunk_wy_fwd_cuda,
                 chunk_wy_fwd_reference)

#: Environment variable choosing the training pass of the public chunked calls.
TRAINING_PASS_VAR = "TORCH_DPLR_TRAINING_PASS"
TRAINING_PASSES = ("stages", "split")


def training_pass() -> str:
    """``"stages"`` (six stage ops) or ``"split"`` (``chunk_fwd`` / ``chunk_bwd``), from
    :data:`TRAINING_PASS_VAR` (unset: ``"stages"``)."""
    chosen = os.environ.get(TRAINING_PASS_VAR, "stages")
    if chosen not in TRAINING_PASSES:
        raise ValueError(f"{TRAINING_PASS_VAR} must be one of {TRAINING_PASSES}, got {chosen!r}")
    return chosen


# --------------------------------------------------------------------------- the stage path


class _Stages:
    """The six stage functions in sequence: the stage ops' PyTorch kernels, or their CUDA
    functions called as functions (the two ops are already past the dispatcher; each stage
    dispatch would cost its own host time)."""

    def __init__(self, intra_fwd, wy_fwd, state_fwd, intra_bwd, wy_bwd, state_bwd):
        self.intra_fwd, self.wy_fwd, self.state_fwd = intra_fwd, wy_fwd, state_fwd
        self.intra_bwd, self.wy_bwd, self.state_bwd = intra_bwd, wy_bwd, state_bwd

    def forward(self, q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size,
                lower_bound, use_initial_state, tables):
        """Every stage's outputs: (intra outputs, wy outputs, state outputs)."""
        intra = self.intra_fwd(q, k, a, b, gk, cu_seqlens, scale, chunk_size, lower_bound,
                               tables)
        gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = intra
        wy = self.wy_fwd(A_ab, A_ak, ag, v, cu_seqlens, chunk_size, tables)
        state = self.state_fwd(qg, kg, bg, wy[1], wy[2], v, A_qk, A_qb, gl, initial_state,
                               cu_seqlens, chunk_size, use_initial_state, True, tables)
        return intra, wy, state

    def backward(self, q, k, v, a, b, gk, initial_state, cu_seqlens, do, dht, scale,
                 chunk_size, lower_bound, use_initial_state, use_dht, tables):
        """dq, dk, dv, da, db, dgk, dh0 by the chain rule through the recomputed stages (the
        stage backward functions allocate them in ``chunk_bwd_shapes``' shapes and dtypes
        already; dh0: ``initial_state``'s, or size 0)."""
        intra, wy, state = self.forward(q, k, v, a, b, gk, initial_state, cu_seqlens, scale,
                                        chunk_size, lower_bound, use_initial_state, tables)
        gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = intra
        A_ab_inv, w, _u = wy
        _o, _ht, h, v_new = state
        dqg, dkg, dbg, dw, du, dv, dA_qk, dA_qb, dgl, dh0 = self.state_bwd(
            qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, do, dht, initial_state, cu_seqlens,
            chunk_size, use_initial_state, use_dht, tables)
        dA_ab, dA_ak, dag, dv_wy = self.wy_bwd(A_ab_inv, A_ak, ag, v, dw, du, cu_seqlens,
                                               chunk_size, tables)
        dq, dk, da, db, dgk = self.intra_bwd(q, k, a, b, gk, cu_seqlens, gl, dgl, dA_qk, dA_qb,
                                             dA_ak, dA_ab, dqg, dkg, dag, dbg, scale,
                                             chunk_size, lower_bound, tables)
        return dq, dk, dv + dv_wy, da, db, dgk, dh0


REFERENCE_STAGES = _Stages(chunk_intra_fwd_reference, chunk_wy_fwd_reference,
                           chunk_state_fwd_reference, chunk_intra_bwd_reference,
                           chunk_wy_bwd_reference, chunk_state_bwd_reference)
CUDA_STAGES = _Stages(chunk_intra_fwd_cuda, chunk_wy_fwd_cuda, chunk_state_fwd_cuda,
                      chunk_intra_bwd_cuda, chunk_wy_bwd_cuda, chunk_state_bwd_cuda)


# --------------------------------------------------------------------------- the ops


@without_autocast
def chunk_fwd_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                        initial_state: Tensor, cu_seqlens: Tensor, scale: float,
                        chunk_size: int, lower_bound: float, use_initial_state: bool,
                        tables: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    _intra, _wy, (o, ht, h, _v_new) = REFERENCE_STAGES.forward(
        q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size, lower_bound,
        use_initial_state, tables)
    return o, ht, h


chunk_fwd = torch.library.custom_op("dplr::chunk_fwd", mutates_args=())(chunk_fwd_reference)


@chunk_fwd.register_fake
def _(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size, lower_bound,
      use_initial_state, tables=None):
    return allocate(chunk_fwd_shapes(q, v, cu_seqlens, chunk_size), q.device)


def runs_split_kernels(q: Tensor, v: Tensor, gk: Tensor, cu_seqlens: Tensor,
                       chunk_size: int) -> bool:
    """The Triton split kernels run a CUDA call of the two ops where they can
    (:func:`sweep_kernels_apply`; the initial state, of any float dtype, is read as fp32) and
    the TileLang stage kernels cannot (K = V = 32): where both apply the stage kernels are
    faster (at B8 T4096 H32 D64, chunk 64, on an H100, forward+backward 6.0 ms through the
    stage ops against about 14 ms for the split kernels, docs/training_dataflow.md).  Shapes,
    dtypes and the device only."""
    return (sweep_kernels_apply(q, v, gk, num_sequences(q, cu_seqlens))
            and not kernels_apply(q, chunk_size, q.shape[-1], v.shape[-1]))


# The split kernels' knobs.  A walk step per 16-row tile at every chunk size: at B8 T4096 H32
# D64, chunk 64 (H100, benchmarks/results/h100-sweep.jsonl) the 16-row tile terms take 1.22 ms
# against 5.13 ms for the chunk-64 terms (csrc_triton.chunk_terms), and the 16-row split
# forward 2.26 ms at num_stages 3 (2.60 at 1) against 6.28 ms; the backward 11.85 ms at
# num_stages 1 (12.48 at 3) against 15.39 ms.
WALK_ROWS = 16
FORWARD_STAGES = 3
BACKWARD_STAGES = 1


@register_kernel(chunk_fwd, "cuda")
@without_autocast
def chunk_fwd_cuda(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size,
                   lower_bound, use_initial_state, tables=None):
    if not runs_split_kernels(q, v, gk, cu_seqlens, chunk_size):
        _intra, _wy, (o, ht, h, _v_new) = CUDA_STAGES.forward(
            q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size, lower_bound,
            use_initial_state, tables)
        return o, ht, h
    from csrc_triton import state_sweep
    B, T, H, _ = q.shape
    o, ht, h = allocate(chunk_fwd_shapes(q, v, cu_seqlens, chunk_size), q.device)
    tb = tables_for(tables, cu_seqlens, B, T, chunk_size, q.device)
    h0 = initial_state.float().contiguous() if use_initial_state else ht
    flags = torch.empty(tb.cu_seqlens.shape[0] - 1, H, dtype=torch.int32, device=q.device)
    state_sweep.split_forward(*map(flat, (q, k, v, a, b, gk)), h0, tb, flat(o), ht, flat(h),
                              flags, float(scale), chunk_size, use_initial_state, True,
                              lower_bound > float("-inf"), num_stages=FORWARD_STAGES,
                              walk_rows=WALK_ROWS)
    return o, ht, h


@without_autocast
def chunk_bwd_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                        initial_state: Tensor, states: Tensor, cu_seqlens: Tensor, do: Tensor,
                        dht: Tensor, scale: float, chunk_size: int, lower_bound: float,
                        use_initial_state: bool, use_dht: bool, tables: Optional[Tensor] = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # the PyTorch kernel recomputes the states with the rest of the forward (``states`` is the
    # kernels' shortcut to the same values)
    return REFERENCE_STAGES.backward(q, k, v, a, b, gk, initial_state, cu_seqlens, do, dht,
                                     scale, chunk_size, lower_bound, use_initial_state, use_dht,
                                     tables)


chunk_bwd = torch.library.custom_op("dplr::chunk_bwd", mutates_args=())(chunk_bwd_reference)


@chunk_bwd.register_fake
def _(q, k, v, a, b, gk, initial_state, states, cu_seqlens, do, dht, scale, chunk_size,
      lower_bound, use_initial_state, use_dht, tables=None):
    return allocate(chunk_bwd_shapes(q, k, v, a, b, gk, initial_state, use_initial_state),
                    q.device)


@register_kernel(chunk_bwd, "cuda")
@without_autocast
def chunk_bwd_cuda(q, k, v, a, b, gk, initial_state, states, cu_seqlens, do, dht, scale,
                   chunk_size, lower_bound, use_initial_state, use_dht, tables=None):
    if not runs_split_kernels(q, v, gk, cu_seqlens, chunk_size):
        # recomputes the whole forward (the state kernel's v_new included) from the inputs
        return CUDA_STAGES.backward(q, k, v, a, b, gk, initial_state, cu_seqlens, do, dht,
                                    scale, chunk_size, lower_bound, use_initial_state, use_dht,
                                    tables)
    from csrc_triton import chunk_grads
    B, T, H, K = q.shape
    V = v.shape[-1]
    outs = allocate(chunk_bwd_shapes(q, k, v, a, b, gk, initial_state, use_initial_state),
                    q.device)
    tb = tables_for(tables, cu_seqlens, B, T, chunk_size, q.device)
    N = tb.cu_seqlens.shape[0] - 1
    spare = states.new_empty(N, H, K, V)  # stands for dht / dh0 where the call has none
    dht4 = dht.float().reshape(N, H, K, V).contiguous() if use_dht else spare
    dh0 = torch.empty(N, H, K, V, device=q.device) if use_initial_state else spare
    chunk_grads.split_backward(*map(flat, (q, k, v, a, b, gk)), flat(states),
                               flat(do.contiguous()), dht4, tb, *map(flat, outs[:6]), dh0,
                               float(scale), chunk_size, use_dht, use_initial_state,
                               lower_bound > float("-inf"), num_stages=BACKWARD_STAGES,
                               walk_rows=WALK_ROWS)
    if use_initial_state:
        outs[6].copy_(dh0.view(outs[6].shape))
    return outs


# --------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    (q, k, v, a, b, gk, initial_state, cu_seqlens, scale, chunk_size, lower_bound,
     use_initial_state, tables) = inputs
    _o, _ht, states = output
    ctx.mark_non_differentiable(states)
    ctx.save_for_backward(q, k, v, a, b, gk, initial_state, states, cu_seqlens, tables)
    ctx.config = (scale, chunk_size, lower_bound, use_initial_state)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht, dstates_unused):
    q, k, v, a, b, gk, initial_state, states, cu_seqlens, tables = ctx.saved_tensors
    scale, chunk_size, lower_bound, use_initial_state = ctx.config
    (do,) = zeros_for_missing((do,), [(v.shape, v.dtype)], v.device)
    use_dht = dht is not None
    if dht is None:
        dht = q.new_zeros(0, dtype=states.dtype)
    *grads, dh0 = call_op(torch.ops.dplr.chunk_bwd, q, k, v, a, b, gk, initial_state, states,
                          cu_seqlens, do, dht, scale, chunk_size, lower_bound, use_initial_state,
                          use_dht, tables)
    return (*grads, dh0 if use_initial_state else None, None, None, None, None, None, None)


register_autograd(chunk_fwd, _backward, _setup_context)

