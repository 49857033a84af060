"""Context parallelism: one packed token sequence split across the ranks of a process group.

::

    ctx = torch_dplr.cp.build_context(group, cu_seqlens)       # the global layout
    o, ht = torch_dplr.chunk_rwkv7(ctx.shard(r), ctx.shard(w), ..., cp_context=ctx)

Each rank passes its contiguous share of the tokens and gets its share of the single-process
result; see ``docs/context_parallel.md``.
"""
from . import chunk  # noqa: F401  (registers dplr::cp_join / dplr::cp_join_bwd)
from .context import CPContext, build_context
from .plan import even_shares

__all__ = ["CPContext", "build_context", "even_shares"]
