"""wind_rwkv's ``chunked_cuda`` RWKV-7 kernel (github.com/johanwind/wind_rwkv) as a third column.

What its ``wind_rwkv/rwkv7/chunked_cuda`` computes and takes (read from its source):

- ``attn_chunked_cuda(r, w, k, v, a, b, s0=None) -> (y, sT)``, an autograd Function over two
  CUDA kernels (one forward, one backward; grid ``(H, B)``, chunks of 16 tokens).  Its op
  ``torch.ops.wind_chunked_cuda.forward`` takes ``w`` first; the Python wrapper takes ``r`` first.
- Per token, with the state ``s`` laid out ``[B, H, V, K]`` (value rows, key columns):
  ``s_t = s_{t-1} diag(exp(-exp(w_t))) + (s_{t-1} a_t) b_tᵀ + v_t k_tᵀ``, ``y_t = s_t r_t``.
  No scale argument.
- torch_dplr (FLA's convention), state ``S`` ``[K, V]``:
  ``S_t = diag(exp(gk_t)) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.
  So ``s = Sᵀ``, ``r = scale · q``, ``w = log(-gk)``, and ``k, v, a, b`` pass unchanged:
  ``a`` multiplies the old state and ``b`` is the outer factor in both, with the same signs
  (RWKV-7: ``a = -kk``, ``b = kk·iclr``; wind's tests draw ``a = kk``, ``b = -kk·iclr``, the
  same product ``a bᵀ``).  ``gk == 0`` maps to ``w = -inf``, a decay of exactly 1.
- Every input, ``s0`` included, is bf16, contiguous, ``[B, T, H, C]`` (so ``K == V == C``),
  with ``T % 16 == 0``; ``y`` and ``sT`` come back bf16.  It always takes an initial state
  (zeros when None) and always returns the final state.  bf16 ``w`` carries ``-gk`` to a
  relative ``|w|·2⁻⁹``; torch_dplr keeps the gates and the state in fp32.
- Training: the forward also stores the bf16 state at every chunk start (``[B, H, T/16, C, C]``);
  the backward kernel recomputes inside each chunk and returns the gradients of all seven
  inputs (``s0``'s included).  There is no other save/recompute trade.
- The kernel forms the running product of a chunk's decays and its reciprocal in fp32 (fast
  math), with no lower-bound option: a chunk whose log decays sum below about -87 (fp32's
  smallest normal) gives inf/NaN.  RWKV-7's gates (``>= -0.6065`` a token, ``>= -9.7`` a chunk)
  are far from it; the envelope's unbounded gates (down to -40 a token) are not.
- Head size: a compile-time constant (``-D_C_=C``, ``torch.utils.cpp_extension.load`` with
  nvcc and ninja).  ``load_chunked_cuda(C)`` returns at once when the op is already loaded,
  whatever size it was built for: one head size per process.
- Variable-length batches: none in ``chunked_cuda``.  The separate ``chunked_cuda_varlen``
  (``[T, H, C]`` inputs, int64 ``cu_seqlens`` with every offset a multiple of 16, its own
  build) is not used here: the envelope's sequence lengths are not multiples of 16.
- Its kernel indexes with 32-bit ints: ``B·T·H·C`` and ``B·H·(T/16)·C·C`` must stay below 2³¹.

The op's source folder (``chunked_cuda.py``, ``.cpp``, ``.cu``, ``tile.cuh``; or a checkout
holding ``wind_rwkv/rwkv7/chunked_cuda``) comes from ``$TORCH_DPLR_WIND_RWKV``.  Its module is
imported from that file alone (the package's ``__init__`` would import every kernel), and it is
built under ``$TORCH_DPLR_WIND_BUILD`` (default ``<tmp>/torch_dplr_wind``) in a folder per head
size, so that processes of different head sizes never share one build.
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from torch_dplr.testing import rms_ratio

from .cells import MODES, Cell
from .envvars import scoped_env
from .inputs import Inputs, varlen_offsets

ENV = "TORCH_DPLR_WIND_RWKV"
BUILD_ENV = "TORCH_DPLR_WIND_BUILD"
CHUNK = 16
FILES = ("chunked_cuda.py", "chunked_cuda.cpp", "chunked_cuda.cu", "tile.cuh")
IN_CHECKOUT = Path("wind_rwkv", "rwkv7", "chunked_cuda")
# Below this summed log decay over one chunk the kernel's fp32 decay product nears fp32's
# smallest normal (e^-87.3); the margin leaves room for the k and b factors it multiplies.
LOG_DECAY_FLOOR = -80.0
INT32_MAX = 2 ** 31 - 1
SETTING = {"fwd": "no grad: y and sT only",
           "fwd_bwd": "keeps the bf16 state every 16 tokens (its only trade, whatever the policy)"}


def op_folder(root) -> Path:
    """The folder holding ``chunked_cuda.py`` and its sources: ``root`` or its checkout path."""
    root = Path(root)
    for folder in (root, root / IN_CHECKOUT):
        if all((folder / f).is_file() for f in FILES):
            return folder
    raise ImportError(f"{root} holds neither {', '.join(FILES)} nor {IN_CHECKOUT}/ with them")


# --- our arguments in wind's conventions -------------------------------------------------

def _wide(dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_to_wind(h: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """``[N, H, K, V]`` -> wind's ``[N, H, V, K]`` (contiguous: its wrapper asserts it)."""
    return h.transpose(-1, -2).to(dtype).contiguous()


