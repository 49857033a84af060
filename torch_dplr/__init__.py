"""torch_dplr: the DPLR delta rule (RWKV-7's attention) as torch.compile-first custom ops."""
from .api import (chunk_dplr_delta_rule, chunk_rwkv7, fused_recurrent_dplr_delta_rule,
                  fused_recurrent_rwkv7)
from . import policies

__version__ = "0.1.0"
__all__ = ["chunk_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_dplr_delta_rule",
           "fused_recurrent_rwkv7", "policies", "__version__"]
