"""Kernel build layer: static config -> compiled TileLang kernel, cached.

A kernel family is a *factory*: a plain function taking only Python scalars
(ints, strings, bools) that returns a ``T.prim_func``. :func:`build` turns a
factory plus its config into a compiled kernel:

1. an in-process dict keyed on ``(factory module, factory name, config)``
   answers repeat calls without re-tracing the prim_func (tracing costs
   ~0.1-0.4 s, far too much per call);
2. below it TileLang's own disk cache (``TILELANG_CACHE_DIR``, default
   ``~/.tilelang/cache``) keyed on the traced TIR, the target and the TileLang
   build, so a cache filled on a CPU-only machine is reused on the H200. The
   TIR itself is kept next to the kernel's marker (:func:`_traced`), so a warm
   process loads it (~20 ms) instead of tracing the factory again;
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

import functools
import hashlib
import inspect
import os
import sys
import threading
import time
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
    "build_all",
    "on_disk",
    "in_memory",
    "default_workers",
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
        if key in _failed:
            raise RuntimeError(f"{_describe(factory, dict(key[2]))} failed to compile earlier "
                               f"in this process:\n{_failed[key]}")
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
            kernel = _compile(factory, key)
            with _lock:
                _kernels[key] = kernel
                _building.pop(key, None)
    return kernel


def _compile(factory: Callable[..., Any], key: tuple):
    import tilelang  # deferred: importing tilelang costs ~2 s

    func = _traced(factory, key)
    return tilelang.compile(
        func,
        out_idx=None,
        target=TARGET,
        execution_backend=EXECUTION_BACKEND,
        pass_configs=getattr(factory, "pass_configs", None),
        compile_flags=getattr(factory, "compile_flags", None),
    )


def clear_cache() -> None:
    """Forget in-memory kernels and compile failures (the disk cache is left alone)."""
    with _lock:
        _kernels.clear()
        _by_call.clear()
        _failed.clear()


def cached_keys() -> list[tuple]:
    with _lock:
        return list(_kernels)


# ---- building many kernels at once (first use, precompile, the CI compile test) ----

_COMPILE_TIMEOUT_S = 1200  # one kernel; nvcc takes 5-60 s, a hang must not hang the caller
_failed: dict[tuple, str] = {}  # kernels that failed to compile in this process: not retried


def _cache_dir() -> str:
    import tilelang.env  # read at call time, as TileLang does: tests point it elsewhere

    return str(tilelang.env.TILELANG_CACHE_DIR)


@functools.lru_cache(maxsize=None)
def _shared_sources() -> tuple[str, ...]:
    """csrc_tl's files that are not a kernel family (DPLR or DSA): any kernel may depend on
    them. A family's own file keys only its own kernels, so editing one leaves the others'
    cache entries valid."""
    from . import DSA_KERNEL_MODULES, KERNEL_MODULES

    families = {*KERNEL_MODULES, *DSA_KERNEL_MODULES}
    here = os.path.dirname(os.path.abspath(__file__))
    return tuple(sorted(os.path.join(here, name) for name in os.listdir(here)
                        if name.endswith(".py") and name[:-3] not in families))


def _marker(factory: Callable[..., Any], key: tuple) -> str:
    """A file in the cache that says "this exact kernel was compiled into it": the sources of
    the factory's module and of csrc_tl's shared files (this build layer, its worker, and any
    module kernels share), the target and the TileLang version are part of its name, so an
    edited kernel, shared module or build setting misses."""
    import tilelang

    sources = b""
    for path in (sys.modules[factory.__module__].__file__, *_shared_sources()):
        with open(path, "rb") as f:
            sources += f.read()
    digest = hashlib.sha256(sources + repr((key, TARGET, tilelang.__version__)).encode())
    return os.path.join(_cache_dir(), "torch_dplr-built", digest.hexdigest()[:32])


def _traced(factory: Callable[..., Any], key: tuple):
    """The prim_func of ``key``: loaded from the TIR kept beside the kernel's marker (TVM's JSON
    form, ~20 ms), else traced (0.1-0.4 s of Python: the bulk of a warm first call's kernel
    loading) and kept there for the next process. The marker's name covers every source and
    setting the TIR depends on, so a stale file is never found; an unreadable one (a partial
    write, say) is traced again."""
    import tilelang.env
    import tvm

    path = _marker(factory, key) + ".tir.json" if tilelang.env.is_cache_enabled() else None
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                return tvm.ir.load_json(f.read())
        except Exception:  # noqa: BLE001 (any failure to read it: trace instead)
            pass
    func = factory(**dict(key[2]))
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            partial = f"{path}.{os.getpid()}.{threading.get_ident()}"
            with open(partial, "w") as f:
                f.write(tvm.ir.save_json(func))
            os.replace(partial, path)  # atomic: a reader sees all of it or nothing
        except OSError:
            pass  # a read-only cache: the next process traces too
    return func


def in_memory(factory: Callable[..., Any], /, **config: Any) -> bool:
    """Whether this process has already built the kernel."""
    return cache_key(factory, config) in _kernels


def on_disk(factory: Callable[..., Any], /, **config: Any) -> bool:
    """Whether this kernel was compiled into the current disk cache (by :func:`build_all` or
    :func:`build` through it), so building it loads rather than runs nvcc."""
    return os.path.exists(_marker(factory, cache_key(factory, config)))


def _mark_built(factory: Callable[..., Any], key: tuple) -> None:
    import tilelang.env

    if not tilelang.env.is_cache_enabled():  # nothing was stored: claim nothing
        return
    path = _marker(factory, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(repr(key))


class _CompilerProcess:
    """One ``csrc_tl._compile_worker`` interpreter, fed one kernel at a time."""

    def __init__(self):
        import subprocess
        import tempfile

        # run from the folder this csrc_tl was imported from, so the worker compiles this
        # source (``-m`` puts the working directory first on its path)
        home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([home, *(p for p in sys.path if p)]))
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr: a pipe nobody reads could fill
        self.proc = subprocess.Popen([sys.executable, "-m", "csrc_tl._compile_worker"], cwd=home,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)

    def compile(self, factory: Callable[..., Any], config: dict[str, Any]) -> float:
        """Seconds the kernel took, or RuntimeError with the end of its log."""
        import json

        self.proc.stdin.write(json.dumps([factory.__module__, factory.__qualname__, config]) + "\n")
        self.proc.stdin.flush()
        watchdog = threading.Timer(_COMPILE_TIMEOUT_S, self.proc.kill)
        watchdog.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            watchdog.cancel()
        if not line:  # killed by the watchdog, or crashed
            self.log.seek(0)
            tail = "\n".join(self.log.read().strip().splitlines()[-20:])
            raise RuntimeError(f"compiler process ended (timeout {_COMPILE_TIMEOUT_S} s or a "
                               f"crash):\n{tail}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise RuntimeError(answer["error"])
        return answer["seconds"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self.log.close()


def _describe(factory: Callable[..., Any], config: Mapping[str, Any]) -> str:
    values = " ".join(f"{k}={v}" for k, v in config.items() if v is not None)
    return f"{factory.__module__.rsplit('.', 1)[-1]} {values}"


def default_workers() -> int:
    """Compiler processes: the CPUs this process may use, at most 32."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 32))


