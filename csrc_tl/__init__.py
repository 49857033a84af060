"""TileLang kernel sources for torch_dplr.

One module per kernel family; each exposes pure factories
``(static config) -> T.prim_func`` and a plain-PyTorch ``ref_program``.
:mod:`csrc_tl.compile` turns a factory plus config into a cached compiled
kernel for sm_90a. Nothing here dispatches on tensors or registers ops.
"""

from .compile import TARGET, build, build_all, canonical_dtype, clear_cache, in_memory, on_disk, trace

__all__ = ["TARGET", "KERNEL_MODULES", "DSA_KERNEL_MODULES", "build", "build_all",
           "canonical_dtype", "clear_cache", "every_variant", "in_memory", "on_disk", "trace"]

#: The kernel families; module ``csrc_tl.<name>`` has factory ``<name>_kernel`` and ``variants()``.
KERNEL_MODULES = ("intra_fwd", "intra_bwd", "wy_fwd", "wy_bwd", "state_fwd", "state_bwd", "fused_fwd",
                  "state_bwd_split")

#: The DSA op family's kernels (``torch_dplr.dsa``), same conventions. A list of their own, so
#: the DPLR dispatch and its compile test never build them (``every_variant(DSA_KERNEL_MODULES)``
#: lists their variants; ``torch_dplr/dsa/ops`` runs them; ``python -m torch_dplr precompile``
#: builds both lists unless told one family).
DSA_KERNEL_MODULES = ("dsa_sparse_mla_fwd", "dsa_sparse_mla_fwd_ws", "dsa_sparse_mla_bwd",
                      "dsa_indexer_topk", "dsa_indexer_fwd", "dsa_indexer_bwd",
                      "dsa_indexer_loss")


def every_variant(names=KERNEL_MODULES):
    """``(factory, config)`` for every variant of the named kernel families (imported lazily)."""
    import importlib

    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        factory = getattr(module, f"{name}_kernel")
        for config in module.variants():
            yield factory, config
