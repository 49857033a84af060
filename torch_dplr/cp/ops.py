"""``dplr::cp_join`` / ``dplr::cp_join_bwd``: the exchange of context parallelism.

``cp_join`` all-gathers every rank's record (the affine map ``[M | c]`` of the state crossing
its share, ``[H, K, K+V]``), scans them in rank order (:mod:`torch_dplr.affine`) to get the
state ``h`` entering this rank's share, and applies it to the carry-in piece:

    o[t]  = o_zero[t] + Σ_k o_carry[t, k] · h[k, :]     (o_carry[t] = scale · M_tᵀ q_t)
    y     = M_carry · h + c_carry                        (the piece's true end state)

``cp_join_bwd`` is the symmetric exchange: each rank all-gathers the gradient of the state
entering its share, and a reverse scan with transposed maps gives the gradient of the state
leaving it, hence of its own record.

The collectives run inside these ops rather than as traceable functional collectives:

- ``o`` is an output of ``cp_join`` on every rank, and ``cp_join_bwd`` takes ``do`` and gives
  ``d o_zero``, so no compiler pass can drop either op on a rank whose own result does not
  need the exchange (such a rank must still take part for the others);
- ``cp_join_bwd`` takes the output gradients as inputs, so the partitioner cannot move it
  into the forward graph, which it does with a functional collective whose input does not
  depend on a gradient (a rank with nothing carried in would then run the collectives in
  another order than its peers);
- an opaque op is one node for the checkpoint policies, and when a policy recomputes it,
  every rank recomputes it (its saved outputs are read by ``cp_join_bwd`` on every rank).

Both ops are functional with fixed arity; one shape function serves kernel and fake.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import affine


def _group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


def _all_gather(x: Tensor, group_name: str, world_size: int) -> Tensor:
    out = x.new_empty((world_size * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=_group(group_name))
    return out.view((world_size,) + tuple(x.shape))


def join_shapes(o_zero, c_carry, record, world_size):
    """o, y (the carry-in piece's end state), h (the state entering the share) and every
    rank's transition (what the backward needs of the records)."""
    H, K, KV = record.shape
    return ((tuple(o_zero.shape), o_zero.dtype), (tuple(c_carry.shape), c_carry.dtype),
            ((H, K, KV - K), record.dtype), ((world_size, H, K, K), record.dtype))


def join_bwd_shapes(do, dy, o_carry, m_carry, h, transitions):
    """Gradients of o_zero, o_carry, m_carry, c_carry and record."""
    H, K, V = h.shape
    return (*((tuple(x.shape), x.dtype) for x in (do, o_carry, m_carry, dy)),
            ((H, K, K + V), transitions.dtype))


def _alloc(shapes, device):
    return tuple(torch.empty(s, dtype=d, device=device) for s, d in shapes)


@torch.library.custom_op("dplr::cp_join", mutates_args=())
def cp_join(o_zero: Tensor, o_carry: Tensor, m_carry: Tensor, c_carry: Tensor, record: Tensor,
            group_name: str, rank: int, world_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``o_zero [1, T, H, V]``: the share's outputs with the carry-in piece started from zero;
    ``o_carry [1, L, H, K]``: ``scale·M_tᵀ q_t`` of the carry-in piece's L tokens (L = 0 when
    none); ``m_carry [1, H, K, K]``, ``c_carry [1, H, K, V]``: its map; ``record [H, K, K+V]``
    this rank's record."""
    o, y, h, transitions = _alloc(join_shapes(o_zero, c_carry, record, world_size), o_zero.device)
    K = record.shape[1]
    with torch.autocast(o_zero.device.type, enabled=False):
        records = _all_gather(record, group_name, world_size)
        transitions.copy_(records[..., :K])
        h.copy_(affine.chain_states_forward(transitions, records[..., K:])[rank])
        o.copy_(o_zero)
        L = o_carry.shape[1]
        if L:
            entering = torch.einsum("bthk,hkv->bthv", o_carry.to(h.dtype), h)
            o[:, :L] = (o_zero[:, :L].to(h.dtype) + entering).to(o.dtype)
        y.copy_(torch.einsum("phkj,hjv->phkv", m_carry, h) + c_carry)
    return o, y, h, transitions


@cp_join.register_fake
def _(o_zero, o_carry, m_carry, c_carry, record, group_name, rank, world_size):
    return _alloc(join_shapes(o_zero, c_carry, record, world_size), o_zero.device)


@torch.library.custom_op("dplr::cp_join_bwd", mutates_args=())
def cp_join_bwd(do: Tensor, dy: Tensor, o_carry: Tensor, m_carry: Tensor, h: Tensor,
                transitions: Tensor, group_name: str, rank: int, world_size: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``cp_join``'s inputs o_zero, o_carry, m_carry, c_carry, record from those
    of its outputs o and y (``h``, ``transitions``: its saved outputs)."""
    K = h.shape[1]
    d_zero, d_carry, d_m, d_c, d_record = _alloc(
        join_bwd_shapes(do, dy, o_carry, m_carry, h, transitions), do.device)
    with torch.autocast(do.device.type, enabled=False):
        d_zero.copy_(do)
        L = o_carry.shape[1]
        do_carry = do[:, :L].to(h.dtype)
        # gradient of the state entering this share, from this rank's own use of it
        dh = torch.einsum("bthk,bthv->hkv", o_carry.to(h.dtype), do_carry) \
            + torch.einsum("phkj,phkv->hjv", m_carry, dy)
        d_carry.copy_(torch.einsum("bthv,hkv->bthk", do_carry, h))
        d_m.copy_(torch.einsum("phkv,hjv->phkj", dy, h))
        d_c.copy_(dy)
        dh_all = _all_gather(dh, group_name, world_size)
        # adjoints of the states entering each share (none reads the state leaving the last);
        # this rank's record made the one entering the next share
        no_reader = dh_all.new_zeros((1,) + tuple(dh.shape))
        leaving = affine.chain_adjoints(transitions, torch.cat([dh_all, no_reader]))[rank + 1]
        d_record[..., :K] = leaving @ h.transpose(-1, -2)
        d_record[..., K:] = leaving
    return d_zero, d_carry, d_m, d_c, d_record


@cp_join_bwd.register_fake
def _(do, dy, o_carry, m_carry, h, transitions, group_name, rank, world_size):
    return _alloc(join_bwd_shapes(do, dy, o_carry, m_carry, h, transitions), do.device)


def _setup_context(ctx, inputs, output):
    o_zero, o_carry, m_carry, c_carry, record, group_name, rank, world_size = inputs
    _, _, h, transitions = output
    ctx.save_for_backward(o_carry, m_carry, h, transitions)
    ctx.config = (group_name, rank, world_size)
    ctx.zero_like = ((o_zero.shape, o_zero.dtype), (c_carry.shape, c_carry.dtype))
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dy, dh, dtransitions):
    o_carry, m_carry, h, transitions = ctx.saved_tensors
    (o_shape, o_dtype), (y_shape, y_dtype) = ctx.zero_like
    # every rank runs the backward exchange, also one whose outputs got no gradient
    if do is None:
        do = h.new_zeros(o_shape, dtype=o_dtype)
    if dy is None:
        dy = h.new_zeros(y_shape, dtype=y_dtype)
    grads = torch.ops.dplr.cp_join_bwd(do, dy, o_carry, m_carry, h, transitions, *ctx.config)
    return (*grads, None, None, None)


cp_join.register_autograd(_backward, setup_context=_setup_context)
