"""``dplr::recurrent_fwd`` / ``dplr::recurrent_bwd``: the per-token recurrence (decode, short T)."""

import torch
from torch import Tensor

from ..reference import recurrent as ref
from .chunked import SequenceView, start_state, without_autocast
from .shapes import allocate, recurrent_bwd_shapes, recurrent_fwd_shapes, zeros_for_missing



@without_autocast
def recurrent_fwd_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                            initial_state: Tensor, cu_seqlens: Tensor, scale: float,
                            use_initial_state: bool, reverse: bool) -> tuple[Tensor, Tensor]:
    o, ht = allocate(recurrent_fwd_shapes(q, v, cu_seqlens), q.device)
    view = SequenceView(q, cu_seqlens, reverse)
    h0 = start_state(initial_state, use_initial_state, ht.shape, view.dtype, q.device)
    o_seq, h_end = ref.recurrent_fwd(*map(view.read, (q, k, v, a, b, gk)), h0, scale)
    view.write(o, o_seq)
    ht.copy_(h_end)
    return o, ht


recurrent_fwd = torch.library.custom_op("dplr::recurrent_fwd", mutates_args=())(recurrent_fwd_reference)


@recurrent_fwd.register_fake
def _(q, k, v, a, b, gk, initial_state, cu_seqlens, scale, use_initial_state, reverse):
    return allocate(recurrent_fwd_shapes(q, v, cu_seqlens), q.device)


@without_autocast
def recurrent_bwd_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor,
                            initial_state: Tensor, cu_seqlens: Tensor, do: Tensor, dht: Tensor,
                            scale: float, use_initial_state: bool, use_dht: bool, reverse: bool
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    outs = allocate(recurrent_bwd_shapes(q, k, v, a, b, gk, initial_state, use_initial_state),
                    q.device)
    view = SequenceView(q, cu_seqlens, reverse)
    state_shape = recurrent_fwd_shapes(q, v, cu_seqlens)[1][0]
    h0 = start_state(initial_state, use_initial_state, state_shape, view.dtype, q.device)
    dh_end = start_state(dht, use_dht, state_shape, view.dtype, q.device)
    *grads, dh0 = ref.recurrent_bwd(*map(view.read, (q, k, v, a, b, gk)), h0, scale,
                                    view.read(do), dh_end)
    for out, x in zip(outs[:6], grads):
        view.write(out, x)
    if use_initial_state:
        outs[6].copy_(dh0)
    return outs


recurrent_bwd = torch.library.custom_op("dplr::recurrent_bwd", mutates_args=())(recurrent_bwd_reference)


@recurrent_bwd.register_fake
def _(q, k, v, a, b, gk, initial_state, cu_seqlens, do, dht, scale, use_initial_state, use_dht,
      reverse):
    return allocate(recurrent_bwd_shapes(q, k, v, a, b, gk, initial_state, use_initial_state),
                    q.device)


def _setup_context(ctx, inputs, output):
    q, k, v, a, b, gk, initial_state, cu_seqlens, scale, use_initial_state, reverse = inputs
    ctx.save_for_backward(q, k, v, a, b, gk, initial_state, cu_seqlens)
    ctx.config = (scale, use_initial_state, reverse)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht):
    q, k, v, a, b, gk, initial_state, cu_seqlens = ctx.saved_tensors
    scale, use_initial_state, reverse = ctx.config
    (do,) = zeros_for_missing((do,), [(v.shape, v.dtype)], v.device)
    use_dht = dht is not None
    if dht is None:
        dht = q.new_zeros(0, dtype=torch.float32)
    *grads, dh0 = torch.ops.dplr.recurrent_bwd(q, k, v, a, b, gk, initial_state, cu_seqlens, do,
                                               dht, scale, use_initial_state, use_dht, reverse)
    return (*grads, dh0 if use_initial_state else None, None, None, None, None)


recurrent_fwd.register_autograd(_backward, setup_context=_setup_context)
