"""Decoding many requests at once over a pool of states (``docs/serving.md``).

A serving engine keeps every live request's recurrent state in one tensor, the state pool
``[slots, H, K, V]`` (fp32; fp64 for fp64 data; or bf16 storage, which halves a decode step's
state traffic: the states are advanced in fp32 and rounded to bf16 once per call, see
``docs/serving.md`` for the error it adds), and gives each request a slot.  One call of
:func:`rwkv7_decode` / :func:`dplr_decode` advances a batch of requests with different
histories: it reads each request's state from its slot, runs its tokens (T = 1 decode, or a
few tokens) and writes the new state back into the same slot, **in place**.  It returns the
outputs only.

Contract:

- ``slot_indices``: int32 ``[N]`` on the pool's device, one distinct slot per request (N = B,
  or the sequence count with ``cu_seqlens``).  Slots not named are untouched.
- No autograd: the pool is updated in place (call under ``torch.no_grad()`` or
  ``torch.inference_mode()``; for a differentiable step use ``fused_recurrent_rwkv7`` with
  ``initial_state``).
- Checks on shapes, dtypes and devices always run.  Checks on values (each slot in range and
  named once, ``cu_seqlens`` well formed) read the indices on the host: they run eagerly, from
  ``slot_indices_cpu`` / ``cu_seqlens_cpu`` when given (no device sync), and are skipped while
  ``torch.compile`` traces or a CUDA graph is being captured, where the caller guarantees them
  (``check_values=False`` skips them too).  On CPU tensors the op itself re-checks the slots.
"""
from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers torch.ops.dplr)
from .api import _under_autocast
from .ops.decode import check_slot_values, pool_dtypes
from .ops.direct_call import call_op
from .reference.layout import check_cu_seqlens_values
from .validation import check_inputs

__all__ = ["dplr_decode", "rwkv7_decode", "new_state_pool"]


