"""``python -m benchmarks.dsa``: the DSA ops (``torch.ops.dsa.*``) against their PyTorch kernels
and TileLang's DeepSeek-V3.2 example kernels, in one process on the same bf16 inputs.

Cells (one packed sequence; ``--list`` prints the ids, ``--cells REGEX`` picks some):

- ``sparse_mla/{fwd,bwd,fwd_bwd}``: T 8192, 16384, 32768; H 128, 64, 16; k 2048; D_qk 576,
  d_v 512.  ``fwd`` is ``sparse_mla_fwd``, ``bwd`` the ``sparse_mla_bwd`` op alone on the
  forward's ``o`` and ``lse`` (``dlse`` zero), ``fwd_bwd`` both through autograd.
- ``indexer_topk/fwd``: T 8192, H_idx 64, D_idx 128, topk 2048.
- ``indexer/{fwd,fwd_bwd}``: the index scores at the selected keys (``indexer_fwd``, and
  ``indexer_bwd`` through autograd), at the top-k cell's sizes.
- ``indexer_loss/{fwd,fwd_bwd}``: the KL loss (``indexer_loss_fwd``, and its backward into the
  scores) at T 8192-32768, H 128, k 2048, with its peak memory.
- ``dsa_attention/fwd_bwd``: the composed layer with its loss, gradients into all five inputs,
  at T 8192-32768.

The sparse MLA, indexer and loss cells take a random visible selection per query (``min(t + 1,
k)`` distinct keys of ``[0, t]``, ascending, ``-1`` after: the top-k op's layout); the top-k and
the composed cells select their own.

Implementations per cell (columns ``<impl>_ms``, ``_tflops``, ``_peak_mb``, ...):

- ``torch_dplr``: the ops as dispatched (every kernel switch is recorded with the run);
  ``torch_dplr_kernels`` says per op whether its GPU kernel (``tilelang``, or ``triton`` for
  the KL loss's backward) or its PyTorch kernel ran
  (:class:`KernelProbe`).
- ``pytorch``: the same calls under ``TORCH_DPLR_DISABLE_TILELANG=1``, i.e. every op's
  plain-PyTorch kernel (the reference).  A call slower than ``--ref-cap-s`` is timed once on
  the host clock (``pytorch_capped``); on a GPU, a cell whose ops all ran their PyTorch kernel
  reuses torch_dplr's figures (``pytorch_same_kernels``).
- ``tilelang_example``: TileLang's ``examples/deepseek_v32`` kernels
  (:mod:`benchmarks.dsa_peers`), from ``$TORCH_DPLR_TILELANG_EXAMPLES``; a cell they cannot
  run says why (``tilelang_example_refusal``).

``ratio_pytorch`` and ``ratio_tilelang_example`` are that implementation's time over
torch_dplr's (above 1: torch_dplr is faster).

FLOPs (``flops``; TFLOPS = flops / time, the same count for every implementation): matrix
products only, 2 per multiply-add, over all ``T·k`` slots (every kernel computes the empty
ones of the first ``k - 1`` rows too; ``valid_fraction`` is the share that holds a key):

- sparse MLA fwd ``2·T·H·k·(D_qk + d_v)``; bwd ``2·T·H·k·(3·D_qk + 2·d_v)`` (``q·kvᵀ``
  recomputed, ``do·vᵀ``, ``dq``, ``dkv``'s key and value parts: 2.53× the forward at 576/512);
  fwd_bwd their sum;
- indexer top-k ``2·H_idx·D_idx`` per visible (query, key) pair, ``T(T+1)/2`` of them (the
  score products; ReLU, weighting and selection not counted);
- index scores fwd ``2·T·k·H_idx·D_idx``, bwd twice that (``dq_idx``, ``dk_idx``);
- KL loss ``2·T·H·k·D_qk`` (the target's ``q·kv``), its backward none (elementwise);
- dsa_attention: the sum of its ops' (top-k, sparse MLA fwd_bwd, scores fwd_bwd, loss).

Writes JSON lines to ``--out`` (default ``benchmarks/results/<device>-dsa.json``; a folder:
``<device>-dsa.json`` in it), one object per cell as soon as it is measured, and the markdown
``<device>-dsa.md`` beside it (the targets and whether each holds; a ``<stem>-notes.md`` beside
it is appended).  Without a GPU every shape is shrunk (a smoke test: the times mean nothing).

    python -m benchmarks.dsa                       # everything (on the H200: the records)
    python -m benchmarks.dsa --cells 'sparse_mla/fwd' --resume
    python -m benchmarks.dsa --quick --out /tmp/dsa   # T 8192, H 128 only; on the CPU: tiny
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

import torch_dplr.dsa
from torch_dplr.dsa.ops import BACKWARD_OPS, FORWARD_OPS

from . import dsa_peers, harness, report
from .envvars import scoped_env
from .timing import Measurement, Timer

DTYPE = torch.bfloat16
SEQ_TOKENS = (8192, 16384, 32768)
MLA_HEADS = (128, 64, 16)
INDEXER_TOKENS = 8192
LOSS_COEFF = 0.01
MODES = ("fwd", "bwd", "fwd_bwd")
#: The dsa kernels' switches, recorded with a run ("0": that op runs its PyTorch kernel).
KERNEL_SWITCHES = ("TORCH_DPLR_DSA_MLA_FWD_WS", "TORCH_DPLR_DSA_TILELANG_BWD",
                   "TORCH_DPLR_DSA_TILELANG_TOPK", "TORCH_DPLR_DSA_TILELANG_INDEXER",
                   "TORCH_DPLR_DSA_TILELANG_LOSS")
PYTORCH_ONLY = "TORCH_DPLR_DISABLE_TILELANG"
IMPLS = ("torch_dplr", "pytorch", dsa_peers.PREFIX)
# Every record carries these keys, null when not measured.
REQUIRED = tuple(f"{impl}_{field}" for impl in IMPLS for field in ("ms", "tflops", "peak_mb")) + (
    "ratio_pytorch", f"ratio_{dsa_peers.PREFIX}", "torch_dplr_kernels")
OPS = {("sparse_mla", "fwd"): ("sparse_mla_fwd",), ("sparse_mla", "bwd"): ("sparse_mla_bwd",),
       ("sparse_mla", "fwd_bwd"): ("sparse_mla_fwd", "sparse_mla_bwd"),
       ("indexer_topk", "fwd"): ("indexer_topk",), ("indexer", "fwd"): ("indexer_fwd",),
       ("indexer", "fwd_bwd"): ("indexer_fwd", "indexer_bwd"),
       ("indexer_loss", "fwd"): ("indexer_loss_fwd",),
       ("indexer_loss", "fwd_bwd"): ("indexer_loss_fwd", "indexer_loss_bwd"),
       ("dsa_attention", "fwd_bwd"): FORWARD_OPS + BACKWARD_OPS}
# The sizes that name a cell of each op.
LABEL_DIMS = {"sparse_mla": ("H", "k", "D_qk", "d_v"), "indexer_topk": ("H_idx", "D_idx", "k"),
              "indexer": ("H_idx", "D_idx", "k"), "indexer_loss": ("H", "k", "D_qk"),
              "dsa_attention": ("H", "k", "D_qk", "d_v", "H_idx", "D_idx")}
LABELS = {"H": "H", "k": "k", "D_qk": "D", "d_v": "V", "H_idx": "Hi", "D_idx": "Di"}


@dataclasses.dataclass(frozen=True)
class Cell:
    op: str
    mode: str
    T: int
    H: int = 128
    k: int = 2048
    D_qk: int = 576
    d_v: int = 512
    H_idx: int = 64
    D_idx: int = 128

    @property
    def id(self) -> str:
        dims = "-".join(f"{LABELS[d]}{getattr(self, d)}" for d in LABEL_DIMS[self.op])
        return f"{self.op}/{self.mode}/T{self.T}-{dims}"

    @property
    def ops(self) -> tuple:
        return OPS[(self.op, self.mode)]

    def fields(self) -> dict:
        return {"cell": self.id, **dataclasses.asdict(self), "dtype": "bf16"}


def tiny(cell: Cell) -> Cell:
    """The same cell at a size a CPU runs in a fraction of a second (distinct per cell)."""
    return dataclasses.replace(cell, T=cell.T // 64, H=max(1, cell.H // 16), k=64)


def all_cells(quick=False, shrink=False) -> list[Cell]:
    """Every cell; ``quick``: T 8192 and H 128 only."""
    tokens = SEQ_TOKENS[:1] if quick else SEQ_TOKENS
    heads = MLA_HEADS[:1] if quick else MLA_HEADS
    cells = [Cell("sparse_mla", mode, T, H) for H in heads for T in tokens for mode in MODES]
    cells.append(Cell("indexer_topk", "fwd", INDEXER_TOKENS))
    cells += [Cell("indexer", mode, INDEXER_TOKENS) for mode in ("fwd", "fwd_bwd")]
    cells += [Cell("indexer_loss", mode, T) for T in tokens for mode in ("fwd", "fwd_bwd")]
    cells += [Cell("dsa_attention", "fwd_bwd", T) for T in tokens]
    return [tiny(c) for c in cells] if shrink else cells


def select(cells, pattern) -> list[Cell]:
    regex = re.compile(pattern) if pattern else None
    return [c for c in cells if regex is None or regex.search(c.id)]


# --- FLOPs -------------------------------------------------------------------------------------

def sparse_mla_flops(T, H, k, D_qk, d_v, mode) -> int:
    fwd = 2 * T * H * k * (D_qk + d_v)
    bwd = 2 * T * H * k * (3 * D_qk + 2 * d_v)
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]


def visible_pairs(T) -> int:
    """(query, key) pairs a causal sequence of T tokens scores."""
    return T * (T + 1) // 2


def valid_slots(T, k) -> int:
    """Slots that hold a key when row t selects ``min(t + 1, k)``."""
    full_from = min(T, k)
    return full_from * (full_from + 1) // 2 + (T - full_from) * k


def cell_flops(c: Cell) -> int:
    index_scores = 2 * c.T * c.k * c.H_idx * c.D_idx
    loss = 2 * c.T * c.H * c.k * c.D_qk
    if c.op == "sparse_mla":
        return sparse_mla_flops(c.T, c.H, c.k, c.D_qk, c.d_v, c.mode)
    if c.op == "indexer_topk":
        return 2 * c.H_idx * c.D_idx * visible_pairs(c.T)
    if c.op == "indexer":
        return index_scores * (1 if c.mode == "fwd" else 3)
    if c.op == "indexer_loss":
        return loss
    return (2 * c.H_idx * c.D_idx * visible_pairs(c.T) + index_scores * 3 + loss
            + sparse_mla_flops(c.T, c.H, c.k, c.D_qk, c.d_v, "fwd_bwd"))


def tflops(flops, ms) -> float | None:
    return None if not ms else float(f"{flops / (ms * 1e9):.4g}")


# --- inputs --------------------------------------------------------------------------------------

def random_indices(T, k, gen, device, block=1024) -> torch.Tensor:
    """``[T, k]`` int32: per row ``min(t + 1, k)`` distinct random keys of ``[0, t]``,
    ascending, then ``-1`` (the top-k op's layout); no ``[T, T]`` tensor."""
    out = torch.full((T, k), -1, dtype=torch.int32, device=device)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        rows = torch.arange(t0, t1, device=device)[:, None]
        draw = torch.rand(t1 - t0, t1, generator=gen, device=device)
        draw.masked_fill_(torch.arange(t1, device=device)[None] > rows, -1.0)  # never above a visible key
        values, picked = draw.topk(min(k, t1), dim=1)
        picked = torch.where(values >= 0, picked, T).sort(dim=1).values
        out[t0:t1, :picked.shape[1]] = torch.where(picked == T, -1, picked).to(torch.int32)
    return out


def make_inputs(cell: Cell, device, seed=0) -> dict:
    """The cell's tensors, drawn on the device; derived ones (``o``, ``lse``, ``scores``) from
    torch_dplr's ops."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=DTYPE):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    c, ops = cell, torch.ops.dsa
    x = {"scale": c.D_qk ** -0.5, "cu_seqlens": torch.empty(0, dtype=torch.int64, device=device)}
    if c.op != "indexer_topk" and c.op != "indexer":
        x.update(q=randn(c.T, c.H, c.D_qk), kv=randn(c.T, c.D_qk), do=randn(c.T, c.H, c.d_v))
    if c.op != "sparse_mla":
        x.update(q_idx=randn(c.T, c.H_idx, c.D_idx), k_idx=randn(c.T, c.D_idx),
                 w=randn(c.T, c.H_idx, scale=(c.H_idx * c.D_idx) ** -0.5))
    if c.op in ("sparse_mla", "indexer", "indexer_loss"):
        x["indices"] = random_indices(c.T, c.k, gen, device)
    if (c.op, c.mode) == ("sparse_mla", "bwd") or c.op == "indexer_loss":
        with torch.no_grad():
            x["o"], x["lse"] = ops.sparse_mla_fwd(x["q"], x["kv"], x["indices"], x["scale"], c.d_v)
    if c.op == "indexer_loss":
        with torch.no_grad():
            x["scores"] = ops.indexer_fwd(x["q_idx"], x["k_idx"], x["w"], x["indices"])
    if c.op == "indexer":
        x["dscores"] = randn(c.T, c.k, dtype=torch.float32)
    return x


# --- the timed calls -------------------------------------------------------------------------------

def _no_grad(fn):
    def step():
        with torch.no_grad():
            fn()
    return step


def _forward_backward(forward, inputs, cotangents):
    """``forward(*leaves)`` -> outputs, then ``torch.autograd.grad`` into fresh leaves of
    ``inputs`` (nothing accumulates between reps)."""
    leaves = [t.detach().requires_grad_() for t in inputs]

    def step():
        with torch.enable_grad():
            torch.autograd.grad(forward(*leaves), leaves, cotangents)
    return step


def torch_dplr_step(cell: Cell, x: dict):
    """The cell's call through ``torch.ops.dsa`` (``dsa_attention``: the public function)."""
    c, ops, s = cell, torch.ops.dsa, x["scale"]
    if c.op == "sparse_mla":
        if c.mode == "fwd":
            return _no_grad(lambda: ops.sparse_mla_fwd(x["q"], x["kv"], x["indices"], s, c.d_v))
        if c.mode == "bwd":
            no_dlse = torch.zeros_like(x["lse"])
            return _no_grad(lambda: ops.sparse_mla_bwd(x["q"], x["kv"], x["indices"], x["o"],
                                                       x["lse"], x["do"], no_dlse, s, c.d_v))
        return _forward_backward(lambda q, kv: ops.sparse_mla_fwd(q, kv, x["indices"], s, c.d_v)[0],
                                 (x["q"], x["kv"]), x["do"])
    if c.op == "indexer_topk":
        return _no_grad(lambda: ops.indexer_topk(x["q_idx"], x["k_idx"], x["w"], x["cu_seqlens"], c.k))
    if c.op == "indexer":
        index = (x["q_idx"], x["k_idx"], x["w"])
        if c.mode == "fwd":
            return _no_grad(lambda: ops.indexer_fwd(*index, x["indices"]))
        return _forward_backward(lambda *leaves: ops.indexer_fwd(*leaves, x["indices"]), index,
                                 x["dscores"])
    if c.op == "indexer_loss":
        def loss(scores):
            return ops.indexer_loss_fwd(scores, x["q"], x["kv"], x["indices"], x["lse"], s,
                                        LOSS_COEFF, "mean")[0]
        if c.mode == "fwd":
            return _no_grad(lambda: loss(x["scores"]))
        return _forward_backward(loss, (x["scores"],), None)

    def layer(q, kv, q_idx, k_idx, w):
        out = torch_dplr.dsa.dsa_attention(q, kv, q_idx, k_idx, w, topk=c.k, scale=s, d_v=c.d_v,
                                           indexer_loss_coeff=LOSS_COEFF)
        return out.o, out.indexer_loss
    inputs = tuple(x[n] for n in ("q", "kv", "q_idx", "k_idx", "w"))
    return _forward_backward(layer, inputs, (x["do"], torch.ones((), device=x["q"].device)))


# --- which kernel ran ----------------------------------------------------------------------------

def _opdef(op: str):
    from torch._library.custom_ops import OPDEFS
    return OPDEFS[f"dsa::{op}"]


def has_cuda_kernel(op: str) -> bool:
    return "cuda" in _opdef(op)._backend_fns


#: The ops whose CUDA function runs a Triton kernel (the others: TileLang).
GPU_KERNEL_KIND = {"indexer_loss_bwd": "triton"}


class KernelProbe:
    """Which kernel each ``dsa`` op ran.  An op's CUDA function falls back by calling the
    PyTorch kernel the op was defined from, a global of its module (the one
    ``torch_dplr.dsa.testing.forbid_pytorch_kernels`` replaces); inside the probe each of those
    counts its calls.  An op without a CUDA kernel, or on another device, ran its PyTorch
    kernel."""

    def __init__(self, ops):
        self.ops = tuple(ops)
        self.calls = dict.fromkeys(self.ops, 0)
        self._saved = []

    def __enter__(self):
        for op in self.ops:
            reference = _opdef(op)._init_fn
            module = sys.modules[reference.__module__]

            def counting(*args, _op=op, _fn=reference, **kwargs):
                self.calls[_op] += 1
                return _fn(*args, **kwargs)
            self._saved.append((module, reference.__name__, getattr(module, reference.__name__)))
            setattr(module, reference.__name__, counting)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def kernels(self, device_type: str) -> dict:
        return {op: GPU_KERNEL_KIND.get(op, "tilelang")
                if device_type == "cuda" and has_cuda_kernel(op) and not self.calls[op]
                else "pytorch" for op in self.ops}


# --- one cell ------------------------------------------------------------------------------------

def measure_torch_dplr(cell, step, timer) -> dict:
    with KernelProbe(cell.ops) as probe:
        fields = timer.measure(step).fields("torch_dplr")
    kernels = probe.kernels(timer.device.type)
    return dict(fields, torch_dplr_kernels=kernels,
                torch_dplr_pytorch_ops=[op for op, k in kernels.items() if k == "pytorch"])


def measure_reference(step, timer, cap_s) -> dict:
    """The same call on the PyTorch kernels; one call over ``cap_s`` is the measurement."""
    with scoped_env(PYTORCH_ONLY, "1"):
        start = time.perf_counter()
        peak = timer.peak_mb(step)
        once_s = time.perf_counter() - start
        if once_s <= cap_s:
            return timer.measure(step).fields("pytorch")
    ms = once_s * 1e3
    return dict(Measurement(ms, 1, once_s, ms, ms, peak).fields("pytorch"),
                pytorch_capped=f"one call took {once_s:.1f} s > --ref-cap-s {cap_s:g}: timed "
                               f"once, host clock")


def reference_fields(cell, step, timer, record, options) -> dict:
    if options.no_reference:
        return {"pytorch_skipped": "--no-reference"}
    if options.ref_max_tokens is not None and cell.T > options.ref_max_tokens:
        return {"pytorch_skipped": f"T {cell.T} > --ref-max-tokens {options.ref_max_tokens}"}
    if timer.device.type == "cuda" and record.get("torch_dplr_pytorch_ops") == list(cell.ops):
        same = {k.replace("torch_dplr_", "pytorch_", 1): v for k, v in record.items()
                if k.startswith("torch_dplr_") and k[len("torch_dplr_"):] in
                ("ms", "peak_mb", "reps", "first_call_s", "spread_ms")}
        return dict(same, pytorch_same_kernels="no TileLang kernel ran: torch_dplr's figures")
    return measure_reference(step, timer, options.ref_cap_s)


def summarize(record: dict) -> dict:
    """TFLOPS of every timed implementation, and the ratios over torch_dplr's time."""
    ours = record.get("torch_dplr_ms")
    for impl in IMPLS:
        record[f"{impl}_tflops"] = tflops(record["flops"], record.get(f"{impl}_ms"))
        if impl != "torch_dplr":
            theirs = record.get(f"{impl}_ms")
            record[f"ratio_{impl}"] = round(theirs / ours, 3) if theirs and ours else None
    return record


def measure_cell(cell, x, timer, peer, peer_absent, meta, options) -> dict:
    record = {**cell.fields(), **dict.fromkeys(REQUIRED), **meta, "flops": cell_flops(cell),
              "valid_fraction": None if cell.op == "indexer_topk"
              else round(valid_slots(cell.T, cell.k) / (cell.T * cell.k), 4)}
    step = torch_dplr_step(cell, x)
    harness._guarded(record, "torch_dplr", lambda: measure_torch_dplr(cell, step, timer))
    harness._guarded(record, "pytorch", lambda: reference_fields(cell, step, timer, record, options))
    if peer is None:
        record.update(peer_absent)
    else:
        harness._guarded(record, dsa_peers.PREFIX, lambda: dsa_peers.measure(cell, x, timer, peer))
    return summarize(record)


# --- the markdown ----------------------------------------------------------------------------------

MLA_TARGETS = {"fwd": 550.0, "bwd": 230.0}  # TFLOPS at H 128
TOPK_TARGET = 5.0                            # x the PyTorch kernel
FLAT_PEAK = 1.25  # O(T·k): peak / (T·k·4 B) may grow at most this much from the smallest T


# The sizes the targets are set at (smaller records, e.g. a CPU smoke run, are not judged).
ISSUE_MLA = dict(H=128, k=2048, D_qk=576, d_v=512)
ISSUE_INDEXER = dict(T=INDEXER_TOKENS, H_idx=64, D_idx=128, k=2048)
ISSUE_LOSS = dict(H=128, k=2048, D_qk=576)


def _at(record, sizes) -> bool:
    return all(record.get(key) == value for key, value in sizes.items())


def _kernel_note(rows) -> str:
    fell = sorted({op for r in rows for op in (r.get("torch_dplr_pytorch_ops") or [])})
    return f" (PyTorch kernel ran: {', '.join(fell)})" if fell else ""


def target_rows(records) -> list[tuple[str, str, bool | None]]:
    """(target, measured, holds) for each target the records cover."""
    out = []
    for mode, bound in MLA_TARGETS.items():
        rows = [r for r in records if r.get("op") == "sparse_mla" and r.get("mode") == mode
                and _at(r, ISSUE_MLA) and r.get("T") in SEQ_TOKENS
                and r.get("torch_dplr_tflops") is not None]
        if rows:
            worst = min(r["torch_dplr_tflops"] for r in rows)
            measured = ", ".join(f"T{r['T']} {r['torch_dplr_tflops']:.0f}" for r in rows)
            out.append((f"sparse MLA {'forward' if mode == 'fwd' else 'backward'} >= {bound:g} "
                        f"TFLOPS (H 128, k 2048)", measured + _kernel_note(rows), worst >= bound))
    for r in records:
        if (r.get("op") == "indexer_topk" and _at(r, ISSUE_INDEXER)
                and r.get("ratio_pytorch") is not None):
            out.append((f"indexer top-k >= {TOPK_TARGET:g}x the PyTorch kernel (T {r['T']}, "
                        f"H_idx {r['H_idx']}, D_idx {r['D_idx']})",
                        f"{r['ratio_pytorch']:.2f}x ({r['torch_dplr_ms']:.3f} vs "
                        f"{r['pytorch_ms']:.3f} ms){_kernel_note([r])}",
                        r["ratio_pytorch"] >= TOPK_TARGET))
    rows = sorted((r for r in records if r.get("op") == "indexer_loss" and r.get("mode") == "fwd_bwd"
                   and _at(r, ISSUE_LOSS) and r.get("torch_dplr_peak_mb") is not None),
                  key=lambda r: r["T"])
    if rows:
        per_slot = [r["torch_dplr_peak_mb"] * 1e6 / (r["T"] * r["k"] * 4) for r in rows]
        square = all(r["torch_dplr_peak_mb"] * 1e6 < r["T"] * r["T"] * 4 for r in rows)
        flat = per_slot[-1] <= FLAT_PEAK * per_slot[0]
        out.append(("KL loss fwd+bwd peak memory O(T·k): below one [T, T] fp32, and peak / "
                    f"(T·k·4 B) growing at most {FLAT_PEAK:g}x over T",
                    ", ".join(f"T{r['T']} {r['torch_dplr_peak_mb']:.0f} MB = {x:.2f}"
                              for r, x in zip(rows, per_slot)), square and flat))
    return out


def _cell_num(r, impl, key="ms"):
    if r.get(f"{impl}_refusal"):
        return "refused"
    value = report._num(r.get(f"{impl}_{key}"), "{:.3f}" if key == "ms" else "{:.3g}")
    return value + ("*" if key == "ms" and r.get(f"{impl}_capped") else "")


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}x"


