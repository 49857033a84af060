"""``python -m torch_dplr bench``: torch_dplr against flash-linear-attention, cell by cell.

For every cell of :mod:`benchmarks.cells` it times, in this one process and on the same inputs,
torch_dplr and FLA's ``chunk_rwkv7`` / ``chunk_dplr_delta_rule`` on its Triton route
(``FLA_TILELANG=0``) and its TileLang route (``FLA_TILELANG=1``; see :mod:`benchmarks.fla_routes`),
and, where ``$TORCH_DPLR_WIND_RWKV`` names its source, wind_rwkv's ``chunked_cuda`` kernel
(:mod:`benchmarks.wind_route`; built for one head dim per process, so ``--head-dim`` runs the
D128 cells in a second process), and appends one JSON object per cell to ``OUT/<device>.json``
as soon as it is measured.  Then it measures the first call in fresh processes
(:mod:`benchmarks.first_call`) and writes ``OUT/<device>.md`` and ``OUT/<device>.png``
(:mod:`benchmarks.report`).  With ``--stages``
(the default with ``--quick``) it also times torch_dplr's stage ops one by one per (shape, chunk
size, gate style, state) and records where the time goes (:mod:`benchmarks.stages`).

A failure in one implementation leaves its columns null with a ``*_error`` field and the run
goes on.  Without a GPU it runs every shape shrunk to a tiny size (a smoke test: the times mean
nothing), and FLA and wind_rwkv, which need CUDA, are reported as not run.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

import torch_dplr
from torch_dplr import policies

from . import calls, cells, inputs, prewarm, report, stages, wind_route
from .fla_routes import FLA, ROUTES
from .timing import Timer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results"
AUTOTUNE_ENV = "TORCH_DPLR_BENCH_FLA_AUTOTUNE"  # a tar.xz of Triton autotune results for FLA
AUTOTUNE_CANDIDATES = (REPO / ".devsite" / "fla_triton_autotune_h200.tar.xz",
                       REPO / ".gpu" / "fla_triton_autotune_h200.tar.xz",  # tools/pack_gpu_bundle.sh
                       REPO.parent / "shared" / "bench" / "fla_triton_autotune_h200.tar.xz")
# Every record carries these keys, null when not measured.
REQUIRED = ("torch_dplr_ms", "fla_triton_ms", "fla_tilelang_ms", "ratio", "torch_dplr_peak_mb",
            "fla_peak_mb", "fla_tilelang_fallback", "wind_ms", "wind_peak_mb", "ratio_wind")
DEFAULT_MODES = (*cells.MODES, cells.FIRST_CALL)


def _modes(args) -> list[str]:
    """--modes, else the default (plus stage with --quick: it costs seconds); --stages adds stage."""
    if args.modes is not None:
        modes = [m for m in args.modes.split(",") if m]
    else:
        modes = list(DEFAULT_MODES) + ([cells.STAGE] if args.quick else [])
    return modes + [cells.STAGE] if args.stages and cells.STAGE not in modes else modes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_dplr bench", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default %(default)s)")
    p.add_argument("--name", help="file stem (default: the device, e.g. h200 or cpu)")
    p.add_argument("--cells", help="regular expression on cell ids (see --list)")
    p.add_argument("--quick", action="store_true", help="design shape only, chunk 64, RWKV-7 gates")
    p.add_argument("--modes", help=f"comma list of fwd, fwd_bwd, first_call, stage (default "
                   f"{','.join(DEFAULT_MODES)}, and stage with --quick)")
    p.add_argument("--stages", action="store_true",
                   help="add the stage mode: each stage op timed alone, with bytes and GB/s")
    p.add_argument("--policies", default=f"none,{cells.SHIPPED_POLICY}",
                   help="fwd_bwd policies: none and/or a torch_dplr.policies name (default %(default)s)")
    p.add_argument("--reps", type=int, help="timed repetitions per cell (default 20; 3 on the CPU)")
    p.add_argument("--warmup", type=int, help="warm-up calls after the first (default 3; 0 on the CPU)")
    p.add_argument("--cap-s", type=float, default=20.0,
                   help="time cap of the reps of one implementation in one cell (default %(default)s)")
    p.add_argument("--no-flush", action="store_true", help="do not flush the L2 between reps")
    p.add_argument("--no-fla", action="store_true", help="time torch_dplr only")
    p.add_argument("--no-wind", action="store_true", help="leave wind_rwkv out")
    p.add_argument("--head-dim", type=int, help="only the cells of this head dim (wind_rwkv's "
                   "kernel is built for one per process: D128 cells run in a second process)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--tiny", action="store_true", help="shrink every shape (implied on the CPU)")
    p.add_argument("--resume", action="store_true",
                   help="append to the output, skipping cells it already holds without error")
    add_skip_done_in(p)
    p.add_argument("--no-prewarm", action="store_true",
                   help="compile inside the timed cells' first calls instead of in parallel up front")
    p.add_argument("--first-call-timeout", type=float, default=540.0, help="seconds per subprocess")
    p.add_argument("--shard", help="I/N: only shard I (0-based) of N of the selected cells, "
                   "for N processes on N GPUs of one host, each with its own --name and "
                   "--no-prewarm (run python -m benchmarks.prewarm once before them); then "
                   "python -m benchmarks.report OUT.json --merge the shards' files")
    p.add_argument("--list", action="store_true", help="print the selected cell ids and exit")
    args = p.parse_args(argv)
    if args.shard is not None:
        given = args.shard
        try:
            args.shard = tuple(int(x) for x in given.split("/"))
            cells.shard([], *args.shard)  # checks 0 <= I < N
        except (TypeError, ValueError):
            p.error(f"--shard must be I/N with 0 <= I < N, got {given!r}")
    args.modes = _modes(args)
    args.policies = [x for x in args.policies.split(",") if x]
    unknown = set(args.modes) - {*cells.MODES, cells.FIRST_CALL, cells.STAGE}
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}")
    for pol in args.policies:
        if pol != "none" and pol not in policies.POLICIES:
            p.error(f"unknown policy {pol!r}; expected none or one of {sorted(policies.POLICIES)}")
    return args


def device_stem(device: torch.device) -> str:
    """``h200`` for an 'NVIDIA H200', ``cpu`` for the CPU: the results' file name."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "cuda"


