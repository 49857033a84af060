"""Exact results on the GPU when gates break a declared ``lower_bound``.

A declared bound lets the TileLang kernels take a faster scheme that factors every decay of a
chunk through one centre (``csrc_tl/intra_fwd.py``, ``csrc_tl/intra_bwd.py``): its exponents
grow with the chunk's total decay, which the bound caps.  A gate below the bound can push them
out of range, so each op that runs such a scheme checks the chunks it computed, on the device
and without a host sync, and recomputes the ones that break the bound with the exact scheme:

* ``chunk_intra_fwd`` / ``chunk_intra_bwd``: from the chunk totals ``gl`` (log2 units, one row
  per chunk slot; the backward gets the forward's), a slot is *breaking* when some head and
  column decays by more than the scheme's range (``-gl`` past :func:`csrc_tl.intra_fwd.
  centred_max_decay` or :func:`csrc_tl.intra_bwd.bounded_max_decay`).  The exact kernel then
  runs over the same slots with the length of every other slot set to 0 (such a slot writes
  nothing but its ``gl`` row, which goes to a scratch buffer), overwriting the breaking slots'
  outputs.  Without a breaking slot this costs one reduction over ``gl`` and one launch whose
  CTAs exit at once.
* ``chunk_fwd_fused``: the fused kernel flags each (sequence, head) with a breaking chunk; the
  per-token Triton kernel recomputes exactly those pairs (``csrc_triton/recurrent.py``).

Within the bound no slot is ever breaking: ``-gl <= C |lower_bound| log2e``, which the
scheme's licence keeps in range.  Gates outside the documented ``gk <= 0`` are the caller's
bug: a NaN gate gives NaN in its own sequence and head only (the check is false for it, and
every scheme keeps heads and sequences apart); a positive gate is not detected and may give a
wrong or non-finite result on these paths.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .varlen import KernelTables
from .varlen import as_one_sequence_list as flat


def breaking_slots(gl: Tensor, max_decay: float) -> Tensor:
    """bool ``[slots]`` of the flattened chunk totals ``gl`` ``[B, slots, H, K]``: some head
    and column decays by more than ``2^-max_decay`` over the chunk."""
    return (flat(gl)[0] < -max_decay).flatten(1).any(1)


def only_slots(tables: KernelTables, slots: Tensor) -> KernelTables:
    """``tables`` with every slot but ``slots`` emptied (length 0)."""
    return tables._replace(chunk_len=torch.where(slots, tables.chunk_len, 0))
