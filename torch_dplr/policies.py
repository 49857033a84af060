"""Save-versus-recompute as selective-activation-checkpoint policies (DESIGN.md §3).

Use with ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, context_fn=...)``,
eagerly or inside ``torch.compile`` (compile the checkpointed function, not the reverse)::

    from torch.utils.checkpoint import checkpoint
    import torch_dplr

    ctx_fn = torch_dplr.policies.context_fn("save_state")
    y = checkpoint(block, x, use_reentrant=False, context_fn=ctx_fn)

Shipped policies (``POLICIES``) name the ``dplr`` forward ops whose outputs are kept; every
other ``dplr`` forward op in the checkpointed region is recomputed in the backward:

- ``"recompute_all"``: keep nothing but the region's inputs; every stage (or ``chunk_fwd``)
  runs again.
  (Every policy keeps the call's chunk tables, ``dplr::chunk_tables``: a few KB.)
- ``"save_state"``: keep the state pass (o, per-chunk states, v_new), recompute the cheap
  intra-chunk and WY stages (FLA's default recompute trade).  In the two-op training pass
  (``TORCH_DPLR_TRAINING_PASS=split``) keep ``chunk_fwd``'s outputs: its backward recomputes
  the chunk-local terms either way (on the TileLang stage kernels the whole forward, the
  states included; the Triton split kernels start from the kept states).
- ``"save_all"``: keep every stage; only the non-``dplr`` ops of the region are recomputed.

Ops outside the ``dplr`` namespace are recomputed unless listed in ``extra_save_ops``
(for example ``torch.ops.aten.mm.default`` to keep projections, as torchtitan does).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from . import ops
from .checkpoint_policy import PolicySet

FORWARD_OPS = frozenset(getattr(torch.ops.dplr, name).default for name in ops.FORWARD_OPS)

POLICIES: dict[str, frozenset] = {
    "recompute_all": frozenset(),
    "save_state": frozenset({torch.ops.dplr.chunk_state_fwd.default,
                             torch.ops.dplr.chunk_fwd.default}),
    "save_all": FORWARD_OPS,
}

# Kept under every policy: the call's chunk tables (a few KB of int32), cheaper to keep than to
# rebuild in the backward.
ALWAYS_SAVED = frozenset({torch.ops.dplr.chunk_tables.default})

_SET = PolicySet("dplr", FORWARD_OPS, POLICIES, ALWAYS_SAVED,
                 example="torch.ops.dplr.chunk_state_fwd")


def recomputed_ops(policy) -> frozenset:
    """The ``dplr`` forward ops a policy recomputes in the backward."""
    return _SET.recomputed_ops(policy)


def policy_fn(policy="save_state", extra_save_ops: Iterable = ()) -> Callable:
    """The per-op decision function for ``create_selective_checkpoint_contexts``."""
    return _SET.policy_fn(policy, extra_save_ops)


def context_fn(policy="save_state", extra_save_ops: Iterable = ()) -> Callable:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    ``policy`` is a name from ``POLICIES`` or an iterable of ``dplr`` op overloads to keep.
    """
    return _SET.context_fn(policy, extra_save_ops)
