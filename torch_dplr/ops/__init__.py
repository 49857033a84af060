"""Registers every ``torch.ops.dplr.*`` operator (importing this package is enough)."""
from . import intra, recurrent, state, wy  # noqa: F401

FORWARD_OPS = ("chunk_intra_fwd", "chunk_wy_fwd", "chunk_state_fwd", "recurrent_fwd")
BACKWARD_OPS = ("chunk_intra_bwd", "chunk_wy_bwd", "chunk_state_bwd", "recurrent_bwd")
