"""Compile what the selected cells will run, in parallel, before the first cell is timed.

On a fresh machine the harness would otherwise compile inside its one process, kernel after
kernel: torch_dplr's TileLang kernels, FLA's Triton kernels (every autotuning candidate of a key
missing from the shipped autotune results) and FLA's TileLang JIT (~2 min per configuration).
Over the whole envelope that adds up to tens of minutes.  Here:

- torch_dplr: the kernels of every (chunk size, head dim, gate style) the cells use go to
  :func:`csrc_tl.build_all` (one compiler process per core), into ``TILELANG_CACHE_DIR``.
- FLA: one worker process per set of FLA kernels the cells run, that is per (gate style, chunk
  size, head dim, heads, state, varlen or not); FLA's kernels are specialized on none of B, T
  or the sequence lengths (Triton's autotune keys are block sizes and dtypes, its TileLang
  kernels take the token count as a dynamic size).  A worker calls FLA once per route and mode
  (no-grad forward; forward+backward with and without ``disable_recompute``) on a short input
  of the set's first shape: its B (or sequence count), H and D, T cut to ``SHORT_T`` tokens (a
  multiple of 64, so the chunk counts keep Triton's divisible-by-16 specialization).  That
  first shape is the one FLA's TileLang verifier accepts most often (the largest grid comes
  first in the envelope), so its kernels cover the set.  The longest jobs (varlen, and head
  dim 128 at chunk 16: hundreds of autotune candidates each) start first.  Workers run in
  parallel, spread over the visible GPUs; TileLang's disk cache takes concurrent writers
  (atomic renames).

Triton's autotuner would tune a key that the shipped results lack on the short input, with
other workers sharing the GPU, and cache that choice.  So each worker gets a private Triton
cache seeded with the real cache's entries (hard links); afterwards its new compiled kernels
are merged into the real cache and the autotune results it made are dropped.  The harness then
still tunes on the real input (benchmarking already compiled candidates, reported as FLA's
first call).  Since those results are dropped, a worker's autotuner only launches each
candidate once (:func:`compile_only_autotuning`) instead of timing it on the shared GPU.

A TileLang JIT takes ~200 s per config and D128 at chunk 16 autotunes 391 candidates.  On a
fresh H200 host (12 workers, 16 CPU cores) the whole envelope's prewarm takes about 300 s with
the shipped autotune results, the varlen sets the longest (213-222 s).  So prewarm once per
machine and pass ``--no-prewarm`` to the commands that continue a run on the same machine.

    python -m benchmarks.prewarm --cells 'c32' --workers 12   # what `bench` does by default
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import cells as cells_mod

SHORT_T = 1024  # tokens per row (rect) of a warm-up call; varlen: at least 64 per sequence
WORKER_TIMEOUT_S = 600.0  # a worker past this is killed (its cell then compiles when timed)
FLA_WORKERS_PER_GPU = 12  # each holds a CUDA context and runs one compiler at a time
AUTOTUNE_SUFFIX = ".autotune.json"


def short_shape(shape: cells_mod.Shape) -> cells_mod.Shape:
    """The cell's layout (B or N, H, D) at a length that runs in milliseconds."""
    T = SHORT_T if shape.N is None else max(SHORT_T, 64 * shape.N)
    return dataclasses.replace(shape, T=min(shape.T, T))


def fla_kernel_set(shape: cells_mod.Shape, gates: str, chunk_size: int, state: bool) -> tuple:
    """What decides which FLA kernels a cell compiles (and which autotune keys it tunes)."""
    return (gates, chunk_size, shape.D, shape.H, state, shape.N is not None)


def _expected_cost(job: dict) -> tuple:
    # Measured on the H200: varlen jobs (their own autotune keys, 250-450 candidates each)
    # take 300-540 s and head dim 128 at chunk 16 420-490 s; the rest 40-250 s.
    heavy = (job["N"] is not None) + (job["D"] == 128 and job["chunk_size"] == 16)
    return (-heavy, job["chunk_size"], not job["state"])


def fla_jobs(selected) -> list[dict]:
    """One job per FLA kernel set among the timed cells (stage cells run torch_dplr only), on
    the set's first shape, the longest jobs first."""
    jobs = {}
    for cell in selected:
        if cell.mode not in cells_mod.MODES:
            continue
        s = short_shape(cell.shape)
        key = fla_kernel_set(cell.shape, cell.gates, cell.chunk_size, cell.state)
        jobs.setdefault(key, {"B": s.B, "T": s.T, "H": s.H, "D": s.D, "N": s.N, "gates": cell.gates,
                              "chunk_size": cell.chunk_size, "state": cell.state})
    return sorted(jobs.values(), key=_expected_cost)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g.strip() for g in given.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def dplr_items(selected) -> list:
    """The (factory, config) of every torch_dplr kernel the cells run (bf16 data, fp32 gates)."""
    from torch_dplr.ops.kernels import pipeline
    from torch_dplr.testing import RWKV7_BOUND

    configs = {(c.chunk_size, c.shape.D, RWKV7_BOUND if c.gates == "rwkv7" else float("-inf"))
               for c in selected}
    items = {}
    for C, D, bound in sorted(configs):
        for name, (factory, config) in pipeline(C, D, D, torch.bfloat16, torch.float32, bound).items():
            # keyed by kernel, not name: an exact intra kernel is another call's intra kernel
            items[(factory.__name__, json.dumps(config, sort_keys=True, default=str))] = (
                factory, config)
    return list(items.values())


