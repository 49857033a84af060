"""Which TileLang kernel runs an op call, and compiling a call's kernels before first use.

:func:`pipeline` maps the static facts of a call (chunk size, head dims, dtypes, declared gate
bound) to the kernels (factory + config) of that configuration: the six stage kernels, the two
kernels of the small-grid state backward, and the fused no-grad forward where it is built
(:func:`_fused_fwd_built`); :func:`kernel_for` returns one of them compiled.  The first call
that needs a stage kernel neither in memory nor on disk compiles the six stage kernels of the
whole forward+backward pipeline at once, in parallel processes, with a progress line per kernel
on stderr (``TORCH_DPLR_QUIET=1`` silences it).  The small-grid state backward's two kernels,
which only some batch sizes and layouts run, then compile in a background thread
(:data:`BACKGROUND`), so the first call does not wait for them and a later call at another size
compiles nothing (one that comes within those seconds waits for them).  The fused no-grad
forward is compiled when a call first needs it (:data:`ON_DEMAND`: training never runs it).
Every kernel is loaded by the op that runs it, when it first runs.  Later calls, other batch
sizes, lengths and varlen layouts reuse them (every size is symbolic in the kernels).  A kernel
that cannot be built leaves its op on the PyTorch kernel (the fused forward: on the stage
kernels; the small-grid state backward: on the single state backward kernel), with one
warning.  :func:`precompile` compiles a configuration ahead of time.
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

_ready: set[tuple] = set()  # kernel groups already compiled (or tried: failures are remembered)
_group_locks: dict[tuple, threading.Lock] = {}  # one per kernel group: compiled once, others wait
_background: list[threading.Thread] = []  # BACKGROUND compiles started by this process
_background_started: set[tuple] = set()  # configurations whose BACKGROUND kernels were looked at
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


def _fused_fwd_built(chunk_size: int, K: int, V: int, dtype: torch.dtype,
                    lower_bound: float) -> bool:
    """Whether ``csrc_tl.fused_fwd`` has a variant for this configuration: its chunk size and
    head dims, bf16/fp16 data, and a declared gate bound that licenses the centred scheme."""
    fused, intra_fwd = _family("fused_fwd"), _family("intra_fwd")
    return (chunk_size in fused.CHUNK_SIZES and K == V and K in fused.HEAD_DIMS
            and _name(dtype) in fused.DTYPES and intra_fwd.centred_is_safe(chunk_size, lower_bound))


# Chunk sizes at which the intra kernels take their centred schemes for any gates, not only
# where a declared lower bound licenses them.  Each op checks its chunks on the device and
# recomputes exactly the ones whose decay left the schemes' range (ops/gate_bound.py): at
# these sizes a chunk leaves it only when a column's gates average below -138/C nats over the
# whole chunk (-4.3 at C = 32: 1.4% of the state kept per token), while the exact tiled scheme
# alone costs 3-5x the centred one.  At C = 64 the limit is -2.2 a token, which heavy-
# tailed gates cross in most chunks (each would then pay both schemes): there the tiled scheme
# runs unless a declared bound licenses the centred one.
CHECKED_CENTRED_CHUNKS = (16, 32)


def intra_schemes(chunk_size: int, dtype: torch.dtype, lower_bound: float) -> tuple[str, bool]:
    """``(scheme, bounded)``: the intra forward's and backward's scheme options for a
    configuration (``csrc_tl.intra_fwd.intra_fwd_kernel``, ``csrc_tl.intra_bwd.
    intra_bwd_kernel``).  A fast scheme that no declared bound licenses is checked chunk by
    chunk like a licensed one (:data:`CHECKED_CENTRED_CHUNKS`); fp16's backward keeps the exact
    scheme then (its operands hold exponents up to 8: a chunk's decay up to 16, in log2)."""
    intra_fwd, intra_bwd = _family("intra_fwd"), _family("intra_bwd")
    scheme = intra_fwd.scheme_for(chunk_size, lower_bound)
    bounded = intra_bwd.select_scheme(chunk_size, dtype, lower_bound)
    if chunk_size in CHECKED_CENTRED_CHUNKS:
        scheme = "centred"
        bounded = bounded or dtype == torch.bfloat16
    return scheme, bounded


@functools.lru_cache(maxsize=None)
def pipeline(chunk_size: int, K: int, V: int, dtype: torch.dtype, gate_dtype: torch.dtype,
             lower_bound: float) -> dict[str, tuple]:
    """``{kernel name: (factory, config)}`` for the six stage kernels of one configuration
    (named after their ops), the small-grid state backward's ``"state_bwd_dh"`` and
    ``"state_bwd_grads"``, ``"intra_fwd_exact"`` / ``"intra_bwd_exact"`` where an intra op
    takes a faster scheme (:func:`intra_schemes`; the exact one recomputes the chunks that
    leave its range),
    and ``"fused_fwd"`` where it is built (the gate dtype must then be fp32 or ``dtype``)."""
    intra_fwd, intra_bwd, wy_fwd, wy_bwd, state_fwd, state_bwd, state_bwd_split = map(
        _family, ("intra_fwd", "intra_bwd", "wy_fwd", "wy_bwd", "state_fwd", "state_bwd",
                  "state_bwd_split"))
    C, dt, gdt = chunk_size, _name(dtype), _name(gate_dtype)
    scheme, bounded = intra_schemes(C, dtype, lower_bound)
    kernels = {
        "intra_fwd": (intra_fwd.intra_fwd_kernel,
                      dict(C=C, K=K, dtype=dt, gate_dtype=gdt, scheme=scheme)),
        "intra_bwd": (intra_bwd.intra_bwd_kernel,
                      dict(C=C, K=K, dtype=dt, gk_dtype=gdt, bounded=bounded)),
        "wy_fwd": (wy_fwd.wy_fwd_kernel, dict(C=C, K=K, V=V, dtype=dt)),
        "wy_bwd": (wy_bwd.wy_bwd_kernel, dict(C=C, K=K, V=V, dtype=dt)),
        "state_fwd": (state_fwd.state_fwd_kernel, dict(C=C, K=K, V=V, dtype=dt)),
        "state_bwd": (state_bwd.state_bwd_kernel, dict(C=C, K=K, V=V, dtype=dt)),
        # chunk_state_bwd on grids of at most SMs/4 (sequence, head) pairs (ops/state.py)
        "state_bwd_dh": (state_bwd_split.state_bwd_split_kernel,
                         dict(C=C, K=K, V=V, dtype=dt, stage="dh")),
        "state_bwd_grads": (state_bwd_split.state_bwd_split_kernel,
                            dict(C=C, K=K, V=V, dtype=dt, stage="grads")),
    }
    # the exact schemes, for the chunks past the fast schemes' range (ops/gate_bound.py)
    if kernels["intra_fwd"][1]["scheme"] != "tiled":
        kernels["intra_fwd_exact"] = (intra_fwd.intra_fwd_kernel,
                                      dict(kernels["intra_fwd"][1], scheme="tiled", redo=True))
    if kernels["intra_bwd"][1]["bounded"]:
        kernels["intra_bwd_exact"] = (intra_bwd.intra_bwd_kernel,
                                      dict(kernels["intra_bwd"][1], bounded=False, redo=True))
    if _fused_fwd_built(C, K, V, dtype, lower_bound) and gdt in ("float32", dt):
        kernels["fused_fwd"] = (_family("fused_fwd").fused_fwd_kernel,
                                dict(C=C, K=K, V=V, dtype=dt, gate_dtype=gdt))
    return kernels


def _progress(line: str) -> None:
    if os.environ.get("TORCH_DPLR_QUIET") != "1":
        print(f"torch_dplr: {line}", file=sys.stderr, flush=True)


# The small-grid state backward compiles in a background thread once a call has its stage
# kernels: few calls run it, but which do depends on the batch size and layout, and a new size
# must compile nothing; compiled with the stage kernels it made the cold first call 31.7 s
# against 28.4 s on the H200.  Kernels compiled when a call first needs them rather than
# with the stage kernels (ON_DEMAND): the fused no-grad forward (training never runs it), and
# the small-grid state backward when its background compile has not run or not finished.
BACKGROUND = ("state_bwd_dh", "state_bwd_grads")
ON_DEMAND = (("fused_fwd",), BACKGROUND)
# The kernels that depend on the gates (dtype, bound).  The other ops name the default gates
# when they ask for a kernel (they don't see the gates), so they must never bring these along.
GATE_KERNELS = ("intra_fwd", "intra_bwd", "intra_fwd_exact", "intra_bwd_exact")


def forget_gate_kernel_choices() -> None:
    """Drop the cached choices of the gate kernels (the pipelines and the per-call fast path),
    so the next calls select them again, e.g. after :data:`CHECKED_CENTRED_CHUNKS` changed.
    Compiled kernels stay compiled."""
    pipeline.cache_clear()
    for key in [key for key in _kernels if key[0] in GATE_KERNELS]:
        del _kernels[key]


def _group_id(kernels: dict, ops) -> tuple:
    # a group is the kernels it builds: the same split kernels asked for under two gate
    # configurations (they don't depend on the gates) are one group, compiled once
    return tuple(sorted((op, tuple(sorted(kernels[op][1].items()))) for op in ops if op in kernels))


def precompile(chunk_size: int, K: int, V: int, dtype: torch.dtype,
               gate_dtype: torch.dtype = torch.float32, lower_bound: float = float("-inf"),
               workers: int | None = None, ops=None) -> None:
    """Compile the kernels of one configuration (``ops``: those ops only; default every one)
    that are not in the disk cache yet, in parallel.  None is loaded here: each op loads its
    own kernel when it first runs.  A group being compiled by another thread is waited for."""
    kernels = pipeline(chunk_size, K, V, dtype, gate_dtype, lower_bound)
    group = _group_id(kernels, kernels if ops is None else ops)
    with _lock:
        group_lock = _group_locks.setdefault(group, threading.Lock())
    with group_lock:
        if group in _ready:
            return
        try:
            _csrc_tl().build_all([kernels[op] for op, _ in group], workers=workers,
                                 progress=_progress, load=False)
        finally:  # a kernel that failed is remembered by the build layer, not retried here
            _ready.add(group)


def _compile_in_background(key: tuple, kernels: dict) -> None:
    """Start compiling the :data:`BACKGROUND` kernels of ``kernels`` that are not on disk."""
    csrc_tl = _csrc_tl()
    ops = tuple(op for op in BACKGROUND if op in kernels and not _built(csrc_tl, *kernels[op]))
    if not ops:
        return

    def compile_quietly():
        try:
            precompile(*key, ops=ops)
        except RuntimeError:
            pass  # remembered by the build layer: the op warns and falls back when it asks

    thread = threading.Thread(target=compile_quietly, name="torch_dplr-compile", daemon=True)
    thread.start()
    _background.append(thread)


def _built(csrc_tl, factory, config) -> bool:
    return csrc_tl.in_memory(factory, **config) or csrc_tl.on_disk(factory, **config)


def wait_for_background_compiles() -> None:
    """Block until the kernels this process compiles in the background are done (tests)."""
    for thread in list(_background):
        thread.join()


# what runs instead when a kernel that is not a stage op's own cannot be built (the warning says it)
_FALLBACK = {"fused_fwd": "the stage kernels run",
             "state_bwd_dh": "the single state backward kernel runs",
             "state_bwd_grads": "the single state backward kernel runs"}


def _group_of(op: str, kernels: dict) -> tuple[str, ...]:
    """The kernels compiled together with ``op`` on first use: its :data:`ON_DEMAND` group, or
    else the stage kernels of the forward+backward (a training step needs them all), less the
    gate kernels when ``op`` is not one of them (its ``kernels`` are those of the default
    gates, not the call's)."""
    for group in ON_DEMAND:
        if op in group:
            return tuple(name for name in group if name in kernels)
    skip = {name for group in ON_DEMAND for name in group}
    if op not in GATE_KERNELS:
        skip.update(GATE_KERNELS)
    return tuple(name for name in kernels if name not in skip)


def kernel_for(op: str, chunk_size: int, K: int, V: int, dtype: torch.dtype,
               gate_dtype: torch.dtype = torch.float32, lower_bound: float = float("-inf")):
    """The compiled kernel of ``op`` for this configuration, or None when it cannot be built
    here (no nvcc, a TileLang error): the op then runs its PyTorch kernel, after one warning.

    A kernel neither in memory nor compiled on disk brings its group with it (compiled in
    parallel, see the module doc and :func:`_group_of`); WY and state ops, which don't see the
    gates, name the default gate configuration and find their kernel already compiled when the
    intra op of the same call ran first (so they must not compile that default configuration's
    gate kernels)."""
    key = (chunk_size, K, V, dtype, gate_dtype, lower_bound)
    kernel = _kernels.get((op, key), _MISSING)
    if kernel is _MISSING:
        start = time.perf_counter()
        try:
            csrc_tl = _csrc_tl()
            kernels = pipeline(*key)
            factory, config = kernels[op]
            if not _built(csrc_tl, factory, config):
                try:
                    precompile(*key, ops=_group_of(op, kernels))
                except RuntimeError:
                    pass  # another kernel of the pipeline failed: this op may still have its own
            kernel = csrc_tl.build(factory, **config)
            if key not in _background_started and not any(op in g for g in ON_DEMAND):
                _background_started.add(key)
                try:
                    _compile_in_background(key, kernels)
                except Exception:  # noqa: BLE001 (its kernels then compile on first use)
                    pass
        except Exception as exc:  # noqa: BLE001 (any build failure: fall back, loudly once)
            instead = _FALLBACK.get(op, "this op runs its PyTorch kernel")
            warnings.warn(f"torch_dplr: the TileLang kernel {op} for chunk_size={chunk_size}, "
                          f"K={K}, V={V}, {dtype} could not be built ({type(exc).__name__}: "
                          f"{exc}); {instead} instead", RuntimeWarning, stacklevel=2)
            kernel = None
        _kernels[(op, key)] = kernel
        _seconds_getting_kernels[0] += time.perf_counter() - start
    return kernel


def seconds_getting_kernels() -> float:
    """Host seconds this process spent in :func:`kernel_for` compiling or loading kernels
    (TileLang import included): the kernel part of a first call (benchmarks.first_call)."""
    return _seconds_getting_kernels[0]
