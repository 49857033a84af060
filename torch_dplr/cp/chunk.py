"""``chunk_dplr_delta_rule(..., cp_context=ctx)``: one rank's share of a context-parallel call.

Per rank, built on the public chunked op (its kernels and autograd), then one exchange:

1. The share's pieces in one varlen call, each from its known start (its initial state, or
   zero for the carry-in piece): outputs ``o_zero`` and every piece's end state.
2. The carry-in piece's map: the same call with ``v = 0`` (width K) and initial state I.
   With ``v = 0`` the state map is linear in the start state, so its final state is the
   transition ``M``, and its per-token outputs are ``scale·M_tᵀ q_t``, the term by which the
   true start state enters ``o_t``.  No second pass once the start state is known.  When
   K == V the two calls are one (the carry-in piece appended as one more sequence): twice the
   (sequence, head) pairs in one launch, where a long sequence alone leaves most SMs idle.
3. ``dplr::cp_join``: all-gather of the records, scan, correction of the carry-in piece.
4. Final states: rows of the sequences that end here; zeros elsewhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..api import chunk_dplr_delta_rule
from ..validation import check_inputs
from . import ops  # noqa: F401  (registers dplr::cp_join)
from .context import CPContext


def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_cp_inputs(tensors, *, gate, value, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
                    chunk_size, lower_bound, ctx) -> None:
    """Everything a rank can check alone, before any collective."""
    if not isinstance(ctx, CPContext):
        raise TypeError(f"cp_context must come from torch_dplr.cp.build_context, "
                        f"got {type(ctx).__name__}")
    if cu_seqlens is not None or cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens must not be passed with cp_context: the context carries "
                         "the global layout (torch_dplr.cp.build_context)")
    check_inputs(tensors, gate=gate, value=value, scale=scale, initial_state=None,
                 cu_seqlens=None, cu_seqlens_cpu=None, chunk_size=chunk_size,
                 lower_bound=lower_bound)
    first = next(iter(tensors))
    ref = tensors[first]
    B, T, H, K = ref.shape
    V = tensors[value].shape[-1]
    if B != 1:
        raise ValueError(f"with cp_context, {first} must be this rank's share of the packed "
                         f"tokens, [1, T_rank, H, K]; got B={B}")
    if ref.device != ctx.device:
        raise ValueError(f"{first} is on {ref.device} but cp_context was built for {ctx.device}")
    if not torch.compiler.is_compiling():
        share = ctx.shares[ctx.rank]
        if T != share:
            raise ValueError(f"{first} holds {T} tokens but cp_context gives rank {ctx.rank} a "
                             f"share of {share} (shares {list(ctx.shares)})")
        _check_group(ctx)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, "
                            f"got {type(initial_state).__name__}")
        # the sequence count as a size of the context's tensors, not an int: a compiled graph
        # then keeps it symbolic instead of specializing on it
        expected = (ctx.local.final_index.shape[0], H, K, V)
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"with cp_context, initial_state holds every sequence of the global "
                             f"layout: [N, H, K, V] = {expected}, got {tuple(initial_state.shape)}")
        if not initial_state.dtype.is_floating_point:
            raise TypeError(f"initial_state must be floating point, got {initial_state.dtype}")
        if initial_state.device != ref.device:
            raise ValueError(f"initial_state is on {initial_state.device} but {first} is on "
                             f"{ref.device}")


def _check_group(ctx) -> None:
    """The context's group must still be this process's view of it."""
    try:
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"cp_context's process group is not usable here: {err}") from None
    if (rank, world) != (ctx.rank, ctx.world_size):
        raise ValueError(f"cp_context was built as rank {ctx.rank} of {ctx.world_size}, but this "
                         f"process is rank {rank} of {world} in its group")


def _rows(source, index, mask):
    """``source[index]`` with the rows where ``mask`` is 0 set to zero (exactly)."""
    rows = source.index_select(0, index)
    return rows * mask.to(rows.dtype).reshape(-1, *([1] * (rows.dim() - 1)))


def chunk_context_parallel(tensors, *, gate, scale, initial_state, output_final_state,
                           cu_seqlens, cu_seqlens_cpu, safe_gate, chunk_size, lower_bound,
                           cp_context):
    """``tensors`` maps the caller's names to q, k, v, a, b, gk (in that order)."""
    ctx = cp_context
    check_cp_inputs(tensors, gate=gate, value="v", scale=scale, initial_state=initial_state,
                    cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size,
                    lower_bound=lower_bound, ctx=ctx)
    q, k, v, a, b, gk = tensors.values()
    _, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    local = ctx.local
    sd = _state_dtype(q.dtype)
    options = dict(scale=scale, output_final_state=True, safe_gate=safe_gate,
                   chunk_size=chunk_size, lower_bound=lower_bound)

    h0 = None
    if initial_state is not None:
        h0 = _rows(initial_state, local.initial_index, local.initial_mask)
    carry = ctx.plan.carry_in > 0
    L = local.carry_tokens.shape[0]
    data = (q, k, a, b, gk)
    if carry and K == V:
        # one call: the share's pieces, then the carry-in piece again with v = 0 and h0 = I
        q2, k2, a2, b2, gk2 = (torch.cat([x, x.narrow(1, 0, L)], dim=1) for x in data)
        v2 = torch.cat([v, v.new_zeros(1, L, H, V)], dim=1)
        eye = torch.eye(K, dtype=sd if h0 is None else h0.dtype, device=q.device)
        if h0 is None:
            h0 = eye.new_zeros(local.initial_index.shape[0], H, K, V)
        o_all, ends_all = chunk_dplr_delta_rule(
            q2, k2, v2, a2, b2, gk2, initial_state=torch.cat([h0, eye.expand(1, H, K, K)]),
            cu_seqlens=local.carry_cu_seqlens, cu_seqlens_cpu=local.carry_cu_seqlens_cpu,
            **options)
        o_zero, o_carry = o_all[:, :T], o_all[:, T:]
        ends, m_carry = ends_all[:-1], ends_all[-1:]
    else:
        o_zero, ends = chunk_dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0,
                                             cu_seqlens=local.cu_seqlens,
                                             cu_seqlens_cpu=local.cu_seqlens_cpu, **options)
        if carry:
            qc, kc, ac, bc, gkc = (x.narrow(1, 0, L) for x in data)
            eye = torch.eye(K, dtype=sd, device=q.device).expand(1, H, K, K)
            o_carry, m_carry = chunk_dplr_delta_rule(qc, kc, q.new_zeros(1, L, H, K), ac, bc, gkc,
                                                     initial_state=eye, **options)

    if not ctx.needs_exchange:
        o, rows = o_zero, ends
    else:
        if not carry:
            o_carry = q.new_zeros(1, 0, H, K)
            m_carry = ends.new_zeros(1, H, K, K)
        c_carry = ends[:1] if carry else torch.zeros_like(ends[:1])
        record = _record(ends, m_carry, local, H, K)
        o, y, _, _ = torch.ops.dplr.cp_join(o_zero, o_carry, m_carry, c_carry, record,
                                            ctx.group_name, ctx.rank, ctx.world_size)
        rows = torch.cat([ends, y])
    if not output_final_state:
        return o, None
    return o, _rows(rows, local.final_index, local.final_mask)


def _record(ends, m_carry, local, H, K):
    """``[M | c]`` of the state leaving this rank's share (see :mod:`.plan`)."""
    offset = _rows(ends, local.record_piece, local.record_offset_mask)[0]
    choices = torch.stack([torch.zeros_like(m_carry[0]),
                           torch.eye(K, dtype=m_carry.dtype, device=m_carry.device).expand(H, K, K),
                           m_carry[0]])
    transition = choices.index_select(0, local.record_map)[0]
    return torch.cat([transition, offset], dim=-1)
