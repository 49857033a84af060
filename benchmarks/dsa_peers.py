"""TileLang's DeepSeek-V3.2 example kernels (github.com/tile-ai/tilelang, ``examples/deepseek_v32``)
as the peer column of the DSA benchmark (:mod:`benchmarks.dsa`).

What they take (read from their source; every tensor contiguous, batch first):

- ``sparse_mla_fwd.sparse_mla_fwd_interface(q, kv, indices, sm_scale, d_v=512)`` ->
  ``(o, lse)``: ``q [B, S, H, 576]``, ``kv [B, S_kv, G, 576]``, ``indices [B, S, G, k]``
  int32, bf16 only.  A slot counts when its index is at most the query's position ``s`` (one
  causal sequence per batch row); every slot's row is gathered, counted or not.  ``o [B, S, H,
  512]`` bf16, ``lse [B, S, H]`` fp32 in base 2 (``log2 Σ 2^(scale·log2(e)·q·k)``).  ``k`` a
  multiple of 64 (its block of indices); ``H`` padded to a power of two of at least 16, above
  64 a multiple of 64.
- ``sparse_mla_bwd.sparse_mla_bwd(q, kv, o, do, indices, lse, sm_scale)`` -> ``(dq, dkv)``
  bf16: ``d_v`` fixed at 512, ``lse`` in its forward's base 2, no ``dlse``; ``dkv`` is summed
  with fp32 atomics at every slot's index, counted or not (zeros at the others).
- ``fp8_lighting_indexer.mqa_attn_return_logits_interface(q, kv, kv_scales, weights, ks, ke)``
  -> dense ``logits [S, S_kv]`` fp32: ``Σ_h weights · ReLU(q · kv) · kv_scales`` for keys in
  ``[ks[s], ke[s])``, ``-inf`` elsewhere; ``q [S, H, D]``, ``kv [S_kv, D]`` fp8 e4m3 (its only
  dtype), ``kv_scales [S_kv]``, ``weights [S, H]`` fp32, ``ks``, ``ke`` int32; ``128 // H``
  queries per block.  ``utils.per_custom_dims_cast_to_fp8(x, (0,), False)`` makes ``kv`` and its
  per-row scales.
- ``topk_selector.tl_topk(logits, starts, ends, topk)`` -> ``[S, topk]`` int32, the ``topk``
  largest of each row's ``[starts, ends)`` in no order; slots a row cannot fill stay 0.

Our packed ``[T, ...]`` tensors (one sequence) into theirs, made once outside the timed region:
batch 1 and kv group 1 (``q[None]``, ``kv[None, :, None]``); an empty slot (``-1``) becomes
``T``, beyond every query's position, and ``kv`` gets one zero row at ``T`` so that the gathers
and atomics of such slots stay inside it; ``lse`` is converted between natural log and base 2.
The indexer's bf16 ``q_idx`` is cast to e4m3 and ``k_idx`` quantized with the examples' own
helper; ``ks`` is each token's first visible key, ``ke = t + 1``.

The folder (the examples' ``*.py``, or a TileLang checkout holding ``examples/deepseek_v32``)
comes from ``$TORCH_DPLR_TILELANG_EXAMPLES``.  The modules import each other by their short
names (``from utils import ...``), which are bound only while they load.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import torch

from torch_dplr.dsa.reference.layout import key_starts
from torch_dplr.dsa.testing import selection_mask
from torch_dplr.testing import rms_ratio

from .wind_route import _version as commit_stamp

ENV = "TORCH_DPLR_TILELANG_EXAMPLES"
IN_CHECKOUT = Path("examples", "deepseek_v32")
MODULES = ("utils", "sparse_mla_fwd", "sparse_mla_bwd", "fp8_lighting_indexer", "topk_selector")
PREFIX = "tilelang_example"
LOG2E = math.log2(math.e)
MLA_DIMS = (576, 512)
INDEX_BLOCK = 64          # sparse_mla_fwd's block of indices: k must be a multiple
QUERY_HEAD_ROWS = 128     # the indexer's query block holds 128 // H queries
MAX_LOGITS_BYTES = 32e9   # the dense [T, T] fp32 logits beyond this are refused
NO_KERNEL = {
    "indexer": "examples/deepseek_v32 has no kernel for index scores at selected keys or "
               "their backward",
    "indexer_loss": "examples/deepseek_v32 has no KL-loss kernel",
    "dsa_attention": "examples/deepseek_v32 has no indexer backward or KL loss: no composed "
                     "forward+backward",
}
SETTINGS = {
    "sparse_mla": "bf16, batch 1, kv group 1; empty slots point at a zero row appended to kv",
    "indexer_topk": "fp8 e4m3 q_idx and k_idx (a scale per key; its only dtype) from the same "
                    "bf16 inputs; dense [T, T] fp32 logits, then tl_topk",
}


def examples_folder(root) -> Path:
    """The folder holding the examples' modules: ``root`` or its checkout path."""
    root = Path(root)
    for folder in (root, root / IN_CHECKOUT):
        if all((folder / f"{name}.py").is_file() for name in MODULES):
            return folder
    raise ImportError(f"{root} holds neither {', '.join(m + '.py' for m in MODULES)} nor "
                      f"{IN_CHECKOUT}/ with them")


