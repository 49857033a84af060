"""The TileLang kernels of the ``dsa`` ops (``csrc_tl.DSA_KERNEL_MODULES``), compiled on first use.

An op's CUDA function asks for a kernel only after deciding from shapes, dtypes and the device
that one applies (never from tensor values: no host sync), on the DPLR ops' switch
(:func:`torch_dplr.ops.tilelang_path.tilelang_usable`: an sm_90 GPU, TileLang importable,
``TORCH_DPLR_DISABLE_TILELANG`` unset).  A kernel neither in memory nor in the disk cache is
compiled by a compiler process, with a progress line on stderr (``TORCH_DPLR_QUIET=1``
silences it); one that cannot be built leaves its op on the PyTorch kernel, after one warning.
"""
from __future__ import annotations

import importlib
import os
import warnings

from ...ops.kernels import _progress

_kernels: dict[tuple, object] = {}  # (family, config) -> kernel, or None when it failed to build
_MISSING = object()


def switched_off(switch: str) -> bool:
    """Whether the environment variable ``switch`` (a kernel's own opt-out, e.g.
    ``TORCH_DPLR_DSA_TILELANG_BWD``) is "0": its op then runs the PyTorch kernel.  Read at
    every call, so a test or a bisection can flip it in a running process."""
    return os.environ.get(switch) == "0"


def aligned(x):
    """Contiguous and 16-byte aligned, as the kernels' 16-byte loads (cp.async, vector loads)
    need: copied only when a view starts elsewhere."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def kernel_for(family: str, config: dict):
    """The compiled kernel of ``csrc_tl.<family>`` for ``config``, or None (no nvcc, a TileLang
    error): the op then runs its PyTorch kernel."""
    key = (family, tuple(sorted(config.items())))
    kernel = _kernels.get(key, _MISSING)
    if kernel is _MISSING:
        try:
            import csrc_tl

            factory = getattr(importlib.import_module(f"csrc_tl.{family}"), f"{family}_kernel")
            csrc_tl.build_all([(factory, config)], progress=_progress, load=False)
            kernel = csrc_tl.build(factory, **config)
        except Exception as exc:  # noqa: BLE001 (any build failure: fall back, loudly once)
            warnings.warn(f"torch_dplr: the TileLang kernel {family} {config} could not be built "
                          f"({type(exc).__name__}: {exc}); its op runs the PyTorch kernel "
                          f"instead", RuntimeWarning, stacklevel=2)
            kernel = None
        _kernels[key] = kernel
    return kernel