def _kernels(r) -> str:
    kernels = r.get("torch_dplr_kernels") or {}
    kinds = set(kernels.values())
    return "–" if not kinds else kinds.pop() if len(kinds) == 1 else ", ".join(
        f"{op}: {k}" for op, k in kernels.items())


def op_table(rows) -> list[str]:
    ex = dsa_peers.PREFIX
    lines = ["| cell | kernel | torch_dplr ms | TFLOPS | PyTorch ms | TFLOPS | PyTorch / ours "
             "| TileLang example ms | TFLOPS | example / ours | peak MB ours / PyTorch / example "
             "| example vs ours |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peaks = " / ".join(report._num(r.get(f"{i}_peak_mb"), "{:.0f}") for i in IMPLS)
        diff = r.get(f"diff_vs_{ex}")
        diff = ", ".join(f"{k} {v:.3g}" for k, v in diff.items() if v is not None) if diff else "–"
        lines.append(f"| `{r['cell']}` | {_kernels(r)} | {_cell_num(r, 'torch_dplr')} "
                     f"| {_cell_num(r, 'torch_dplr', 'tflops')} | {_cell_num(r, 'pytorch')} "
                     f"| {_cell_num(r, 'pytorch', 'tflops')} | {_ratio(r.get('ratio_pytorch'))} "
                     f"| {_cell_num(r, ex)} | {_cell_num(r, ex, 'tflops')} "
                     f"| {_ratio(r.get(f'ratio_{ex}'))} | {peaks} | {diff} |")
    return lines


SECTIONS = (("sparse_mla", "Sparse MLA"), ("indexer_topk", "Indexer top-k"),
            ("indexer", "Index scores at the selected keys"), ("indexer_loss", "KL loss"),
            ("dsa_attention", "dsa_attention (indexer, top-k, sparse MLA, loss), forward+backward"))


def _switches(record) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in (record.get("switches") or {}).items()
                     if v is not None) or "no kernel switch set"