# --- our layouts in theirs -----------------------------------------------------------------

def mla_to_peer(q, kv, indices) -> tuple:
    """``(q [1, T, H, D], kv [1, T + 1, 1, D], indices [1, T, 1, k])``: ``-1`` slots point at
    row ``T`` (after every query, so never counted), a zero row appended to ``kv``."""
    T = q.shape[0]
    rows = torch.cat([kv, kv.new_zeros(1, kv.shape[1])])
    idx = torch.where(indices >= 0, indices, T).to(torch.int32)
    return q[None].contiguous(), rows[None, :, None].contiguous(), idx[None, :, None].contiguous()


def lse_to_peer(lse):
    """Our natural-log ``lse [T, H]`` as their base-2 ``[1, T, H]``."""
    return (lse.float() * LOG2E)[None].contiguous()


def lse_from_peer(lse):
    """Their base-2 ``lse [1, T, H]`` as our natural log ``[T, H]``."""
    return lse[0] / LOG2E


def dkv_from_peer(dkv, T):
    """Their ``dkv [1, T + 1, 1, D]`` as ours ``[T, D]`` (the appended row dropped)."""
    return dkv[0, :T, 0]


def key_ranges(T, cu_seqlens, device) -> tuple:
    """``(ks, ke)`` int32 ``[T]``: each token's visible keys ``[ks, ke)`` (empty for padding)."""
    starts = key_starts(cu_seqlens, T, device).clamp(0, T).to(torch.int32)
    return starts, torch.arange(1, T + 1, dtype=torch.int32, device=device)


def index_to_peer(q_idx, k_idx, w, cu_seqlens, quantize) -> tuple:
    """``(q fp8, k fp8, k_scale, w fp32, ks, ke)``; ``quantize`` is the examples'
    ``per_custom_dims_cast_to_fp8``."""
    k8, k_scale = quantize(k_idx, (0,), False)
    ks, ke = key_ranges(q_idx.shape[0], cu_seqlens, q_idx.device)
    return (q_idx.to(torch.float8_e4m3fn).contiguous(), k8.contiguous(),
            k_scale.float().reshape(-1).contiguous(), w.float().contiguous(), ks, ke)


def selection_overlap(ours, theirs, k) -> float | None:
    """Mean share of our selected keys the peer selected too, over the rows whose ``k`` slots
    are all valid (None: no such row)."""
    T = ours.shape[0]
    full = (ours >= 0).sum(1) == k
    if not bool(full.any()):
        return None
    both = selection_mask(ours, T) & selection_mask(theirs, T)
    return round(float((both.sum(1)[full].double() / k).mean()), 6)


# --- what they can run -----------------------------------------------------------------------

