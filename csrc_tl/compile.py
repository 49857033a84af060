"""Kernel build layer: static config -> compiled TileLang kernel, cached.

A kernel family is a *factory*: a plain function taking only Python scalars
(ints, strings, bools) that returns a ``T.prim_func``. :func:`build` turns a
factory plus its config into a compiled kernel:

1. an in-process dict keyed on ``(factory module, factory name, config)``
   answers repeat calls without re-tracing the prim_func (tracing plus TVM's
   script hash costs ~0.1-1 s, far too much per call);
2. below it TileLang's own disk cache (``TILELANG_CACHE_DIR``, default
   ``~/.tilelang/cache``) keyed on the traced TIR, the target and the TileLang
   build, so a cache filled on a CPU-only machine is reused on the H200;
3. on a miss, lowering plus nvcc for ``sm_90a``. None of this needs a GPU.

Kernels are built with caller-allocated outputs (``out_idx=None``): the caller
passes every output tensor, the adapter resolves no output shapes, and the
call is ``kernel(*inputs, *outputs)`` with nothing returned.

Config values must be plain Python ``bool``/``int``/``float``/``str``/``None``
(dtypes may be given as ``torch.dtype`` and are turned into TileLang names).
Anything else -- notably ``torch.SymInt`` -- is rejected: kernels are looked
up inside op bodies on concrete values only, never while Dynamo traces.

A factory may carry ``pass_configs`` / ``compile_flags`` attributes (see
:func:`kernel_options`); they are part of how the kernel is built, so they live
next to the kernel rather than at each call site.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "TARGET",
    "EXECUTION_BACKEND",
    "build",
    "trace",
    "cache_key",
    "canonical_dtype",
    "kernel_options",
    "clear_cache",
    "cached_keys",
]

#: The one target every kernel is built for (H200). ``sm_90a`` rather than
#: ``sm_90``: warp-specialized / ``setmaxnreg`` code only assembles for 90a.
TARGET: dict[str, str] = {"kind": "cuda", "arch": "sm_90a"}

#: Pinned rather than "auto" so that the disk-cache key (which includes the
#: resolved backend) is the same on a CPU build machine and on the GPU host.
EXECUTION_BACKEND = "tvm_ffi"

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "int32": "int32",
    "int64": "int64",
}

_lock = threading.Lock()
_kernels: dict[tuple, Any] = {}  # canonical key -> kernel
_by_call: dict[tuple, Any] = {}  # (factory, call kwargs as given) -> kernel
_building: dict[tuple, threading.Lock] = {}


def canonical_dtype(dtype: Any) -> str:
    """TileLang dtype name for a ``torch.dtype`` or a dtype string.

    >>> canonical_dtype("bf16")
    'bfloat16'
    """
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    try:
        return _DTYPE_ALIASES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}") from None


def _canonical_value(name: str, value: Any) -> bool | int | float | str | None:
    # bool before int: bool is an int subclass but must stay distinct in keys.
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return canonical_dtype(value)
    raise TypeError(
        f"kernel config {name}={value!r} ({type(value).__name__}): only plain "
        "bool/int/float/str/None (or torch.dtype) may select a kernel"
    )


def cache_key(factory: Callable[..., Any], config: Mapping[str, Any]) -> tuple:
    """The in-memory cache key: factory identity plus the full, sorted config.

    Defaults are filled in from the factory's signature, so ``f(C=64)`` and
    ``f(C=64, threads=None)`` share one key (and one compiled kernel).
    """
    bound = inspect.signature(factory).bind(**config)
    bound.apply_defaults()
    items = tuple(sorted((k, _canonical_value(k, v)) for k, v in bound.arguments.items()))
    return (factory.__module__, factory.__qualname__, items)


def kernel_options(
    *, pass_configs: Mapping[str, Any] | None = None, compile_flags: list[str] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator attaching TileLang pass configs / extra nvcc flags to a factory."""

    def tag(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.pass_configs = dict(pass_configs) if pass_configs else None
        factory.compile_flags = list(compile_flags) if compile_flags else None
        return factory

    return tag


def trace(factory: Callable[..., Any], /, **config: Any):
    """The prim_func for ``config`` (no lowering, no nvcc); for inspection."""
    return factory(**dict(cache_key(factory, config)[2]))


def build(factory: Callable[..., Any], /, **config: Any):
    """Compiled kernel for ``factory(**config)``; cached in memory and on disk.

    Returns a ``tilelang.JITKernel`` called as ``kernel(*inputs, *outputs)``.
    Safe to call from several threads; a given config is compiled once.
    """
    try:  # fast path: this exact call form was seen before (no signature binding)
        fast = (factory, tuple(sorted(config.items())))
        kernel = _by_call.get(fast)
    except TypeError:  # unhashable value (e.g. a SymInt): cache_key explains
        fast, kernel = None, None
    if kernel is not None:
        return kernel
    key = cache_key(factory, config)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _build_locked(factory, key)
    if fast is not None:
        _by_call[fast] = kernel
    return kernel


def _build_locked(factory: Callable[..., Any], key: tuple):
    with _lock:
        kernel = _kernels.get(key)
        if kernel is not None:
            return kernel
        key_lock = _building.setdefault(key, threading.Lock())
    with key_lock:  # other configs keep building / hitting meanwhile
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _compile(factory, dict(key[2]))
            with _lock:
                _kernels[key] = kernel
                _building.pop(key, None)
    return kernel


def _compile(factory: Callable[..., Any], config: dict[str, Any]):
    import tilelang  # deferred: importing tilelang costs ~2 s

    func = factory(**config)
    return tilelang.compile(
        func,
        out_idx=None,
        target=TARGET,
        execution_backend=EXECUTION_BACKEND,
        pass_configs=getattr(factory, "pass_configs", None),
        compile_flags=getattr(factory, "compile_flags", None),
    )


def clear_cache() -> None:
    """Forget in-memory kernels (the disk cache is left alone)."""
    with _lock:
        _kernels.clear()
        _by_call.clear()


def cached_keys() -> list[tuple]:
    with _lock:
        return list(_kernels)