def _per_value(records, value) -> str:
    """``value(record)`` when the records agree on it, else each value with its ops."""
    ops: dict[str, list] = {}
    for r in records:
        ops.setdefault(value(r), []).append(r.get("op"))
    if len(ops) == 1:
        return next(iter(ops))
    return "; ".join(f"{v} ({', '.join(dict.fromkeys(o))})" for v, o in ops.items())


def _preamble(records) -> list[str]:
    meta = next((r for r in records if r.get("device")), {})
    cuda = meta.get("device", "cpu") != "cpu"
    measured = [r for r in records if r.get("device")] or [meta]
    switches = _per_value(measured, _switches)
    git = _per_value(measured, lambda r: r.get("git") or "?")
    clock = ("CUDA events, L2 flushed between reps" if cuda
             else "host clock (CPU smoke test at tiny sizes: the times mean nothing)")
    return [f"# DSA ops: torch_dplr vs its PyTorch kernels and TileLang's examples on "
            f"{meta.get('device', '?')}", "",
            f"torch {meta.get('torch', '?')}, torch_dplr {meta.get('torch_dplr', '?')} "
            f"(git {git}), TileLang {meta.get('tilelang') or '?'}, "
            f"examples/deepseek_v32 at {meta.get('tilelang_examples') or '(not run)'}; {switches}. "
            f"bf16 inputs, one packed sequence. Times: median over reps, {clock}; `*`: a PyTorch "
            "call over the cap, timed once. TFLOPS: matrix products over all T·k slots, the same "
            "count for every column (the docstring of benchmarks/dsa.py). Ratios: that column's "
            "time over torch_dplr's (above 1: torch_dplr is faster). kernel: which kernel "
            "torch_dplr's ops ran. Peak: CUDA memory one call allocates above what was "
            "allocated before it, MB."]


