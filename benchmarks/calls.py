"""What one timed call does, identically for torch_dplr and FLA.

Both libraries get the same tensors and the same FLA-style arguments: RWKV-7 gates go through
``chunk_rwkv7(r, w, k, v, a, b, scale=1.0, lower_bound=RWKV7_BOUND)``, unbounded gates through
``chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=D**-0.5)`` with no bound.  A forward step runs
under ``torch.no_grad()``; a forward+backward step is ``torch.autograd.grad`` of ``o`` (and the
final state, with ``state``) against random cotangents, for every input including the initial
state, so no ``.grad`` accumulates between reps.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from torch_dplr.testing import RWKV7_BOUND

from .cells import Cell
from .inputs import Inputs

ENTRY = {"rwkv7": "chunk_rwkv7", "unbounded": "chunk_dplr_delta_rule"}


def call_kwargs(cell: Cell, tensors: Inputs) -> dict:
    """The FLA-style keyword arguments of a cell (``tensors``: the inputs or their leaves)."""
    rwkv7 = cell.gates == "rwkv7"
    return dict(scale=1.0 if rwkv7 else cell.shape.D ** -0.5,
                initial_state=tensors.h0 if cell.state else None, output_final_state=cell.state,
                cu_seqlens=tensors.cu_seqlens, cu_seqlens_cpu=tensors.cu_seqlens_cpu,
                chunk_size=cell.chunk_size, lower_bound=RWKV7_BOUND if rwkv7 else None)


def in_dplr_order(entry_name: str, fn: Callable) -> Callable:
    """``fn`` called as ``(q, k, v, a, b, gk, **kw)`` whatever its own argument order."""
    if entry_name == "chunk_rwkv7":
        return lambda q, k, v, a, b, gk, **kw: fn(q, gk, k, v, a, b, **kw)
    return fn


def caller(tensors: Inputs, kwargs: dict, grad: bool) -> Callable:
    """``call(f)``: ``f(q, k, v, a, b, gk, **kwargs)`` on the tensors, grad on or off."""
    def call(f):
        with torch.set_grad_enabled(grad):
            return f(tensors.q, tensors.k, tensors.v, tensors.a, tensors.b, tensors.gk, **kwargs)
    return call


def fwd_step(fn: Callable, inp: Inputs, kwargs: dict) -> Callable[[], None]:
    """A no-grad forward (outputs dropped at once)."""
    call = caller(inp, kwargs, grad=False)

    def step():
        call(fn)
    return step


def fwd_bwd_step(fn: Callable, leaves: Inputs, kwargs: dict,
                 context_fn: Callable | None = None) -> Callable[[], None]:
    """Forward+backward; with ``context_fn`` the call runs under non-reentrant checkpointing."""
    state = kwargs["output_final_state"]
    args = (leaves.q, leaves.k, leaves.v, leaves.a, leaves.b, leaves.gk, kwargs["initial_state"])
    wrt = list(args[:6]) + ([leaves.h0] if state else [])

    def region(q, k, v, a, b, gk, h0):
        return fn(q, k, v, a, b, gk, **dict(kwargs, initial_state=h0))

    def step():
        if context_fn is None:
            o, ht = region(*args)
        else:
            o, ht = checkpoint(region, *args, use_reentrant=False, context_fn=context_fn)
        outs, cotangents = ([o, ht], [leaves.do, leaves.dht]) if state else ([o], [leaves.do])
        torch.autograd.grad(outs, wrt, cotangents)
    return step
