"""Calling a custom op past the dispatcher layers that would only redispatch.

A decode step is one small launch, so its host time is the call's time; the per-token entries
(``torch_dplr.api``, ``torch_dplr.serving``) call their op through :func:`call_op`.
"""
import torch
from torch import Tensor


def call_op(op, *args, mutated: Tensor | None = None):
    """``op(*args)``, past the Python kernels a ``torch.library.custom_op`` runs in front of
    its body where they only redispatch (host time not hidden behind a decode step's small
    kernel: about 7 us a ``recurrent_fwd`` call, 35 us a ``decode_pool`` one, on
    ``tools/host_sim.py decode``): the autograd kernel when no gradient is needed (the test
    it makes itself), and, for an op that writes ``mutated``, the in-place kernel, whose one
    effect (bumping ``mutated``'s version counter) is done here.  Every layer runs while
    Dynamo traces (so the graph holds the op) and under a functorch transform; the in-place
    kernel also runs for an inference tensor ``mutated``: inside inference mode the
    dispatcher skips it anyway, outside it the body's in-place writes must raise as usual."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args))):
        return op(*args)
    if mutated is None or mutated.is_inference():
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)
    torch.autograd.graph.increment_version(mutated)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return op(*args)