def new_state_pool(num_slots: int, num_heads: int, head_k_dim: int, head_v_dim: int | None = None,
                   *, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero state pool ``[num_slots, H, K, V]`` (zero is the state of an empty history);
    ``dtype=torch.bfloat16`` for the lower-precision storage."""
    V = head_k_dim if head_v_dim is None else head_v_dim
    return torch.zeros(num_slots, num_heads, head_k_dim, V, device=device, dtype=dtype)


def rwkv7_decode(r, w, k, v, a, b, state_pool, slot_indices, scale=1.0, cu_seqlens=None,
                 cu_seqlens_cpu=None, slot_indices_cpu=None, check_values=True):
    """RWKV-7 over the state pool: :func:`dplr_decode` with ``q=r, gk=w`` and ``scale=1``.

    ``a = -kk``, ``b = kk·iclr`` as for :func:`torch_dplr.chunk_rwkv7`.  Returns
    ``o [B, T, H, V]``; the requests' states are updated in ``state_pool``.
    """
    r, k, v, a, b = _under_autocast(dict(r=r, k=k, v=v, a=a, b=b)).values()
    names = dict(r=r, k=k, v=v, a=a, b=b, w=w)
    return _decode(names, "w", state_pool, slot_indices, scale, cu_seqlens, cu_seqlens_cpu,
                   slot_indices_cpu, check_values)


def dplr_decode(q, k, v, a, b, gk, state_pool, slot_indices, scale=None, cu_seqlens=None,
                cu_seqlens_cpu=None, slot_indices_cpu=None, check_values=True):
    """The DPLR recurrence for a batch of requests whose states live in ``state_pool``.

    Args:
        q, k, a, b: ``[B, T, H, K]``; v: ``[B, T, H, V]``; gk: ``[B, T, H, K]`` log-decay.
            Rect: B requests of T tokens each.  Varlen: ``B == 1`` and ``cu_seqlens``.
        state_pool: ``[slots, H, K, V]``, contiguous, in the state dtype (fp32; fp64 for
            fp64 data) or, but for fp64 data, bf16 storage, on the inputs' device.  Updated
            in place.
        slot_indices: int32 ``[N]``: request n's state lives in ``state_pool[slot_indices[n]]``.
        scale: defaults to ``K ** -0.5``.
        cu_seqlens: ``[N+1]`` offsets of the requests' tokens (``B == 1``).
        cu_seqlens_cpu, slot_indices_cpu: CPU copies, read by the value checks instead of the
            device tensors (no sync).
        check_values: run the value checks when they can run (eager, not capturing).

    Returns:
        ``o [B, T, H, V]`` in v's dtype.
    """
    q, k, v, a, b = _under_autocast(dict(q=q, k=k, v=v, a=a, b=b)).values()
    names = dict(q=q, k=k, v=v, a=a, b=b, gk=gk)
    return _decode(names, "gk", state_pool, slot_indices, scale, cu_seqlens, cu_seqlens_cpu,
                   slot_indices_cpu, check_values)


def _decode(tensors, gate, state_pool, slot_indices, scale, cu_seqlens, cu_seqlens_cpu,
            slot_indices_cpu, check_values):
    check_inputs(tensors, gate=gate, value="v", scale=scale, initial_state=None,
                 cu_seqlens=None, cu_seqlens_cpu=None)
    q, k, v, a, b, gk = tensors.values()
    first = next(iter(tensors))
    _refuse_grad(tensors, state_pool)
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu was given without cu_seqlens")
    N = q.shape[0] if cu_seqlens is None else _check_cu_seqlens_meta(cu_seqlens, q, first)
    _check_pool(state_pool, q, v, first)
    _check_slot_indices_meta(slot_indices, N, state_pool)
    if check_values and _host_checks_can_run(q):
        if cu_seqlens is not None:
            values = _host_copy(cu_seqlens, cu_seqlens_cpu, "cu_seqlens")
            check_cu_seqlens_values(tuple(values), q.shape[1])
        check_slot_values(_host_copy(slot_indices, slot_indices_cpu, "slot_indices"),
                          state_pool.shape[0])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    cu = cu_seqlens if cu_seqlens is not None else q.new_empty(0, dtype=torch.int64)
    return call_op(torch.ops.dplr.decode_pool, q, k, v, a, b, gk, state_pool, slot_indices, cu,
                   scale, mutated=state_pool)


def _refuse_grad(tensors, state_pool):
    if not torch.is_grad_enabled():
        return
    for name, x in (*tensors.items(), ("state_pool", state_pool)):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise ValueError(f"{name} requires grad, but decoding over the state pool updates it "
                             f"in place and has no backward: call it under torch.no_grad() or "
                             f"torch.inference_mode() (for a differentiable step use "
                             f"fused_recurrent_rwkv7 with initial_state)")


def _check_cu_seqlens_meta(cu, q, first) -> int:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, "
                         f"got shape {tuple(cu.shape)}")
    if cu.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu.device} but {first} is on {q.device}")
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (flatten the requests' "
                         f"tokens), got B={q.shape[0]}")
    return cu.shape[0] - 1


def _check_pool(pool, q, v, first):
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"state_pool must be a torch.Tensor, got {type(pool).__name__}")
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state_pool must have shape [slots, H, K, V] = [slots, {H}, {K}, {V}], "
                         f"got {tuple(pool.shape)}")
    allowed = pool_dtypes(q.dtype)
    if pool.dtype not in allowed:
        kinds = " or ".join(str(d) for d in allowed)
        raise TypeError(f"state_pool must be {kinds} for {q.dtype} inputs (the state dtype, "
                        f"or its bf16 storage), got {pool.dtype}")
    if pool.device != q.device:
        raise ValueError(f"state_pool is on {pool.device} but {first} is on {q.device}")
    if not pool.is_contiguous():
        raise ValueError("state_pool must be contiguous (it is updated in place)")


def _check_slot_indices_meta(slots, N, pool):
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"slot_indices must be a torch.Tensor, got {type(slots).__name__}")
    if slots.dtype != torch.int32:
        raise TypeError(f"slot_indices must be int32, got {slots.dtype}")
    if tuple(slots.shape) != (N,):
        raise ValueError(f"slot_indices must have shape [N] = [{N}] (one slot per request), "
                         f"got {tuple(slots.shape)}")
    if slots.device != pool.device:
        raise ValueError(f"slot_indices is on {slots.device} but state_pool is on {pool.device}")


def _host_checks_can_run(x) -> bool:
    """Value checks read tensors on the host: never while Dynamo traces (the values are not
    known) nor while a CUDA graph is captured (a sync would break the capture)."""
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _host_copy(x, cpu_copy, name) -> list:
    if cpu_copy is None:
        return x.tolist()
    if not isinstance(cpu_copy, torch.Tensor) or cpu_copy.device.type != "cpu" \
            or cpu_copy.shape != x.shape or cpu_copy.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}_cpu must be an integer CPU tensor with the shape of {name}")
    return cpu_copy.tolist()
