"""A launch's arguments checked against a kernel's traced signature, on any machine.

A compiled kernel is called as ``kernel(*inputs, *outputs)``; at launch the TileLang adapter
binds each symbolic size (``B``, ``T``, ``NS``, ...) from the first tensor that carries it and
rejects a tensor whose dtype, rank, fixed size or bound size disagrees.  :func:`launch_checker`
makes the same checks from the traced ``prim_func`` (no lowering, no nvcc, no GPU) and launches
nothing, so the code that prepares a launch can be checked on a CPU machine
(``tests/test_launch_args.py``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .compile import trace


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_launch(prim_func, args: Sequence[Any], name: str = "kernel") -> None:
    """Raise ``TypeError``/``ValueError`` naming the parameter when ``args`` would not bind to
    ``prim_func``'s parameters: their count, each tensor's dtype, rank, fixed sizes and the
    symbolic sizes shared between tensors, compact row-major layout; scalars must be Python
    numbers."""
    import torch

    params = list(prim_func.params)
    if len(args) != len(params):
        raise TypeError(f"{name}: {len(args)} arguments for {len(params)} parameters "
                        f"({', '.join(p.name for p in params)})")
    bound: dict[str, tuple[int, str]] = {}  # symbolic size -> (value, the parameter that set it)
    for param, arg in zip(params, args):
        buffer = prim_func.buffer_map.get(param)
        if buffer is None:  # a scalar parameter
            if isinstance(arg, torch.Tensor) or not isinstance(arg, (int, float)):
                raise TypeError(f"{name}: parameter {param.name} takes a Python number, got "
                                f"{type(arg).__name__}")
            continue
        where = f"{name}: parameter {param.name}"
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"{where} takes a tensor, got {type(arg).__name__}")
        if _dtype_name(arg.dtype) != str(buffer.dtype):
            raise TypeError(f"{where} is {buffer.dtype}, got {_dtype_name(arg.dtype)}")
        if arg.dim() != len(buffer.shape):
            raise ValueError(f"{where} has {len(buffer.shape)} dims {list(buffer.shape)}, got "
                             f"{list(arg.shape)}")
        if not arg.is_contiguous():
            raise ValueError(f"{where} must be contiguous (compact row-major), got strides "
                             f"{arg.stride()} for shape {list(arg.shape)}")
        for axis, (dim, size) in enumerate(zip(buffer.shape, arg.shape)):
            if hasattr(dim, "value"):  # a fixed size
                if int(dim.value) != size:
                    raise ValueError(f"{where} dim {axis} is {int(dim.value)}, got {size} "
                                     f"(shape {list(arg.shape)})")
                continue
            if not hasattr(dim, "name"):
                continue  # an expression of sizes (no kernel here has one): not modelled
            symbol = dim.name
            value, first = bound.setdefault(symbol, (size, param.name))
            if value != size:
                raise ValueError(f"{where} dim {axis} is {symbol} = {value} (from {first}), got "
                                 f"{size} (shape {list(arg.shape)})")


def launch_checker(factory: Callable[..., Any], config: dict, name: str | None = None):
    """A stand-in for the compiled kernel of ``factory(**config)``: called like the kernel, it
    checks the arguments (:func:`check_launch`) and launches nothing."""
    prim_func = trace(factory, **config)
    label = name or factory.__name__

    def launch(*args):
        check_launch(prim_func, args, label)

    return launch
