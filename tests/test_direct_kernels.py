"""Op kernels called straight (``torch_dplr.ops.direct_call``): below autograd, a call that
nothing but the op's kernel could see runs the kernel recorded for its device as a function.

On this CPU machine ``cuda_op_bodies_on_cpu`` makes the stage ops' CUDA functions the CPU's
recorded kernels (their launches replaced by the PyTorch kernels: ``kernel_for`` finds none),
so a training step takes the path it takes on a GPU:

* the direct calls give the dispatched calls' outputs and gradients bit for bit, for the stage
  pass and the two-op pass, and every op of the step is reached directly;
* a dispatch mode, a torch-function mode (``with torch.device(...)``) or a tensor subclass
  among the arguments sends the calls through the dispatcher again, with the same results (the
  autograd engine does not carry a torch-function mode into the backward, so there only the
  forward calls step aside).
"""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_dplr
from torch_dplr.ops import dataflow, direct_call
from torch_dplr.testing import CUDA_BODY_OPS, cuda_op_bodies_on_cpu, make_inputs

NAMES = "q k v a b gk initial_state".split()


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Marked(torch.Tensor):
    """A subclass that only passes calls on (its ``__torch_function__`` is Tensor's)."""


@contextlib.contextmanager
def _counted_direct_calls(counts: Counter):
    """Inside: the CUDA functions run on CPU tensors (references in place of the launches),
    each direct call of one counted."""
    def counting(op):
        kernel = direct_call.direct_kernel(f"dplr::{op}", "cpu")

        def run(*args):
            counts[op] += 1
            return kernel(*args)
        return run
    with cuda_op_bodies_on_cpu(lambda *args, **kwargs: None):
        with direct_call.direct_kernels("cpu", {f"dplr::{op}": counting(op)
                                                for op in CUDA_BODY_OPS}):
            yield


def _dispatched_only():
    for op in CUDA_BODY_OPS:
        direct_call.set_direct_kernel(f"dplr::{op}", "cpu", None)


def _step(x, wrap=lambda t: t):
    leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    o, ht = torch_dplr.chunk_dplr_delta_rule(
        *(wrap(leaves[n]) for n in NAMES[:6]), initial_state=leaves["initial_state"],
        output_final_state=True, chunk_size=16)
    gen = torch.Generator().manual_seed(1)
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum() + ht.sum()
    loss.backward()
    return [o, ht] + [leaves[n].grad for n in NAMES]


@pytest.mark.parametrize("pass_,ops", [
    ("stages", {"chunk_intra_fwd", "chunk_wy_fwd", "chunk_state_fwd", "chunk_intra_bwd",
                "chunk_wy_bwd", "chunk_state_bwd"}),
    ("split", {"chunk_fwd", "chunk_bwd"}),
])
def test_direct_calls_give_the_dispatched_results_bit_for_bit(monkeypatch, pass_, ops):
    monkeypatch.setenv(dataflow.TRAINING_PASS_VAR, pass_)
    x = make_inputs(2, 40, 2, 16, seed=3)
    counts = Counter()
    with _counted_direct_calls(counts):
        direct = _step(x)
        assert set(counts) == ops and set(counts.values()) == {1}
        counts.clear()
        _dispatched_only()
        dispatched = _step(x)
        assert not counts
    for got, want in zip(direct, dispatched):
        assert torch.equal(got, want)


@pytest.mark.parametrize("context", ["dispatch mode", "torch-function mode", "subclass"])
def test_direct_calls_step_aside(context):
    x = make_inputs(2, 40, 2, 16, seed=5)
    counts = Counter()
    with _counted_direct_calls(counts):
        plain = _step(x)
        assert counts
        counts.clear()
        if context == "subclass":
            aside = _step(x, wrap=lambda t: t.as_subclass(_Marked))
        else:
            mode = _PassThrough() if context == "dispatch mode" else torch.device("cpu")
            with mode:
                aside = _step(x)
        if context == "torch-function mode":
            assert not any(op.endswith("_fwd") for op in counts)
        else:
            assert not counts
    for got, want in zip(aside, plain):
        assert torch.equal(got, want)


# ---- an op of this file, to see which path call_op takes -------------------------------------

@torch.library.custom_op("torch_dplr_test::add_into", mutates_args=("out",))
def _add_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.add_(x)
    return x * 2


OP = torch.ops.torch_dplr_test.add_into
_calls = Counter()


def _kernel_counted_as(path):
    def kernel(x, out):
        _calls[path] += 1
        out.add_(x)
        return x * 2
    return kernel


# recorded for direct calls, then replaced in the dispatcher by a kernel that counts apart
direct_call.register_kernel(_add_into, "cpu")(_kernel_counted_as("direct"))
_add_into.register_kernel("cpu")(_kernel_counted_as("dispatched"))


@pytest.mark.parametrize("mutating", [False, True])
def test_call_op_runs_the_recorded_kernel_and_still_bumps_versions(mutating):
    x, out = torch.randn(4), torch.zeros(4)
    before = out._version
    _calls.clear()
    with torch.no_grad():
        y = direct_call.call_op(OP, x, out, mutated=out if mutating else None)
    assert _calls == Counter(direct=1) and torch.equal(y, x * 2) and torch.equal(out, x)
    assert out._version == before + 1  # once, as through the dispatcher
    _calls.clear()
    with _PassThrough(), torch.no_grad():
        direct_call.call_op(OP, x, out, mutated=out if mutating else None)
    assert _calls == Counter(dispatched=1)
    assert out._version == before + 2


def test_stand_in_kernels_are_restored_on_exit():
    """``direct_kernels`` puts back what was recorded before, so the stand-ins nest."""
    name = "dplr::chunk_state_fwd"
    assert direct_call.direct_kernel(name, "cpu") is None
    with cuda_op_bodies_on_cpu(lambda *args, **kwargs: None):
        outer = direct_call.direct_kernel(name, "cpu")
        assert outer is direct_call.direct_kernel(name, "cuda")
        with direct_call.direct_kernels("cpu", {name: print}):
            assert direct_call.direct_kernel(name, "cpu") is print
        assert direct_call.direct_kernel(name, "cpu") is outer
    assert direct_call.direct_kernel(name, "cpu") is None
