"""Calling a custom op past the dispatcher layers that would only redispatch.

A decode step is one small launch, so its host time is the call's time; the per-token entries
(``torch_dplr.api``, ``torch_dplr.serving``) call their op through :func:`call_op`.  An eager
training step is host-bound on small grids, so the chunked entries call their ops through it
too: with a gradient to build, an op registered with :func:`register_autograd` then records
its formula as a plain ``autograd.Function`` instead of entering PyTorch's custom-op autograd
kernel.

Below autograd, a call that nothing but the op's own kernel could see (no dispatch or
torch-function mode, no tensor subclass, not while compiling or under a functorch transform)
runs the kernel registered with :func:`register_kernel` for its inputs' device as a plain
function call: the dispatcher's redispatch and the custom op's Python wrappers around the body
(``torch._disable_dynamo`` among them) cost 4-8% of an eager stage-pass step's host time and
a quarter of a decode call's (``python tools/host_sim.py direct``).  Devices without
such a kernel (the CPU, where tests count or replace kernels through ``torch.library``) always
go through the dispatcher.
"""
import contextlib
from typing import Callable

import torch
import torch.utils.checkpoint
from torch import Tensor

# qualified op name -> Function.apply of the op's own formula (see _eager_node)
_EAGER_NODES: dict[str, Callable] = {}
# qualified op name -> {device type: the op's kernel for it} (see register_kernel)
_DIRECT_KERNELS: dict[str, dict[str, Callable]] = {}
_Parameter = torch.nn.Parameter


def register_kernel(op, device_type: str):
    """``op.register_kernel(device_type)`` for a ``torch.library.custom_op`` ``op``, recording
    the kernel for the calls that skip the dispatcher (:func:`_direct_kernel`); a decorator
    that returns the function unchanged."""
    def register(fn):
        op.register_kernel(device_type)(fn)
        _DIRECT_KERNELS.setdefault(op._qualname, {})[device_type] = fn
        return fn
    return register


def direct_kernel(qualname: str, device_type: str) -> Callable | None:
    """The kernel recorded for ``qualname`` (``"dplr::op"``) on ``device_type``, or None."""
    return _DIRECT_KERNELS.get(qualname, {}).get(device_type)


def set_direct_kernel(qualname: str, device_type: str, fn: Callable | None) -> None:
    """Record ``fn`` as the kernel direct calls of ``qualname`` take on ``device_type`` (None:
    none, calls go through the dispatcher), leaving what the dispatcher runs as it is: how a
    machine without the device stands one kernel in for another (``torch_dplr.testing``)."""
    kernels = _DIRECT_KERNELS.setdefault(qualname, {})
    if fn is None:
        kernels.pop(device_type, None)
    else:
        kernels[device_type] = fn


@contextlib.contextmanager
def direct_kernels(device_type: str, kernels: dict):
    """Inside, :func:`set_direct_kernel` for each ``qualname: fn`` of ``kernels``; the kernels
    recorded before are restored on exit."""
    saved = {name: direct_kernel(name, device_type) for name in kernels}
    try:
        for name, fn in kernels.items():
            set_direct_kernel(name, device_type, fn)
        yield
    finally:
        for name, fn in saved.items():
            set_direct_kernel(name, device_type, fn)


def _direct_kernel(qualname: str, args: tuple) -> Callable | None:
    """The kernel a call below autograd would reach, when nothing else could see the call: no
    dispatch or torch-function mode active and only plain tensors (a subclass dispatches
    through its own ``__torch_dispatch__``); None otherwise, or when the device of the first
    tensor argument has no recorded kernel."""
    kernels = _DIRECT_KERNELS.get(qualname)
    if (kernels is None or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack()):
        return None
    device_type = None
    for arg in args:
        kind = type(arg)
        if kind is Tensor or kind is _Parameter:
            if device_type is None:
                device_type = arg.device.type
        elif isinstance(arg, Tensor):
            return None
    return kernels.get(device_type)