def markdown(records) -> str:
    lines = _preamble(records)
    lines += ["", "## Targets", "", "| target | measured | holds |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {report._verdict(ok)} |" for t, m, ok in target_rows(records)]
    for op, title in SECTIONS:
        rows = [r for r in records if r.get("op") == op]
        if rows:
            lines += ["", f"## {title}", ""] + op_table(rows)
    reasons: dict[str, int] = {}
    for r in records:
        why = r.get(f"{dsa_peers.PREFIX}_refusal") or r.get(f"{dsa_peers.PREFIX}_skipped")
        if why:
            reasons[why] = reasons.get(why, 0) + 1
    if reasons:
        lines += ["", "## Cells TileLang's examples do not run", "", "| cells | reason |", "|---|---|"]
        lines += [f"| {n} | {why} |" for why, n in reasons.items()]
    failed = [r for r in records if report._errors(r)]
    if failed:
        lines += ["", "## Errors", ""] + [f"- `{r.get('cell')}`: {report._errors(r)}" for r in failed]
    return "\n".join(lines) + "\n"


def write_report(path) -> Path:
    """``<stem>.md`` beside the JSON lines (with ``<stem>-notes.md`` appended when present)."""
    path = Path(path)
    md = path.with_suffix(".md")
    notes = path.with_name(f"{path.stem}-notes.md")
    md.write_text(markdown(report.load(path)) + ("\n" + notes.read_text() if notes.is_file() else ""))
    return md


