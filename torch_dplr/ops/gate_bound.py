"""Exact results on the GPU when a chunk's decay leaves a fast scheme's range.

The TileLang kernels have faster schemes that factor every decay of a chunk through one centre
(``csrc_tl/intra_fwd.py``, ``csrc_tl/intra_bwd.py``, ``csrc_tl/fused_fwd.py``): their
exponents grow with the chunk's total decay.  A declared ``lower_bound`` caps it and licenses
them; the intra kernels also take them without a licence at chunks of 16 and 32 rows, where a
chunk leaves their range only under extreme gates (``torch_dplr.ops.kernels.intra_schemes``).
A gate below the declared bound, or an extreme gate, can push the exponents out of range, so
each op that runs such a scheme checks the chunks it computed, on the device and without a
host sync, and recomputes the ones past its range with the exact scheme:

* ``chunk_intra_fwd`` / ``chunk_intra_bwd``: a (chunk, head) is *breaking* when some column of
  its total decay ``gl`` (log2 units; the backward reads the forward's) is past the scheme's
  range (``-gl`` beyond :func:`csrc_tl.intra_fwd.centred_max_decay` or
  :func:`csrc_tl.intra_bwd.bounded_max_decay`).  After the fast kernel, the exact kernel's
  ``redo`` form runs over the same chunks and outputs: each of its CTAs reads the K chunk
  totals of ``csrc_tl.tile_macros.REDO_SPAN`` (8) chunks of a head at once and overwrites the
  outputs of the breaking ones with the exact scheme's, one after another.  Without a
  breaking chunk this costs one launch of ``chunks / 8`` CTAs per head (times the K blocks in
  the backward) that read 2 KB each and exit.
* ``chunk_fwd_fused``: the fused kernel flags each (sequence, head) with a breaking chunk; the
  per-token Triton kernel recomputes exactly those pairs (``csrc_triton/recurrent.py``).

Within the bound no chunk is ever breaking: ``-gl <= C |lower_bound| log2e``, which the
scheme's licence keeps in range.  Gates outside the documented ``gk <= 0`` are the caller's
bug: a NaN gate gives NaN in its own sequence and head only (the check is false for it, and
every scheme keeps heads and sequences apart); a positive gate is not detected and may give a
wrong or non-finite result on these paths.
"""
