"""Registers every ``torch.ops.dplr.*`` operator (importing this package is enough)."""
from . import dataflow, fused, intra, recurrent, state, varlen, wy  # noqa: F401
from . import decode  # noqa: F401

# The chunked training pass is either the stage ops (intra, WY, state) or the two ops of
# torch_dplr.ops.dataflow (chunk_fwd / chunk_bwd); the per-token pass is recurrent_fwd / _bwd.
FORWARD_OPS = ("chunk_intra_fwd", "chunk_wy_fwd", "chunk_state_fwd", "chunk_fwd",
               "recurrent_fwd")
BACKWARD_OPS = ("chunk_intra_bwd", "chunk_wy_bwd", "chunk_state_bwd", "chunk_bwd",
                "recurrent_bwd")
# Forward ops for calls that need no gradient: not differentiable, so outside the
# checkpoint policies' FORWARD_OPS (a no-grad graph has nothing to save or recompute).
NO_GRAD_OPS = ("chunk_fwd_fused",)
# The kernels' chunk tables of a call (integer in and out, built once, read by every stage op).
TABLE_OPS = ("chunk_tables",)
# Serving: advances requests whose states live in a pool, in place (no autograd, no policy).
SERVING_OPS = ("decode_pool",)
