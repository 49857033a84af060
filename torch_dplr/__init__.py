"""torch_dplr: the DPLR delta rule (RWKV-7's attention) as torch.compile-first custom ops."""
from .api import (chunk_dplr_delta_rule, chunk_rwkv7, fused_recurrent_dplr_delta_rule,
                  fused_recurrent_rwkv7)
from . import cp, dsa, policies
from .rwkv7 import fused_mul_recurrent_rwkv7
from . import serving
from .serving import dplr_decode, new_state_pool, rwkv7_decode
from .fla_patch import patch_fla, unpatch_fla

__version__ = "0.1.0"
__all__ = ["chunk_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_dplr_delta_rule",
           "fused_recurrent_rwkv7", "fused_mul_recurrent_rwkv7", "dplr_decode", "rwkv7_decode",
           "new_state_pool", "patch_fla", "unpatch_fla", "cp", "dsa", "policies", "serving",
           "__version__"]
