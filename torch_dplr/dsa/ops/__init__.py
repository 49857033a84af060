"""Registers every ``torch.ops.dsa.*`` operator (importing this package is enough)."""
from . import indexer, loss, sparse_mla, topk  # noqa: F401

# Forward ops in the order ``dsa_attention`` calls them; a checkpoint policy saves or
# recomputes each.  ``indexer_topk`` has no backward (integer output).
FORWARD_OPS = ("indexer_topk", "sparse_mla_fwd", "indexer_fwd", "indexer_loss_fwd")
BACKWARD_OPS = ("sparse_mla_bwd", "indexer_bwd", "indexer_loss_bwd")