def build_all(items, workers: int | None = None, progress: Callable[[str], None] | None = None,
              load: bool = True):
    """Compiled kernels for ``items`` (``(factory, config)`` pairs), in order.

    Kernels neither in memory nor in the disk cache are compiled first, in parallel, by up to
    ``workers`` compiler processes (default :func:`default_workers`); ``progress`` gets a line
    per finished kernel. Then every kernel is built here, from the disk cache (``load=False``
    stops after compiling and returns None). If any kernel fails to compile, the others are
    still compiled and cached, and a RuntimeError names each failed kernel, its config and the
    end of its compiler log; a later ``build`` of a failed kernel raises at once.
    """
    items = [(factory, dict(cache_key(factory, config)[2])) for factory, config in items]
    missing = [(f, c) for f, c in items
               if cache_key(f, c) not in _kernels and cache_key(f, c) not in _failed
               and not on_disk(f, **c)]
    if missing:
        _compile_in_processes(missing, workers or default_workers(), progress)
    errors = [f"{_describe(f, c)}: {_failed[cache_key(f, c)]}" for f, c in items
              if cache_key(f, c) in _failed]
    if errors:
        raise RuntimeError("TileLang kernels failed to compile:\n" + "\n".join(errors))
    if not load:
        return None
    return [build(factory, **config) for factory, config in items]


def _compile_in_processes(missing, workers: int, progress) -> None:
    import queue

    say = progress or (lambda line: None)
    start = time.perf_counter()
    workers = min(workers, len(missing))
    say(f"compiling {len(missing)} TileLang kernel(s) for {TARGET['arch']} with "
        f"{workers} process(es) (once; cached in {_cache_dir()})")
    jobs: queue.Queue = queue.Queue()
    for item in missing:
        jobs.put(item)
    finished = [0]
    report = threading.Lock()

    def record(factory, config, seconds=None, error=None):
        key = cache_key(factory, config)
        with report:
            finished[0] += 1
            if error is None:
                _mark_built(factory, key)
                say(f"[{finished[0]}/{len(missing)}] {_describe(factory, config)} ({seconds:.1f} s)")
            else:
                _failed[key] = error
                say(f"[{finished[0]}/{len(missing)}] FAILED {_describe(factory, config)}")

    def drain():
        # one thread per compiler process: it feeds its process jobs until none are left
        process = None
        try:
            while True:
                try:
                    factory, config = jobs.get_nowait()
                except queue.Empty:
                    return
                if process is None or not process.alive():
                    if process is not None:
                        process.close()
                    process = _CompilerProcess()
                try:
                    record(factory, config, seconds=process.compile(factory, config))
                except Exception as exc:  # noqa: BLE001 (reported by build_all)
                    record(factory, config, error=str(exc))
        finally:
            if process is not None:
                process.close()

    threads = [threading.Thread(target=drain, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    say(f"done in {time.perf_counter() - start:.1f} s")