def _git_commit() -> str | None:
    """The code's commit: ``$TORCH_DPLR_GIT_COMMIT`` when set (the GPU bundle sets it: the
    GPU host's copy of ``.git`` can lag the working tree that travels), else git's HEAD."""
    if os.environ.get("TORCH_DPLR_GIT_COMMIT"):
        return os.environ["TORCH_DPLR_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _tilelang_usable(device) -> bool | None:
    """Whether torch_dplr may run TileLang kernels here (None: could not tell)."""
    if device.type != "cuda":
        return False
    try:
        from torch_dplr.ops.tilelang_path import tilelang_usable
        return tilelang_usable(device)
    except Exception:  # noqa: BLE001  (metadata only)
        return None


def _pytorch_stages_so_far() -> list[str]:
    """Ops whose TileLang kernel could not be built in this process (they ran their PyTorch
    kernel): a cell timed with any of them is not a measurement of the kernels."""
    from torch_dplr.ops import kernels

    return sorted({op for (op, _), kernel in kernels._kernels.items() if kernel is None})


def _uuid_of(device) -> str | None:
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # noqa: BLE001  (an older torch: then every GPU counts)
        return None


def processes_on(smi_csv: str, uuid: str | None) -> list[int]:
    """PIDs in ``nvidia-smi --query-compute-apps=pid,gpu_uuid`` output on the GPU ``uuid``
    (every GPU when None), this process left out."""
    def same(gpu: str) -> bool:
        return uuid is None or gpu.strip().lower().removeprefix("gpu-") == uuid.lower().removeprefix("gpu-")

    pids = []
    for line in smi_csv.splitlines():
        pid, _, gpu = line.partition(",")
        if pid.strip().isdigit() and int(pid) != os.getpid() and same(gpu):
            pids.append(int(pid))
    return pids


def other_gpu_processes(device) -> list[int] | None:
    """PIDs of other processes on this run's GPU (None: nvidia-smi not available).  Timings
    taken while another process computes on the same GPU are not measurements of either
    library; one on another GPU of the host (e.g. the other shard, see ``--shard``) does not
    count."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return processes_on(out.stdout, _uuid_of(device))


def card_meta(device) -> dict:
    """What every measurement record names: the card, torch, torch_dplr, whether its TileLang
    kernels run there, and the commit."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "torch_dplr": torch_dplr.__version__,
            "torch_dplr_tilelang": _tilelang_usable(device), "git": _git_commit()}


