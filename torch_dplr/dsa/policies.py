"""Save-versus-recompute for DSA as selective-activation-checkpoint policies.

Use with ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, context_fn=...)``,
eagerly or inside ``torch.compile`` (compile the checkpointed function, not the reverse)::

    from torch.utils.checkpoint import checkpoint
    import torch_dplr

    ctx_fn = torch_dplr.dsa.policies.context_fn("recompute_indexer")
    y, indexer_loss = checkpoint(layer, x, use_reentrant=False, context_fn=ctx_fn)

Shipped policies (``POLICIES``) name the ``dsa`` forward ops whose outputs are kept; every
other ``dsa`` forward op in the checkpointed region runs again in the backward:

- ``"recompute_all"``: keep nothing but the region's inputs.
- ``"recompute_indexer"``: keep the sparse attention (``o``, ``lse``) and the loss's target;
  recompute the indexer (top-k selection and selected scores).  The indexer costs about
  ``T² · H_idx · D_idx`` multiply-adds per sequence (half that, causal), the sparse attention
  ``T · topk · H · (D_qk + d_v)``: at DeepSeek-V3.2's sizes the indexer is the cheaper one to
  rerun below ~70k tokens per sequence.  Frees the ``[T, topk]`` indices and scores.
- ``"save_indexer"``: keep the top-k indices and selected scores (the indexer never reruns),
  recompute the sparse attention and the loss's target.  Frees ``o [T, H, d_v]``.
- ``"save_all"``: keep every ``dsa`` op; only the region's other ops are recomputed.

Ops outside the ``dsa`` namespace are recomputed unless listed in ``extra_save_ops`` (for
example ``torch.ops.aten.mm.default`` to keep projections).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..checkpoint_policy import PolicySet
from . import ops

dsa = torch.ops.dsa
FORWARD_OPS = frozenset(getattr(dsa, name).default for name in ops.FORWARD_OPS)
INDEXER_OPS = frozenset({dsa.indexer_topk.default, dsa.indexer_fwd.default})

POLICIES: dict[str, frozenset] = {
    "recompute_all": frozenset(),
    "recompute_indexer": FORWARD_OPS - INDEXER_OPS,
    "save_indexer": INDEXER_OPS,
    "save_all": FORWARD_OPS,
}

_SET = PolicySet("dsa", FORWARD_OPS, POLICIES, example="torch.ops.dsa.sparse_mla_fwd")


def recomputed_ops(policy) -> frozenset:
    """The ``dsa`` forward ops a policy recomputes in the backward."""
    return _SET.recomputed_ops(policy)


def policy_fn(policy="recompute_indexer", extra_save_ops: Iterable = ()) -> Callable:
    """The per-op decision function for ``create_selective_checkpoint_contexts``."""
    return _SET.policy_fn(policy, extra_save_ops)


def context_fn(policy="recompute_indexer", extra_save_ops: Iterable = ()) -> Callable:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    ``policy`` is a name from ``POLICIES`` or an iterable of ``dsa`` op overloads to keep.
    """
    return _SET.context_fn(policy, extra_save_ops)
