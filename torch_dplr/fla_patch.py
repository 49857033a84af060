"""Run flash-linear-attention's RWKV-7 / DPLR functions on torch_dplr, models unchanged.

:func:`patch_fla` replaces FLA's public functions

- ``fla.ops.rwkv7``: ``chunk_rwkv7``, ``fused_recurrent_rwkv7``, ``fused_mul_recurrent_rwkv7``
- ``fla.ops.generalized_delta_rule.dplr``: ``chunk_dplr_delta_rule``,
  ``fused_recurrent_dplr_delta_rule``

with adapters that call torch_dplr.  ``from fla.ops.rwkv7 import chunk_rwkv7`` copies the
function into the importing module, so replacing the attribute of ``fla.ops.rwkv7`` alone would
miss every module already imported (``fla.layers.rwkv7``, ``fla.ops``, a model's remote code):
the patch rebinds every module-level name in ``sys.modules`` that is bound to one of the
original function objects.  Undoing it puts the originals back wherever an adapter of this
patch is bound (also in modules imported while it was active) and leaves a name alone that was
rebound to something else meanwhile.  References held elsewhere (a closure, a class attribute,
a dict) are not found.

The adapters keep FLA 0.6.0's signatures and defaults, e.g. ``fused_recurrent_rwkv7``'s
``scale=None`` (``K ** -0.5``).  Arguments torch_dplr does not honour raise as torch_dplr
raises them: a ``cp_context`` that is not a :func:`torch_dplr.cp.build_context` context, FLA's
own among them (``TypeError``), ``head_first`` (``ValueError``), any unknown keyword
(``TypeError``).  ``disable_recompute`` is accepted and ignored (a checkpoint
policy decides, :mod:`torch_dplr.policies`); ``chunk_size=None`` means 64 and
``safe_gate``/``lower_bound`` are promises about the gates, results never depend on them.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

from . import api, rwkv7

__all__ = ["FLAPatch", "patch_fla", "unpatch_fla", "FLA_FUNCTIONS"]

# where FLA defines each public function this module replaces
FLA_FUNCTIONS = {
    "fla.ops.rwkv7": ("chunk_rwkv7", "fused_recurrent_rwkv7", "fused_mul_recurrent_rwkv7"),
    "fla.ops.generalized_delta_rule.dplr": ("chunk_dplr_delta_rule",
                                            "fused_recurrent_dplr_delta_rule"),
}

_NOT_INSTALLED = ("torch_dplr.patch_fla() routes flash-linear-attention's functions to torch_dplr, "
                  "but flash-linear-attention is not installed (no module named 'fla'; "
                  "pip install flash-linear-attention, or fla-core for the ops alone). "
                  "Without FLA, call torch_dplr's functions directly: "
                  "torch_dplr.chunk_rwkv7, torch_dplr.fused_mul_recurrent_rwkv7, ...")


def _adapters(calls: dict) -> dict:
    """One adapter per FLA function, with FLA 0.6.0's signature and defaults; each counts its
    calls in ``calls`` (a plain dict: under torch.compile the count is replayed per call)."""

    def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                    cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                    disable_recompute=False, cp_context=None, lower_bound=None):
        calls["chunk_rwkv7"] += 1
        return api.chunk_rwkv7(r, w, k, v, a, b, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                               cu_seqlens_cpu=cu_seqlens_cpu, safe_gate=safe_gate,
                               chunk_size=chunk_size, disable_recompute=disable_recompute,
                               cp_context=cp_context, lower_bound=lower_bound)

    def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None,
                              output_final_state=True, cu_seqlens=None):
        calls["fused_recurrent_rwkv7"] += 1
        return api.fused_recurrent_rwkv7(r, w, k, v, a, b, scale=scale,
                                         initial_state=initial_state,
                                         output_final_state=output_final_state,
                                         cu_seqlens=cu_seqlens)

    def fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, scale=1.0, initial_state=None,
                                  output_final_state=False, reverse=False, cu_seqlens=None):
        calls["fused_mul_recurrent_rwkv7"] += 1
        return rwkv7.fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, scale=scale,
                                               initial_state=initial_state,
                                               output_final_state=output_final_state,
                                               reverse=reverse, cu_seqlens=cu_seqlens)

    def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                              output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
                              safe_gate=False, chunk_size=None, disable_recompute=False,
                              cp_context=None, lower_bound=None, **kwargs):
        calls["chunk_dplr_delta_rule"] += 1
        return api.chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=scale,
                                         initial_state=initial_state,
                                         output_final_state=output_final_state,
                                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                         safe_gate=safe_gate, chunk_size=chunk_size,
                                         disable_recompute=disable_recompute,
                                         cp_context=cp_context, lower_bound=lower_bound,
                                         **kwargs)

    def fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                                        output_final_state=False, reverse=False,
                                        cu_seqlens=None):
        calls["fused_recurrent_dplr_delta_rule"] += 1
        return api.fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=scale,
                                                   initial_state=initial_state,
                                                   output_final_state=output_final_state,
                                                   reverse=reverse, cu_seqlens=cu_seqlens)

    adapters = {fn.__name__: fn for fn in (chunk_rwkv7, fused_recurrent_rwkv7,
                                           fused_mul_recurrent_rwkv7, chunk_dplr_delta_rule,
                                           fused_recurrent_dplr_delta_rule)}
    for name, fn in adapters.items():
        fn.__qualname__ = name
        fn.__module__ = __name__
        fn.__doc__ = f"flash-linear-attention's ``{name}`` running on torch_dplr (patch_fla)."
        calls[name] = 0
    return adapters


class FLAPatch:
    """The handle :func:`patch_fla` returns: ``undo()`` it, or use it as a context manager.

    ``rebound``: the ``module.name`` bindings it replaced; ``calls``: how many times each
    adapter ran; ``missing``: FLA functions this FLA version lacks (left alone); ``active``.
    """

    def __init__(self, originals: dict, adapters: dict, calls: dict, missing: tuple,
                 owner: bool):
        self._originals = originals  # name -> FLA's function
        self._adapters = adapters  # name -> the adapter standing in for it
        self.calls = calls
        self.missing = missing
        self._owner = owner  # False: a nested patch_fla() while another was active
        self.rebound: tuple[str, ...] = ()
        self.active = True

    def undo(self) -> None:
        """Put FLA's functions back (idempotent; a nested handle's undo does nothing: the
        outermost patch restores)."""
        global _active
        if not self.active:
            return
        self.active = False
        if not self._owner:
            return
        by_id = {id(fn): self._originals[name] for name, fn in self._adapters.items()}
        _rebind(by_id)
        _active = None

    def __enter__(self) -> "FLAPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<FLAPatch {state}: {len(self.rebound)} bindings, calls={self.calls}>"


_active: FLAPatch | None = None


def _rebind(replacements: dict) -> list[str]:
    """Every module-level name in ``sys.modules`` bound to an object whose id is a key of
    ``replacements`` is rebound to the value; returns the ``module.name`` bindings changed."""
    changed = []
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            new = replacements.get(id(value))
            # an id can be reused by a new object once the old one is freed: the keys' objects
            # stay alive (held by the patch), so a match by id is a match by identity
            if new is not None:
                namespace[name] = new
                changed.append(f"{module_name}.{name}")
    return changed


def _fla_installed() -> bool:
    if "fla" in sys.modules:  # None there means its import is blocked
        return sys.modules["fla"] is not None
    return importlib.util.find_spec("fla") is not None


def _import_fla(path: str) -> ModuleType:
    try:
        return importlib.import_module(path)
    except ImportError as exc:
        if not _fla_installed():
            raise ModuleNotFoundError(_NOT_INSTALLED, name="fla") from exc
        raise ImportError(f"torch_dplr.patch_fla(): flash-linear-attention is installed but "
                          f"{path} could not be imported ({exc})") from exc


def patch_fla() -> FLAPatch:
    """Route flash-linear-attention's RWKV-7 / DPLR functions to torch_dplr until undone.

    ``patch_fla()`` patches and returns a handle (``handle.undo()``, or
    :func:`unpatch_fla`); ``with torch_dplr.patch_fla(): ...`` patches for the block.  A call
    while a patch is active returns a handle that owns nothing (the first patch restores).
    Raises ``ModuleNotFoundError`` when FLA is not installed.
    """
    global _active
    modules = {path: _import_fla(path) for path in FLA_FUNCTIONS}
    if _active is not None and _active.active:
        return FLAPatch(_active._originals, _active._adapters, _active.calls,
                        _active.missing, owner=False)
    calls: dict = {}
    adapters = _adapters(calls)
    originals, missing = {}, []
    for path, names in FLA_FUNCTIONS.items():
        for name in names:
            fn = getattr(modules[path], name, None)
            if fn is None:
                missing.append(f"{path}.{name}")
            else:
                originals[name] = fn
    if not originals:
        raise ImportError("torch_dplr.patch_fla(): this flash-linear-attention has none of "
                          f"{[f'{p}.{n}' for p, ns in FLA_FUNCTIONS.items() for n in ns]}")
    adapters = {name: fn for name, fn in adapters.items() if name in originals}
    patch = FLAPatch(originals, adapters, calls, tuple(missing), owner=True)
    patch.rebound = tuple(_rebind({id(fn): adapters[name] for name, fn in originals.items()}))
    _active = patch
    return patch


def unpatch_fla() -> bool:
    """Undo the active :func:`patch_fla` (returns False when none was active)."""
    if _active is None or not _active.active:
        return False
    _active.undo()
    return True