def run_meta(device, fla) -> dict:
    """:func:`card_meta` and the FLA version the run compared with (None: no FLA)."""
    return {**card_meta(device), "fla": fla.version if fla is not None else None}


def install_fla_autotune_cache() -> str:
    """Unpack FLA's Triton autotune results into Triton's cache unless they are there.

    The GPU host's setup script may already have done it; this covers runs without it.
    The tarball is ``$TORCH_DPLR_BENCH_FLA_AUTOTUNE`` or the first of AUTOTUNE_CANDIDATES.
    """
    given = os.environ.get(AUTOTUNE_ENV)
    found = [Path(given)] if given else [p for p in AUTOTUNE_CANDIDATES if p.is_file()]
    if not found or not found[0].is_file():
        return "no autotune tarball found"
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    with tarfile.open(found[0]) as tar:
        missing = [m for m in tar.getmembers() if m.isfile() and not (cache / m.name).exists()]
        if missing:
            cache.mkdir(parents=True, exist_ok=True)
            extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(cache, members=missing, **extra)
    return f"{len(missing)} autotune files unpacked from {found[0].name}" if missing else "present"


def load_fla(args, device) -> tuple[FLA | None, dict]:
    """(FLA, {}) or (None, the field that says why its columns stay null)."""
    if args.no_fla:
        return None, {"fla_skipped": "--no-fla"}
    if device.type != "cuda":
        return None, {"fla_skipped": "FLA needs CUDA"}
    try:
        return FLA(), {}
    except Exception as exc:  # noqa: BLE001  (missing or broken install: report and go on)
        return None, {"fla_error": f"import failed: {_error(exc)}"}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _step(cell, fn, tensors, kwargs, context_fn=None):
    if cell.mode == "fwd":
        return calls.fwd_step(fn, tensors, kwargs)
    return calls.fwd_bwd_step(fn, tensors, kwargs, context_fn)


def time_torch_dplr(cell, tensors, timer) -> dict:
    entry = calls.ENTRY[cell.gates]
    fn = calls.in_dplr_order(entry, getattr(torch_dplr, entry))
    ctx = None if cell.policy == "none" else policies.context_fn(cell.policy)
    step = _step(cell, fn, tensors, calls.call_kwargs(cell, tensors), ctx)
    return timer.measure(step).fields("torch_dplr")


def fla_kwargs(cell, tensors) -> dict:
    """Like with like: FLA keeps intermediates where torch_dplr runs without checkpointing."""
    keep = cell.mode == "fwd_bwd" and cell.policy == "none"
    return dict(calls.call_kwargs(cell, tensors), disable_recompute=keep)


def time_fla(cell, tensors, timer, fla, route) -> dict:
    entry = calls.ENTRY[cell.gates]
    fn = calls.in_dplr_order(entry, fla.entries[entry])
    kwargs = fla_kwargs(cell, tensors)
    fields = {}
    with fla.route(route):
        if route == "tilelang":
            start = time.perf_counter()
            reason = fla.tilelang_refusal(calls.caller(tensors, kwargs, grad=cell.mode == "fwd_bwd"))
            fields = {"fla_tilelang_fallback": reason is not None,
                      "fla_tilelang_probe_s": round(time.perf_counter() - start, 3)}
            if reason is not None:
                return dict(fields, fla_tilelang_fallback_reason=reason)
        fields.update(timer.measure(_step(cell, fn, tensors, kwargs)).fields(f"fla_{route}"))
    return fields


def _rms_ratio(ours, theirs) -> float:
    diff = (ours.float() - theirs.float()).pow(2).mean().sqrt()
    return round((diff / theirs.float().pow(2).mean().sqrt().clamp_min(1e-30)).item(), 6)


