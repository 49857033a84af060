"""TileLang kernel sources for torch_dplr.

One module per kernel family; each exposes pure factories
``(static config) -> T.prim_func`` and a plain-PyTorch ``ref_program``.
:mod:`csrc_tl.compile` turns a factory plus config into a cached compiled
kernel for sm_90a. Nothing here dispatches on tensors or registers ops.
"""

from .compile import TARGET, build, build_all, canonical_dtype, clear_cache, in_memory, on_disk, trace

__all__ = ["TARGET", "build", "build_all", "canonical_dtype", "clear_cache", "in_memory", "on_disk",
           "trace"]
