"""flash-linear-attention's two routes, both in one process.

FLA 0.6.0 dispatches ``chunk_dplr_delta_rule`` (which its ``chunk_rwkv7`` calls) through
``fla.backends``: on every call the dispatch wrapper asks each registered backend
``is_enabled()``, which reads ``os.environ["FLA_TILELANG"]`` then and there (not at import).
So setting the variable around a call picks the route per call: ``"0"`` forces the Triton
kernels, ``"1"`` lets the TileLang backend take the call.  The route is fixed at the forward
call: its autograd node runs the matching backward whatever the variable says later.

The TileLang backend may refuse a call: its verifier rejects configs (chunk 64 on sm_90, small
grids, unbounded gates, ...) and the dispatch then runs Triton silently apart from a one-time
log line; a kernel that fails to build or launch also falls back to Triton.
:meth:`FLA.tilelang_refusal` asks the verifier directly and makes one direct call to the
backend's implementation (which has no fallback), so each cell can record
``fla_tilelang_fallback`` with the reason instead of timing Triton twice.
"""
from __future__ import annotations

import contextlib
import os

from .envvars import scoped_env

ROUTES = ("triton", "tilelang")
ENV = "FLA_TILELANG"


class FLA:
    """The FLA entry points; raises ImportError (with the reason) when FLA is missing."""

    def __init__(self):
        # Autotune results go to Triton's cache dir (FLA passes cache_results=True), so the
        # shipped autotune cache is read; this also caches any other autotuner.
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        import fla
        from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
        from fla.ops.rwkv7 import chunk_rwkv7
        self.version = getattr(fla, "__version__", "?")
        self.entries = {"chunk_rwkv7": chunk_rwkv7, "chunk_dplr_delta_rule": chunk_dplr_delta_rule}
        try:
            from fla.ops.generalized_delta_rule.dplr.backends.tilelang import DPLRTileLangBackend
            from fla.ops.generalized_delta_rule.dplr.backends.tilelang.chunk import (
                chunk_dplr_delta_rule_tilelang)
            self._backend, self._direct = DPLRTileLangBackend, chunk_dplr_delta_rule_tilelang
        except Exception as exc:  # noqa: BLE001  (no TileLang, or a different FLA layout)
            self._backend, self._direct = None, None
            self._backend_error = f"{type(exc).__name__}: {exc}"

    @staticmethod
    @contextlib.contextmanager
    def route(name: str):
        """Run the block on FLA's Triton kernels (``"triton"``) or let TileLang take it."""
        if name not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {name!r}")
        with scoped_env(ENV, "1" if name == "tilelang" else "0"):
            yield

    def tilelang_refusal(self, call_forward) -> str | None:
        """Why FLA's TileLang backend would not run this call (None: it does).

        ``call_forward(fn)`` calls ``fn(q, k, v, a, b, gk, **kwargs)`` in the dplr argument
        order with the cell's arguments and grad mode.
        """
        if self._backend is None:
            return f"TileLang backend not importable ({self._backend_error})"
        if not self._backend.is_available():
            return "TileLang backend unavailable (tilelang or nvcc missing)"
        verifier = self._backend().chunk_dplr_delta_rule_verifier
        accepted, reason = call_forward(lambda *args, **kwargs: verifier(*args, **kwargs))
        if not accepted:
            return f"verifier: {reason}"
        try:
            call_forward(self._direct)
        except Exception as exc:  # noqa: BLE001  (the dispatch would fall back to Triton)
            return f"runtime: {type(exc).__name__}: {exc}"
        return None