def torch_dplr_outputs(cell, inp):
    """torch_dplr's no-grad ``(o, final_state)`` for the cell."""
    entry = calls.ENTRY[cell.gates]
    call = calls.caller(inp, calls.call_kwargs(cell, inp), grad=False)
    return call(calls.in_dplr_order(entry, getattr(torch_dplr, entry)))


def output_diffs(cell, inp, fla, routes) -> dict:
    """RMS(torch_dplr - FLA) / RMS(FLA) of o and the final state, per FLA route timed."""
    entry = calls.ENTRY[cell.gates]
    call = calls.caller(inp, calls.call_kwargs(cell, inp), grad=False)
    o, ht = torch_dplr_outputs(cell, inp)
    out = {}
    for route in routes:
        with fla.route(route):
            o2, ht2 = call(calls.in_dplr_order(entry, fla.entries[entry]))
        diffs = {"o": _rms_ratio(o, o2)}
        if cell.state:
            diffs["final_state"] = _rms_ratio(ht, ht2)
        out[f"diff_vs_fla_{route}"] = diffs
    return out


def summarize(record: dict) -> dict:
    """Adds ratio (faster FLA route over torch_dplr), fla_best_route and its peak memory."""
    times = {r: record[f"fla_{r}_ms"] for r in ROUTES if record.get(f"fla_{r}_ms") is not None}
    best = min(times, key=times.get) if times else None
    ours = record.get("torch_dplr_ms")
    record["fla_best_route"] = best
    record["fla_peak_mb"] = record.get(f"fla_{best}_peak_mb") if best else None
    record["ratio"] = round(times[best] / ours, 3) if best and ours else None
    record["ratio_wind"] = wind_route.ratio(record)
    return record


def _guarded(record: dict, prefix: str, measure) -> None:
    """Runs ``measure()`` into the record; on failure records ``<prefix>_error`` and goes on."""
    try:
        record.update(measure())
    except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the run)
        record[f"{prefix}_error"] = _error(exc)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure_cell(cell, inp, leaves, timer, fla, fla_absent, meta, wind=None, wind_absent=None) -> dict:
    tensors = leaves if cell.mode == "fwd_bwd" else inp
    record = {**cell.fields(), **dict.fromkeys(REQUIRED), **meta,
              "fla_setting": "disable_recompute=True" if fla_kwargs(cell, tensors)["disable_recompute"]
              else "default"}
    _guarded(record, "torch_dplr", lambda: time_torch_dplr(cell, tensors, timer))
    record["torch_dplr_pytorch_stages"] = _pytorch_stages_so_far()
    if fla is None:
        record.update(fla_absent)
    else:
        for route in ROUTES:
            _guarded(record, f"fla_{route}", lambda: time_fla(cell, tensors, timer, fla, route))
    timed = [r for r in ROUTES if record.get(f"fla_{r}_ms") is not None]
    if cell.mode == "fwd" and fla is not None and timed and record.get("torch_dplr_ms") is not None:
        _guarded(record, "diff", lambda: output_diffs(cell, inp, fla, timed))
    if wind is None:
        record.update(wind_absent or {"wind_skipped": "not loaded"})
    else:
        ours = (lambda: torch_dplr_outputs(cell, inp)) if record.get("torch_dplr_ms") is not None else None
        scale = calls.call_kwargs(cell, tensors)["scale"]
        _guarded(record, "wind", lambda: wind_route.measure(cell, inp, tensors, timer, wind, scale, ours))
    return summarize(record)


def _progress(record) -> str:
    if record.get("mode") in stages.RECORD_MODES:
        return stages.progress_line(record)

    def ms(key):
        return "  -   " if record.get(key) is None else f"{record[key]:7.3f}"
    tl = "  fallback" if record.get("fla_tilelang_fallback") else ms("fla_tilelang_ms")
    wind = "   refused" if record.get("wind_refusal") else ms("wind_ms")
    ratio = "   -  " if record.get("ratio") is None else f"{record['ratio']:5.2f}x"
    errors = " ".join(k for k in record if k.endswith("_error"))
    return (f"{record['cell']:<52} dplr {ms('torch_dplr_ms')}  triton {ms('fla_triton_ms')}  "
            f"tilelang {tl}  wind {wind}  ratio {ratio}  {errors}")