def _triton_cache() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _is_autotune_entry(entry: Path) -> bool:
    return any(f.name.endswith(AUTOTUNE_SUFFIX) for f in entry.iterdir())


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def seed_private_cache(shared: Path, private: Path) -> None:
    """A Triton cache holding the shared cache's entries: its autotune results (the shipped
    ones: a worker tunes only what they lack) and what is compiled already (hard links)."""
    private.mkdir(parents=True, exist_ok=True)
    if shared.is_dir():
        for entry in shared.iterdir():
            if entry.is_dir():
                shutil.copytree(entry, private / entry.name, dirs_exist_ok=True,
                                copy_function=_link_or_copy)


def merge_compiled(private: Path, shared: Path) -> int:
    """Copies the private cache's new compiled kernels (not autotune results: those made on
    the short input must not be used for timing) into the shared cache; returns how many
    entries were new."""
    shared.mkdir(parents=True, exist_ok=True)
    new = 0
    for entry in private.iterdir():
        target = shared / entry.name
        if entry.is_dir() and not target.exists() and not _is_autotune_entry(entry):
            shutil.copytree(entry, target)
            new += 1
    return new


def _launch(job: dict, private: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, TRITON_CACHE_DIR=str(private), TRITON_CACHE_AUTOTUNING="1")
    if job.get("gpu") is not None:  # spread over the GPUs (see _run_pool)
        env["CUDA_VISIBLE_DEVICES"] = job["gpu"]
    cmd = [sys.executable, "-m", "benchmarks.prewarm", "--fla-job", json.dumps(job)]
    with log.open("w") as out:  # a file, not a pipe: a chatty worker must not block on it
        # its own process group: a worker killed at the timeout takes its nvcc children along
        return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _label(job: dict) -> str:
    shape = cells_mod.Shape(job["B"], job["T"], job["H"], job["D"], job["N"])
    return f"{shape.label}/c{job['chunk_size']}/{job['gates']}/{'state' if job['state'] else 'nostate'}"


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # so that the finally below stops the workers


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_fla_jobs(jobs: list[dict], workers: int, say, launch=None, gpus=()) -> None:
    """Runs the FLA jobs, ``workers`` at a time, and merges their compiled Triton kernels.

    ``launch(job, private_cache, log)`` starts a worker (default: this module's FLA worker);
    with several ``gpus`` (``CUDA_VISIBLE_DEVICES`` entries) job i gets ``job["gpu"]``, the
    GPUs in turn, so the workers' autotuning is spread over them.
    Workers never outlive this call, even when the harness is stopped (SIGTERM, e.g. a
    ``timeout``): a stray worker autotuning on the GPU would skew every timing after it."""
    launch = launch or _launch
    shared = _triton_cache()
    try:
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    except ValueError:  # not the main thread: leave the handler alone
        previous = None
    running: dict[int, tuple[subprocess.Popen, Path, Path, float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="torch_dplr_prewarm_triton_") as tmp:
            if len(gpus) > 1:
                jobs = [dict(job, gpu=gpus[i % len(gpus)]) for i, job in enumerate(jobs)]
            _run_pool(jobs, workers, say, launch, shared, Path(tmp), running)
    finally:
        for proc, *_ in running.values():
            _stop(proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_pool(jobs, workers, say, launch, shared: Path, tmp: Path, running: dict) -> None:
    """Keeps ``workers`` jobs running until all are done; ``running`` is shared with the
    caller, which stops whatever is left in it."""
    pending = list(enumerate(jobs))
    while pending or running:
        while pending and len(running) < workers:
            i, job = pending.pop(0)
            private = tmp / str(i)
            seed_private_cache(shared, private)
            log = tmp / f"{i}.log"
            running[i] = (launch(job, private, log), private, log, time.perf_counter())
        time.sleep(0.5)
        for i, (proc, private, log, start) in list(running.items()):
            if proc.poll() is None and time.perf_counter() - start < WORKER_TIMEOUT_S:
                continue
            _stop(proc)  # past the timeout (a no-op when it has exited)
            del running[i]
            output = log.read_text(errors="replace") if log.exists() else ""
            tail = (output.strip().splitlines() or [""])[-1][:200]
            merged = merge_compiled(private, shared)
            say(f"FLA {_label(jobs[i])}: exit {proc.returncode} in "
                f"{time.perf_counter() - start:.0f} s, {merged} Triton kernels: {tail}")
            shutil.rmtree(private, ignore_errors=True)


def compile_only_autotuning(autotuner_cls=None) -> bool:
    """Makes Triton's autotuner (in this process) launch each candidate once, compiling it,
    instead of timing it.  A worker's tuning results are dropped (see :func:`merge_compiled`):
    the harness tunes on the real input, on a GPU it has to itself.  So timing hundreds of
    candidates per key here, twelve workers to a GPU, is GPU time spent for nothing.  Returns
    whether the autotuner was patched (Triton 3.2 and later make ``do_bench`` a cached
    property; an older Triton keeps timing)."""
    if autotuner_cls is None:
        try:
            from triton.runtime.autotuner import Autotuner as autotuner_cls
        except ImportError:
            return False
    if not isinstance(inspect.getattr_static(autotuner_cls, "do_bench", None), functools.cached_property):
        return False

    def launch_once(kernel_call, quantiles=None, **_):
        kernel_call()
        return [1.0] * len(quantiles) if quantiles else 1.0

    autotuner_cls.do_bench = property(lambda self: launch_once)
    return True


def warm_fla_job(job: dict) -> str:
    """In a worker process: FLA's calls of one job on both routes, each mode once."""
    from . import calls, inputs
    from .fla_routes import FLA, ROUTES
    from .harness import fla_kwargs

    compile_only = compile_only_autotuning()
    fla = FLA()
    shape = cells_mod.Shape(job["B"], job["T"], job["H"], job["D"], job["N"])
    inp = inputs.make(shape, job["gates"], "cuda")
    leaves = inp.leaves()
    entry = calls.ENTRY[job["gates"]]
    fn = calls.in_dplr_order(entry, fla.entries[entry])
    done = []
    for route in ROUTES:
        for mode, policy in (("fwd", "none"), ("fwd_bwd", "none"), ("fwd_bwd", cells_mod.SHIPPED_POLICY)):
            cell = cells_mod.Cell(shape, job["chunk_size"], job["gates"], job["state"], mode, policy)
            tensors = leaves if mode == "fwd_bwd" else inp
            kwargs = fla_kwargs(cell, tensors)
            step = calls.fwd_step(fn, tensors, kwargs) if mode == "fwd" else \
                calls.fwd_bwd_step(fn, tensors, kwargs)
            with fla.route(route):
                try:
                    step()
                    done.append(f"{route}:{mode}:{policy}")
                except Exception as exc:  # noqa: BLE001  (the harness records the failure)
                    done.append(f"{route}:{mode}:{policy} failed ({type(exc).__name__})")
    torch.cuda.synchronize()
    return ("compile-only tuning: " if compile_only else "") + ", ".join(done)


def prewarm(selected, fla: bool, workers: int | None = None, say=print) -> float:
    """Compiles torch_dplr's kernels and (with ``fla``) FLA's for the cells; returns seconds."""
    start = time.perf_counter()
    jobs = fla_jobs(selected) if fla else []
    # torch_dplr's compiler processes first (they finish in about a minute), FLA's workers after
    try:
        import csrc_tl

        items = dplr_items(selected)
        csrc_tl.build_all(items, workers=workers, load=False)  # None: csrc_tl's default
        say(f"torch_dplr: {len(items)} kernels ready in {time.perf_counter() - start:.0f} s")
    except ImportError as exc:  # no TileLang here: torch_dplr's cells run its PyTorch kernels
        say(f"torch_dplr: nothing to compile ({exc})")
    except RuntimeError as exc:  # the cells record what falls back; FLA still gets compiled
        say(f"torch_dplr: some kernels failed to compile: {str(exc).splitlines()[1:3]}")
    if jobs:  # as many as the CPUs this process may use, up to FLA_WORKERS_PER_GPU per GPU
        gpus = visible_gpus()
        limit = FLA_WORKERS_PER_GPU * max(1, len(gpus))
        run_fla_jobs(jobs, min(workers or len(os.sched_getaffinity(0)), limit), say, gpus=gpus)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prewarm", description=__doc__.split("\n")[0])
    parser.add_argument("--cells", help="regular expression on cell ids (as bench --cells)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--workers", type=int)
    from . import harness  # not at the top: the harness imports this module

    harness.add_skip_done_in(parser)
    parser.add_argument("--fla-job", help=argparse.SUPPRESS)  # a worker: one JSON job
    args = parser.parse_args(argv)
    if args.fla_job:
        print(warm_fla_job(json.loads(args.fla_job)), flush=True)
        return 0
    selected = cells_mod.select(cells_mod.envelope(quick=args.quick), args.cells, cells_mod.MODES)
    done = harness.done_in(args.skip_done_in)  # a continued run prewarms only what is left
    selected = [c for c in selected if c.id not in done]
    seconds = prewarm(selected, fla=not args.no_fla, workers=args.workers,
                      say=lambda line: print(line, flush=True))
    print(f"prewarm done in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