def refusal(cell, dtype=torch.bfloat16) -> str | None:
    """Why the examples cannot run this cell; None: they can."""
    if cell.op in NO_KERNEL:
        return NO_KERNEL[cell.op]
    why = []
    if cell.op == "sparse_mla":
        if dtype != torch.bfloat16:
            why.append(f"{dtype}: the examples take bf16 only")
        if (cell.D_qk, cell.d_v) != MLA_DIMS:
            why.append(f"D_qk {cell.D_qk}, d_v {cell.d_v}: they take {MLA_DIMS[0]} and {MLA_DIMS[1]} only")
        if cell.k % INDEX_BLOCK:
            why.append(f"k {cell.k} is not a multiple of {INDEX_BLOCK} (its block of indices)")
        if cell.H > 64 and cell.H % 64:
            why.append(f"H {cell.H}: above 64 heads a multiple of 64")
    elif cell.op == "indexer_topk":
        if QUERY_HEAD_ROWS % cell.H_idx:
            why.append(f"H_idx {cell.H_idx} does not divide {QUERY_HEAD_ROWS} (its query block)")
        if cell.T * cell.T * 4 > MAX_LOGITS_BYTES:
            why.append(f"its dense [T, T] fp32 logits would take {cell.T * cell.T * 4 / 1e9:.0f} GB")
    return "; ".join(why) or None


class TileLangExamples:
    """The example modules of one folder, called in their own layouts."""

    def __init__(self, modules: dict, version: str = "?"):
        self.modules, self.version = modules, version

    @classmethod
    def load(cls, root=None, require_cuda=True) -> "TileLangExamples":
        """Import the modules from ``root`` (default ``$TORCH_DPLR_TILELANG_EXAMPLES``); raises
        ImportError with the reason when they are unavailable."""
        root = root or os.environ.get(ENV)
        if not root:
            raise ImportError(f"${ENV} is not set (a folder of TileLang's examples/deepseek_v32)")
        folder = examples_folder(root)
        if require_cuda and not torch.cuda.is_available():
            raise ImportError("TileLang's example kernels need CUDA")
        short = {name: sys.modules.get(name) for name in MODULES}
        modules = {}
        try:
            for name in MODULES:
                spec = importlib.util.spec_from_file_location(f"tilelang_examples_dsv32.{name}",
                                                              folder / f"{name}.py")
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                sys.modules[name] = module  # their `from utils import ...`
                spec.loader.exec_module(module)
                modules[name] = module
        except Exception as exc:  # noqa: BLE001  (a module that does not import: say which)
            raise ImportError(f"{name}.py does not import: {type(exc).__name__}: {exc}") from exc
        finally:
            for name, previous in short.items():
                if previous is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = previous
        return cls(modules, commit_stamp(folder, Path(root)))

    def sparse_mla_fwd(self, q, kv, indices, scale, d_v):
        return self.modules["sparse_mla_fwd"].sparse_mla_fwd_interface(q, kv, indices,
                                                                       sm_scale=scale, d_v=d_v)

    def sparse_mla_bwd(self, q, kv, o, do, indices, lse, scale):
        return self.modules["sparse_mla_bwd"].sparse_mla_bwd(q, kv, o, do, indices, lse,
                                                             sm_scale=scale)

    def quantize(self, x, dims, use_ue8m0):
        return self.modules["utils"].per_custom_dims_cast_to_fp8(x, dims, use_ue8m0)

    def index_logits(self, q, k, k_scale, w, ks, ke):
        return self.modules["fp8_lighting_indexer"].mqa_attn_return_logits_interface(
            q, k, k_scale, w, ks, ke)

    def topk(self, logits, ks, ke, topk):
        return self.modules["topk_selector"].tl_topk(logits, ks, ke, topk)