def first_call_cell_id(shape) -> str:
    return f"first_call/{shape.label}/c64/rwkv7/state"


PROFILE_TOP = 15  # functions listed per ranking in the first_call record's warm_profile


def _first_call_run(shape, device, cache_dir, timeout, extra=()) -> dict:
    # Python's bytecode cache is part of a warm disk cache: where site-packages cannot be
    # written (the lent GPU host's) the cold run leaves it in the same folder for the warm one
    env = dict(os.environ, TILELANG_CACHE_DIR=str(cache_dir),
               PYTHONPYCACHEPREFIX=str(Path(cache_dir) / "pycache"))
    cmd = [sys.executable, "-m", "benchmarks.first_call", "--device", device.type,
           "--shape", f"{shape.B},{shape.T},{shape.H},{shape.D}", "--chunk-size", "64", *extra]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


def measure_first_call(shape, device, timeout, meta) -> dict:
    """Cold (empty TileLang cache) then warm (the cache the cold run filled), fresh processes;
    then a third, warm and profiled (``warm_profile``: where its first forward+backward's time
    goes, see benchmarks.first_call; its own time is slowed by the profiler)."""
    record = {"cell": first_call_cell_id(shape), "B": shape.B, "T": shape.T, "H": shape.H,
              "D": shape.D, "N": None, "chunk_size": 64, "gates": "rwkv7", "state": True,
              "mode": "first_call", "policy": "none", "cold_s": None, "warm_s": None, **meta}
    with tempfile.TemporaryDirectory(prefix="torch_dplr_bench_tlcache_") as cache_dir:
        for phase in ("cold", "warm"):
            result = _first_call_run(shape, device, cache_dir, timeout)
            if "error" in result:
                record[f"{phase}_error"] = result["error"]
                break
            record.update({f"{phase}_s": result["fwd_bwd_s"], f"{phase}_fwd_s": result["fwd_s"],
                           f"{phase}_new_layout_s": result["new_layout_s"],
                           f"{phase}_import_s": result["import_s"],
                           f"{phase}_dynamo_import_s": result.get("dynamo_import_s"),
                           f"{phase}_kernels_s": result.get("kernels_s")})
        else:
            result = _first_call_run(shape, device, cache_dir, timeout,
                                     ("--profile", str(PROFILE_TOP)))
            record["warm_profile"] = (
                {"fwd_bwd_s": result["fwd_bwd_s"], "kernels_s": result.get("kernels_s"),
                 **result["profile"]} if "profile" in result else {"error": result.get("error")})
    return record


def done_cells(path: Path) -> set[str]:
    """Cells a previous run measured without any error (a stage cell: all its records)."""
    if not path.exists():
        return set()
    records = report.load(path)
    return {r["cell"] for r in records if "cell" in r
            and not any(k.endswith("_error") for k in r)} | stages.done_stage_cells(records)


def done_in(paths) -> set[str]:
    """The cells any of these harness files holds without error."""
    return set().union(*map(done_cells, paths))


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file {text!r}")
    return path


def add_skip_done_in(parser) -> None:
    """``--skip-done-in JSON...`` (bench and prewarm): a run continued on a fresh machine leaves
    out the cells the earlier machine's files hold (see :func:`done_in`)."""
    parser.add_argument("--skip-done-in", type=_existing_file, nargs="+", default=[], metavar="JSON",
                        help="leave out the cells these harness files already hold without error "
                        "(a run continued on another machine)")