# --- the CLI ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dsa", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="JSON-lines file, or a folder for <device>-dsa.json "
                   "(default benchmarks/results/<device>-dsa.json)")
    p.add_argument("--cells", help="regular expression on cell ids (see --list)")
    p.add_argument("--list", action="store_true", help="print the selected cell ids and exit")
    p.add_argument("--quick", action="store_true", help="T 8192 and H 128 only")
    p.add_argument("--resume", action="store_true",
                   help="append to --out, skipping cells it already holds without error")
    p.add_argument("--report", action="store_true", help="only write the markdown of --out's records")
    p.add_argument("--reps", type=int, help="timed repetitions (default 20; 3 on the CPU)")
    p.add_argument("--warmup", type=int, help="warm-up calls after the first (default 3; 0 on the CPU)")
    p.add_argument("--cap-s", type=float, default=20.0, help="time cap of one implementation's reps "
                   "in one cell (default %(default)s)")
    p.add_argument("--ref-cap-s", type=float, default=5.0, help="a PyTorch-kernel call slower than "
                   "this is timed once instead of repeated (default %(default)s)")
    p.add_argument("--ref-max-tokens", type=int, help="leave the PyTorch kernels out of cells "
                   "with more tokens")
    p.add_argument("--no-reference", action="store_true", help="leave the PyTorch kernels out")
    p.add_argument("--no-examples", action="store_true", help="leave TileLang's examples out")
    p.add_argument("--no-flush", action="store_true", help="do not flush the L2 between reps")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--tiny", action="store_true", help="shrink every shape (implied on the CPU)")
    return p.parse_args(argv)