def state_from_wind(s: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """wind's ``[N, H, V, K]`` -> ``[N, H, K, V]``."""
    return s.transpose(-1, -2).to(dtype)


def to_wind(q, k, v, a, b, gk, scale, initial_state=None, dtype=torch.bfloat16) -> tuple:
    """wind's ``(r, w, k, v, a, b, s0)`` for our call; differentiable, so gradients flow back
    to our inputs.  The products are taken in fp32 (fp64 for fp64) and rounded once."""
    wide = _wide(dtype)
    r = (q.to(wide) * scale).to(dtype)
    w = torch.log(-gk.to(wide)).to(dtype)
    B, _, H, K = q.shape
    V = v.shape[-1]
    s0 = (state_to_wind(initial_state.to(wide), dtype) if initial_state is not None
          else torch.zeros(B, H, V, K, dtype=dtype, device=q.device))
    return (r, w, *(x.to(dtype).contiguous() for x in (k, v, a, b)), s0)


def min_chunk_log_decay(gk: torch.Tensor) -> float:
    """The smallest sum of ``gk`` over one 16-token chunk of one channel (``T % 16 == 0``)."""
    B, T, H, K = gk.shape
    return gk.float().reshape(B, T // CHUNK, CHUNK, H, K).sum(2).min().item()


def refusal(cell: Cell, head_dim: int, tensors: Inputs | None = None) -> str | None:
    """Why wind's kernel (built for ``head_dim``) cannot run this cell; None: it can.
    With the cell's tensors, their dtype and their gates' range are checked too; without,
    the gate style stands for the range."""
    s, why = cell.shape, []
    if tensors is not None:
        dtypes = {x.dtype for x in (tensors.q, tensors.k, tensors.v, tensors.a, tensors.b)}
        if dtypes != {torch.bfloat16}:
            why.append(f"inputs are {sorted(map(str, dtypes))}: chunked_cuda takes bf16 only")
    if s.T % CHUNK:
        why.append(f"T={s.T} is not a multiple of {CHUNK}")
    if s.N is not None:
        offsets = tensors.cu_seqlens_cpu if tensors is not None else varlen_offsets(s.N, s.T)
        unaligned = int((offsets % CHUNK != 0).sum())
        why.append(f"varlen: chunked_cuda takes no cu_seqlens ({unaligned} of {s.N + 1} offsets "
                   f"are not multiples of {CHUNK}, which wind's chunked_cuda_varlen would need)"
                   if unaligned else "varlen: 16-aligned, but wind's chunked_cuda_varlen is not wired here")
    if s.D != head_dim:
        why.append(f"head dim {s.D}: this process built wind's kernel for head dim {head_dim} "
                   f"(one per process; run --head-dim {s.D} in another)")
    if max(s.B * s.T * s.H * s.D, s.B * s.H * (s.T // CHUNK) * s.D * s.D) > INT32_MAX:
        why.append("over 2^31 elements: the kernel's offsets are 32-bit ints")
    if tensors is None:
        if cell.gates == "unbounded":
            why.append("unbounded gates: the chunk's fp32 decay product underflows (no lower bound)")
    elif s.T % CHUNK == 0 and s.N is None:
        low = min_chunk_log_decay(tensors.gk)
        if low < LOG_DECAY_FLOOR:
            why.append(f"a 16-token chunk's log decays sum to {low:.0f} (< {LOG_DECAY_FLOOR:g}): the "
                       "kernel's fp32 decay product underflows (it has no lower bound)")
    return "; ".join(why) or None


# --- the op ------------------------------------------------------------------------------

_built_for: int | None = None  # the head size wind's op was built for in this process


def _version(*folders: Path) -> str:
    """The commit in a ``COMMIT`` file (``<repository> <commit> <path>``, written when the
    folder is packed), else "?"."""
    for folder in folders:
        words = (folder / "COMMIT").read_text().split() if (folder / "COMMIT").is_file() else []
        if len(words) > 1:
            return words[1][:12]
    return "?"


def _import_op_module(folder: Path):
    spec = importlib.util.spec_from_file_location("wind_rwkv_chunked_cuda", folder / "chunked_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Wind:
    """wind_rwkv's ``attn_chunked_cuda`` (``fn``) built for one head size."""

    def __init__(self, head_dim: int, fn: Callable, version: str = "?", build_s: float | None = None):
        self.head_dim, self.fn, self.version, self.build_s = head_dim, fn, version, build_s

    @classmethod
    def load(cls, head_dim: int, root=None, require_cuda=True) -> "Wind":
        """Import and build the op from ``root`` (default ``$TORCH_DPLR_WIND_RWKV``); raises
        ImportError with the reason when it is unavailable."""
        global _built_for
        root = root or os.environ.get(ENV)
        if not root:
            raise ImportError(f"${ENV} is not set (a wind_rwkv source folder)")
        if require_cuda and not torch.cuda.is_available():
            raise ImportError("wind_rwkv's chunked_cuda needs CUDA")
        if _built_for is not None and _built_for != head_dim:
            raise ImportError(f"wind's op is built for head dim {_built_for} in this process")
        folder = op_folder(root)
        version = _version(folder, Path(root))
        module = _import_op_module(folder)
        build = Path(os.environ.get(BUILD_ENV) or Path(tempfile.gettempdir()) / "torch_dplr_wind")
        start = time.perf_counter()
        try:
            (build / f"D{head_dim}").mkdir(parents=True, exist_ok=True)
            with scoped_env("TORCH_EXTENSIONS_DIR", str(build / f"D{head_dim}")):
                module.load_chunked_cuda(head_dim)
        except Exception as exc:  # noqa: BLE001  (nvcc, ninja or the build failed)
            first = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ""
            raise ImportError(f"building chunked_cuda for head dim {head_dim} failed: "
                              f"{type(exc).__name__}: {first}") from exc
        _built_for = head_dim
        return cls(head_dim, module.attn_chunked_cuda, version, time.perf_counter() - start)

    def refusal(self, cell: Cell, tensors: Inputs | None = None) -> str | None:
        return refusal(cell, self.head_dim, tensors)

    def prepare(self, cell: Cell, tensors: Inputs, scale: float) -> dict:
        """The cell's arguments in wind's form, made once outside the timed region: for
        forward+backward fresh leaves (``k, v, a, b`` share our tensors' storage) and the
        cotangents (``dsT``: our ``dht`` transposed, bf16)."""
        args = to_wind(tensors.q, tensors.k, tensors.v, tensors.a, tensors.b, tensors.gk, scale,
                       tensors.h0 if cell.state else None)
        args = [x.detach() for x in args]
        prepared = {"args": args, "grad": cell.mode == "fwd_bwd"}
        if prepared["grad"]:
            wrt = args if cell.state else args[:6]  # no state: s0 is zeros, not an input
            for x in wrt:
                x.requires_grad_()
            prepared.update(wrt=wrt, do=tensors.do.contiguous(),
                            dsT=state_to_wind(tensors.dht) if cell.state else None)
        return prepared

    def step(self, prepared: dict) -> Callable[[], None]:
        """A no-grad forward, or forward+backward through wind's autograd Function: gradients
        by ``torch.autograd.grad`` (nothing accumulates in ``.grad`` between reps)."""
        args, fn = prepared["args"], self.fn
        if not prepared["grad"]:
            def forward():
                with torch.no_grad():
                    fn(*args)
            return forward
        wrt, do, dsT = prepared["wrt"], prepared["do"], prepared["dsT"]

        def forward_backward():
            with torch.enable_grad():
                y, sT = fn(*args)
                outs, cots = ([y, sT], [do, dsT]) if dsT is not None else ([y], [do])
                torch.autograd.grad(outs, wrt, cots)
        return forward_backward


def diffs(ours_o, ours_ht, wind_out, state: bool) -> dict:
    """RMS(torch_dplr - wind) / RMS(wind) of o (and the final state, in our layout)."""
    y, sT = wind_out
    out = {"o": round(rms_ratio(ours_o, y), 6)}
    if state:
        out["final_state"] = round(rms_ratio(ours_ht, state_from_wind(sT)), 6)
    return out


def measure(cell: Cell, inp: Inputs, tensors: Inputs, timer, wind: Wind, scale: float,
            ours: Callable[[], tuple] | None = None) -> dict:
    """The cell's wind fields: ``wind_refusal``, or its timing (``wind_ms``, ``wind_peak_mb``,
    ...) and, for a forward cell with ``ours`` (torch_dplr's ``(o, final_state)``),
    ``diff_vs_wind``.  ``tensors``: the cell's inputs (leaves for forward+backward)."""
    reason = wind.refusal(cell, inp)
    if reason is not None:
        return {"wind_refusal": reason}
    prepared = wind.prepare(cell, tensors, scale)
    fields = {"wind_setting": SETTING[cell.mode], **timer.measure(wind.step(prepared)).fields("wind")}
    if cell.mode == "fwd" and ours is not None:
        o, ht = ours()
        with torch.no_grad():
            fields["diff_vs_wind"] = diffs(o, ht, wind.fn(*prepared["args"]), cell.state)
    return fields


def ratio(record: dict) -> float | None:
    """wind_ms / torch_dplr_ms (above 1: torch_dplr is faster)."""
    wind_ms, ours = record.get("wind_ms"), record.get("torch_dplr_ms")
    return round(wind_ms / ours, 3) if wind_ms is not None and ours else None


def head_dim_of(cells, given: int | None) -> int | None:
    """The head size to build: ``given``, else the first timed cell's."""
    if given is not None:
        return given
    return next((c.shape.D for c in cells if c.mode in MODES), None)


def load(cells, device, head_dim=None, skip=None) -> tuple[Wind | None, dict]:
    """(Wind, {}) or (None, the field that says why the wind columns stay null):
    ``wind_skipped`` when it is not asked for or cannot run here, ``wind_error`` when the
    source is given but does not import or build."""
    if skip:
        return None, {"wind_skipped": skip}
    if device.type != "cuda":
        return None, {"wind_skipped": "wind_rwkv needs CUDA"}
    if not os.environ.get(ENV):
        return None, {"wind_skipped": f"${ENV} not set (no wind_rwkv source)"}
    D = head_dim_of(cells, head_dim)
    if D is None:
        return None, {"wind_skipped": "no fwd or fwd_bwd cells"}
    try:
        return Wind.load(D), {}
    except ImportError as exc:
        return None, {"wind_error": f"load failed: {exc}"}