def _below_autograd(overload, qualname: str, args: tuple):
    """``overload(*args)`` below autograd: the kernel straight where :func:`_direct_kernel`
    finds one (with the dispatch keys excluded as the dispatcher would), else through the
    dispatcher."""
    kernel = _direct_kernel(qualname, args) or overload
    with torch._C._AutoDispatchBelowAutograd():
        return kernel(*args)


def _eager_node(overload, backward, setup_context) -> Callable:
    """The autograd node that registering ``backward`` and ``setup_context`` makes for the op
    of ``overload``, as a plain ``autograd.Function``: the same saved tensors, freed when its
    backward has run, and the same gradients.  It skips what the custom-op kernel adds around
    them per call (its Python wrappers, filling the schema's defaults, which is quadratic in
    the arity, a redispatch): about a sixth of an eager stage-pass step's host time, bare or
    under ``save_state`` (``python tools/host_sim.py eager``).  A second derivative raises,
    as it does through the op, whose backward ops have no formula."""
    qualname = overload._schema.name

    def forward(ctx, *args):
        output = _below_autograd(overload, qualname, args)
        setup_context(ctx, args, output)
        return output

    @torch.autograd.function.once_differentiable
    def backward_below_autograd(ctx, *grads):
        with torch._C._AutoDispatchBelowAutograd():
            return tuple(backward(ctx, *grads))

    # named after the op: its grad_fn reads dplr_<op>Backward
    name = qualname.replace("::", "_")
    node = type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward),
                 "backward": staticmethod(backward_below_autograd)})
    return node.apply


# selective checkpointing's two modes (a policy's forward and its recompute): they see the op
# below autograd, as they see it under the op's own autograd node
_CHECKPOINT_MODES = (torch.utils.checkpoint._CachingTorchDispatchMode,
                     torch.utils.checkpoint._CachedTorchDispatchMode)


def _only_checkpoint_modes() -> bool:
    """Whether every active dispatch mode is selective checkpointing's (or none is)."""
    return all(isinstance(torch._C._get_dispatch_stack_at(i), _CHECKPOINT_MODES)
               for i in range(torch._C._len_torch_dispatch_stack()))


def register_autograd(op, backward, setup_context) -> None:
    """``op.register_autograd(backward, setup_context=setup_context)`` for a
    ``torch.library.custom_op`` ``op``, and the same formula for :func:`call_op`'s eager
    calls."""
    op.register_autograd(backward, setup_context=setup_context)
    _EAGER_NODES[op._qualname] = _eager_node(op._opoverload, backward, setup_context)


def call_op(op, *args, mutated: Tensor | None = None):
    """``op(*args)``, past the Python kernels a ``torch.library.custom_op`` runs in front of
    its body where they only redispatch (host time not hidden behind a decode step's small
    kernel: about 7 us a ``recurrent_fwd`` call, 35 us a ``decode_pool`` one, on
    ``tools/host_sim.py decode``): the autograd kernel when no gradient is needed (the test
    it makes itself), and, for an op that writes ``mutated``, the in-place kernel, whose one
    effect (bumping ``mutated``'s version counter) is done here.  Every layer runs while
    Dynamo traces (so the graph holds the op) and under a functorch transform; the in-place
    kernel also runs for an inference tensor ``mutated``: inside inference mode the
    dispatcher skips it anyway, outside it the body's in-place writes must raise as usual.

    When a gradient is needed, an op registered with :func:`register_autograd` that writes
    nothing records its eager node (:func:`_eager_node`), also under a checkpoint policy;
    under any other dispatch mode (fake or proxy tensors, a counting or logging mode) the
    op's own autograd layer runs.  Below autograd (and below the in-place layer) a call that
    nothing but the kernel could see runs the kernel straight (:func:`_direct_kernel`)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return op(*args)
    qualname = getattr(op, "_qualified_op_name", None)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        node = _EAGER_NODES.get(qualname)
        if node is None or mutated is not None or not _only_checkpoint_modes():
            return op(*args)
        return node(*args)
    if mutated is None:
        return _below_autograd(op, qualname, args)
    if mutated.is_inference():
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)
    torch.autograd.graph.increment_version(mutated)
    kernel = _direct_kernel(qualname, args) or op
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return kernel(*args)
