"""Which TileLang kernel runs an op call, and compiling a call's kernels before first use.

:func:`pipeline` maps the static facts of a call (chunk size, head dims, dtypes, declared gate
bound) to the six kernels (factory + config) of that configuration; :func:`kernel_for` returns
one of them compiled.  The first call that needs a kernel not yet in memory compiles every
kernel of the whole forward+backward pipeline at once, in parallel processes, with a progress
line per kernel on stderr (``TORCH_DPLR_QUIET=1`` silences it); later calls, other batch
sizes, lengths and varlen layouts reuse them (every size is symbolic in the kernels).  A kernel
that cannot be built leaves its op on the PyTorch kernel, with one warning.
:func:`precompile` compiles a configuration ahead of time.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import time
import warnings

import torch

_ready: set[tuple] = set()  # pipelines already compiled (or tried: failures are remembered)
_kernels: dict[tuple, object] = {}  # (op, configuration) -> kernel or None: per-call fast path
_MISSING = object()
_lock = threading.Lock()
_seconds_getting_kernels = [0.0]  # host time kernel_for spent compiling / loading kernels


def _csrc_tl():
    import csrc_tl  # deferred: importing TileLang costs ~2 s
    return csrc_tl


def _family(name: str):
    """The kernel module ``csrc_tl.<name>`` (one of ``csrc_tl.KERNEL_MODULES``)."""
    return importlib.import_module(f"csrc_tl.{name}")


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def pipeline(chunk_size: int, K: int, V: int, dtype: torch.dtype, gate_dtype: torch.dtype,
             lower_bound: float) -> dict[str, tuple]:
    """``{op name: (factory, config)}`` for the six kernels of one configuration."""
    intra_fwd, intra_bwd, wy_fwd, wy_bwd, state_fwd, state_bwd = map(
        _family, ("intra_fwd", "intra_bwd", "wy_fwd", "wy_bwd", "state_fwd", "state_bwd"))
    C, dt, gdt = chunk_size, _name(dtype), _name(gate_dtype)
    return {
        "intra_fwd": (intra_fwd.intra_fwd_kernel,
                      dict(C=C, K=K, dtype=dt, gate_dtype=gdt,
                           scheme=intra_fwd.scheme_for(C, lower_bound))),
        "intra_bwd": (intra_bwd.intra_bwd_kernel,
                      dict(C=C, K=K, dtype=dt, gk_dtype=gdt,
                           bounded=intra_bwd.select_scheme(C, dtype, lower_bound))),
        "wy_fwd": (wy_fwd.wy_fwd_kernel, dict(C=C, K=K, V=V, dtype=dt)),
        "wy_bwd": (wy_bwd.wy_bwd_kernel, dict(C=C, K=K, V=V, dtype=dt)),
        "state_fwd": (state_fwd.state_fwd_kernel, dict(C=C, K=K, V=V, dtype=dt)),
        "state_bwd": (state_bwd.state_bwd_kernel, dict(C=C, K=K, V=V, dtype=dt)),
    }


def _progress(line: str) -> None:
    if os.environ.get("TORCH_DPLR_QUIET") != "1":
        print(f"torch_dplr: {line}", file=sys.stderr, flush=True)


def precompile(chunk_size: int, K: int, V: int, dtype: torch.dtype,
               gate_dtype: torch.dtype = torch.float32, lower_bound: float = float("-inf"),
               workers: int | None = None) -> None:
    """Compile (or load from the disk cache) every kernel of one configuration."""
    key = (chunk_size, K, V, dtype, gate_dtype, lower_bound)
    with _lock:
        if key in _ready:
            return
        try:
            _csrc_tl().build_all(pipeline(*key).values(), workers=workers, progress=_progress)
        finally:  # a kernel that failed is remembered by the build layer, not retried here
            _ready.add(key)


def kernel_for(op: str, chunk_size: int, K: int, V: int, dtype: torch.dtype,
               gate_dtype: torch.dtype = torch.float32, lower_bound: float = float("-inf")):
    """The compiled kernel of ``op`` for this configuration, or None when it cannot be built
    here (no nvcc, a TileLang error): the op then runs its PyTorch kernel, after one warning.

    A kernel this process has not built yet brings its whole pipeline with it (compiled in
    parallel, see the module doc); WY and state ops, which don't see the gates, name the
    default gate configuration and find their kernel already built when the intra op of the
    same call ran first."""
    key = (chunk_size, K, V, dtype, gate_dtype, lower_bound)
    kernel = _kernels.get((op, key), _MISSING)
    if kernel is _MISSING:
        start = time.perf_counter()
        try:
            csrc_tl = _csrc_tl()
            factory, config = pipeline(*key)[op]
            if not csrc_tl.in_memory(factory, **config):
                try:
                    precompile(*key)
                except RuntimeError:
                    pass  # another kernel of the pipeline failed: this op may still have its own
            kernel = csrc_tl.build(factory, **config)
        except Exception as exc:  # noqa: BLE001 (any build failure: fall back, loudly once)
            warnings.warn(f"torch_dplr: the TileLang kernel {op} for chunk_size={chunk_size}, "
                          f"K={K}, V={V}, {dtype} could not be built ({type(exc).__name__}: "
                          f"{exc}); this op runs its PyTorch kernel instead", RuntimeWarning,
                          stacklevel=2)
            kernel = None
        _kernels[(op, key)] = kernel
        _seconds_getting_kernels[0] += time.perf_counter() - start
    return kernel


def seconds_getting_kernels() -> float:
    """Host seconds this process spent in :func:`kernel_for` compiling or loading kernels
    (TileLang import included): the kernel part of a first call (benchmarks.first_call)."""
    return _seconds_getting_kernels[0]