def load(device, skip=None) -> tuple[TileLangExamples | None, dict]:
    """(the examples, {}) or (None, the field that says why their columns stay null):
    ``tilelang_example_skipped`` when not asked for or not runnable here,
    ``tilelang_example_error`` when the folder is given but does not import."""
    if skip:
        return None, {f"{PREFIX}_skipped": skip}
    if device.type != "cuda":
        return None, {f"{PREFIX}_skipped": "TileLang's example kernels need CUDA"}
    if not os.environ.get(ENV):
        return None, {f"{PREFIX}_skipped": f"${ENV} not set (no examples/deepseek_v32 folder)"}
    try:
        return TileLangExamples.load(), {}
    except ImportError as exc:
        return None, {f"{PREFIX}_error": f"load failed: {exc}"}


# --- one cell ----------------------------------------------------------------------------------

def _mla_calls(cell, x, peer):
    """(run, check) of a sparse MLA cell: the timed call and, for fwd and bwd, the RMS ratios
    of its outputs against our op's on the same inputs."""
    q, kv, indices, scale, d_v = x["q"], x["kv"], x["indices"], x["scale"], cell.d_v
    q4, kv4, idx4 = mla_to_peer(q, kv, indices)
    do4 = x["do"][None].contiguous()
    if cell.mode == "fwd":
        def run():
            return peer.sparse_mla_fwd(q4, kv4, idx4, scale, d_v)

        def check():
            o, lse = run()
            o_ref, lse_ref = torch.ops.dsa.sparse_mla_fwd(q, kv, indices, scale, d_v)
            return {"o": round(rms_ratio(o[0], o_ref), 6),
                    "lse": round(rms_ratio(lse_from_peer(lse), lse_ref), 6)}
        return run, check
    if cell.mode == "bwd":
        o4, lse4 = x["o"][None].contiguous(), lse_to_peer(x["lse"])

        def run():
            return peer.sparse_mla_bwd(q4, kv4, o4, do4, idx4, lse4, scale)

        def check():
            dq, dkv = run()
            dq_ref, dkv_ref = torch.ops.dsa.sparse_mla_bwd(q, kv, indices, x["o"], x["lse"],
                                                           x["do"], torch.zeros_like(x["lse"]),
                                                           scale, d_v)
            return {"dq": round(rms_ratio(dq[0], dq_ref), 6),
                    "dkv": round(rms_ratio(dkv_from_peer(dkv, q.shape[0]), dkv_ref), 6)}
        return run, check

    def run():  # fwd_bwd: its forward's o and lse into its backward
        o, lse = peer.sparse_mla_fwd(q4, kv4, idx4, scale, d_v)
        return peer.sparse_mla_bwd(q4, kv4, o, do4, idx4, lse, scale)
    return run, None


def _topk_calls(cell, x, peer):
    args = index_to_peer(x["q_idx"], x["k_idx"], x["w"], x["cu_seqlens"], peer.quantize)
    ks, ke = args[-2:]

    def run():
        return peer.topk(peer.index_logits(*args), ks, ke, cell.k)

    def check():
        ours = torch.ops.dsa.indexer_topk(x["q_idx"], x["k_idx"], x["w"], x["cu_seqlens"], cell.k)
        return {"selection_overlap": selection_overlap(ours, run(), cell.k)}
    return run, check


def measure(cell, x, timer, peer) -> dict:
    """The cell's peer fields: ``tilelang_example_refusal``, or its timing
    (``tilelang_example_ms``, ...), ``tilelang_example_setting`` and ``diff_vs_tilelang_example``
    (RMS(peer - ours) / RMS(ours) of the outputs; the top-k: the share of our keys it selects)."""
    reason = refusal(cell, x["q"].dtype if "q" in x else torch.bfloat16)
    if reason is not None:
        return {f"{PREFIX}_refusal": reason}
    run, check = (_mla_calls if cell.op == "sparse_mla" else _topk_calls)(cell, x, peer)

    def step():
        with torch.no_grad():
            run()
    fields = {f"{PREFIX}_setting": SETTINGS[cell.op], **timer.measure(step).fields(PREFIX)}
    if check is not None:
        with torch.no_grad():
            fields[f"diff_vs_{PREFIX}"] = check()
    return fields