def output_path(out, device) -> Path:
    name = f"{harness.device_stem(device)}-dsa.json"
    if out is None:
        return harness.DEFAULT_OUT / name
    return out / name if out.is_dir() or not out.suffix else out


def run_meta(device, peer) -> dict:
    meta = harness.card_meta(device)
    try:
        import tilelang
        meta["tilelang"] = tilelang.__version__
    except Exception:  # noqa: BLE001  (metadata only)
        meta["tilelang"] = None
    meta["tilelang_examples"] = peer.version if peer is not None else None
    meta["switches"] = {name: os.environ.get(name) for name in KERNEL_SWITCHES + (PYTORCH_ONLY,)}
    if device.type == "cuda":
        meta["other_gpu_processes"] = harness.other_gpu_processes(device)
    return meta


def _progress(r) -> str:
    def ms(impl):
        return f"{_cell_num(r, impl):>9}"
    errors = " ".join(k for k in r if k.endswith("_error"))
    return (f"{r['cell']:<58} dplr {ms('torch_dplr')} ({_kernels(r)})  pytorch {ms('pytorch')}  "
            f"example {ms(dsa_peers.PREFIX)}  TFLOPS {report._num(r.get('torch_dplr_tflops'), '{:.1f}')}"
            f"  {errors}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = harness._pick_device(args.device)
    shrink = args.tiny or device.type != "cuda"
    selected = select(all_cells(args.quick, shrink), args.cells)
    if args.list:
        print("\n".join(c.id for c in selected))
        return 0
    path = output_path(args.out, device)
    if args.report:
        print(f"md: {write_report(path)}")
        return 0
    if device.type != "cuda":
        print("no GPU: every shape is shrunk to a tiny size (a smoke test; the times mean nothing)",
              file=sys.stderr)
    return _run(args, device, selected, path)


def _run(args, device, selected, path) -> int:
    peer, peer_absent = dsa_peers.load(device, "--no-examples" if args.no_examples else None)
    print(f"TileLang examples: {peer.version if peer else next(iter(peer_absent.values()))}",
          file=sys.stderr, flush=True)
    meta = run_meta(device, peer)
    cuda = device.type == "cuda"
    timer = Timer(device, reps=args.reps or (20 if cuda else 3),
                  warmup=(3 if cuda else 0) if args.warmup is None else args.warmup,
                  cap_s=args.cap_s, flush_l2=not args.no_flush)
    skip = harness.done_cells(path) if args.resume else set()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if args.resume else "w") as out:
        for cell in selected:
            if cell.id in skip:
                continue
            try:
                x = make_inputs(cell, device)
            except Exception as exc:  # noqa: BLE001  (e.g. out of memory: record it, go on)
                record = {**cell.fields(), **dict.fromkeys(REQUIRED), **meta,
                          "inputs_error": harness._error(exc)}
            else:
                record = measure_cell(cell, x, timer, peer, peer_absent, meta, args)
                del x
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(_progress(record), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    print(f"json: {path}\nmd: {write_report(path)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