def _pick_device(name) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_cells(selected, args, device, fla, fla_absent, meta, sink, skip, wind=None, wind_absent=None) -> None:
    cuda = device.type == "cuda"
    timer = Timer(device, reps=args.reps or (20 if cuda else 3),
                  warmup=(3 if cuda else 0) if args.warmup is None else args.warmup,
                  cap_s=args.cap_s, flush_l2=not args.no_flush)
    for (shape, gates), group in itertools.groupby(selected, key=lambda c: (c.shape, c.gates)):
        todo = [c for c in group if c.id not in skip]
        if not todo:
            continue
        try:
            inp = inputs.make(shape, gates, device)
            leaves = inp.leaves()
        except Exception as exc:  # noqa: BLE001  (e.g. out of memory: record every cell, go on)
            for cell in todo:
                sink({**cell.fields(), **dict.fromkeys(REQUIRED), **meta, "inputs_error": _error(exc)})
            continue
        for cell in todo:
            if cell.mode == cells.STAGE:
                for record in stages.measure(cell, inp, timer, meta):
                    sink(record)
            else:
                sink(measure_cell(cell, inp, leaves, timer, fla, fla_absent, meta, wind, wind_absent))
        del inp, leaves
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = _pick_device(args.device)
    shrink = args.tiny or device.type != "cuda"
    selected = cells.select(cells.envelope(args.policies, args.quick, shrink, stages=True),
                            args.cells, args.modes)
    if args.head_dim is not None:
        selected = [c for c in selected if c.shape.D == args.head_dim]
    if args.shard is not None:
        selected = cells.shard(selected, *args.shard)
    first_shape = cells.first_call_shape(shrink)
    first_call = cells.FIRST_CALL in args.modes and (
        not args.cells or re.search(args.cells, first_call_cell_id(first_shape))) and (
        args.head_dim in (None, first_shape.D))
    if first_call and args.shard is not None:  # its cold compile wants the host to itself
        print("--shard: the first_call cell is left out (run it alone: --modes first_call)",
              file=sys.stderr)
        first_call = False
    if args.list:
        print("\n".join([c.id for c in selected] + ([first_call_cell_id(first_shape)] if first_call else [])))
        return 0
    if device.type != "cuda":
        print("no GPU: every shape is shrunk to a tiny size (a smoke test; the times mean nothing)",
              file=sys.stderr)
    fla, fla_absent = load_fla(args, device)
    if fla is not None:
        print(f"FLA {fla.version}; Triton autotune cache: {install_fla_autotune_cache()}", file=sys.stderr)
    else:
        print(f"FLA: {next(iter(fla_absent.values()))}", file=sys.stderr)
    meta = run_meta(device, fla)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name or device_stem(device)}.json"
    skip = (done_cells(path) if args.resume else set()) | done_in(args.skip_done_in)
    todo = [c for c in selected if c.id not in skip]
    wind, wind_absent = wind_route.load(todo, device, args.head_dim, "--no-wind" if args.no_wind else None)
    meta["wind_rwkv"] = wind.version if wind is not None else None
    print(f"wind_rwkv: head dim {wind.head_dim}, built in {wind.build_s:.0f} s" if wind is not None
          else f"wind_rwkv: {next(iter(wind_absent.values()))}", file=sys.stderr, flush=True)
    if device.type == "cuda" and todo and not args.no_prewarm:
        seconds = prewarm.prewarm(todo, fla=fla is not None,
                                  say=lambda line: print(f"prewarm: {line}", file=sys.stderr, flush=True))
        print(f"prewarm: {seconds:.0f} s", file=sys.stderr, flush=True)
    if device.type == "cuda":
        others = other_gpu_processes(device)
        meta["other_gpu_processes"] = others
        if others:
            print(f"WARNING: other processes use the GPU ({others}); the times are not clean",
                  file=sys.stderr, flush=True)
    with path.open("a" if args.resume else "w") as out:
        def sink(record):
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(_progress(record), flush=True)

        run_cells(selected, args, device, fla, fla_absent, meta, sink, skip, wind, wind_absent)
        if first_call and first_call_cell_id(first_shape) not in skip:
            record = measure_first_call(first_shape, device, args.first_call_timeout, meta)
            out.write(json.dumps(record) + "\n")
            print(f"{record['cell']}: cold {record.get('cold_s')} s, warm {record.get('warm_s')} s",
                  flush=True)
    written = report.write_report(path)
    print(f"json: {path}\n" + "\n".join(f"{k}: {v}" for k, v in written.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
