"""Eager training calls record each op's formula as a plain ``autograd.Function``
(``torch_dplr.ops.direct_call``): the public chunked and per-token calls, with a gradient to
build, outside torch.compile, functorch transforms and dispatch modes other than selective
checkpointing's.

* The graph holds the eager nodes in eager mode, under a checkpoint policy too, and the ops'
  own autograd nodes under any other dispatch mode (here a pass-through one); both give
  bit-identical o, final state and gradients, for the stage pass, the two-op pass and the
  per-token op.
* Under each shipped policy the eager nodes keep the gradients of the uncheckpointed call, bit
  for bit, and the recompute runs exactly the ops the policy says it recomputes (counted at
  their PyTorch kernels).
* The eager nodes free their saved tensors like the op's nodes: a plain (policy-less)
  ``torch.utils.checkpoint`` gives the same gradients, and a backward through a freed graph
  raises.
* A second derivative raises, through the eager nodes as through the ops.

compile_tests/test_policies.py counts the policies' ops through a dispatch mode of its own,
so through the op path; compile_tests/test_fullgraph.py checks the compiled graphs.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import Counter

import pytest
import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import torch_dplr
from torch_dplr import policies
from torch_dplr.ops import dataflow
from torch_dplr.testing import make_inputs

NAMES = "q k v a b gk initial_state".split()


class _PassThrough(TorchDispatchMode):
    """Any dispatch mode sends the calls through the ops' own autograd layer."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _chunked(leaves, C=16, cu=None):
    return torch_dplr.chunk_dplr_delta_rule(
        *(leaves[n] for n in NAMES[:6]), initial_state=leaves["initial_state"],
        output_final_state=True, chunk_size=C, cu_seqlens=cu)


def _per_token(leaves):
    return torch_dplr.fused_recurrent_dplr_delta_rule(
        *(leaves[n] for n in NAMES[:6]), initial_state=leaves["initial_state"],
        output_final_state=True)


def _leaves(x):
    return {n: x[n].detach().clone().requires_grad_() for n in NAMES}


def _loss(o, ht):
    """A fixed random weighting of o and the final state."""
    gen = torch.Generator().manual_seed(1)
    return ((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
            + (ht * torch.randn(ht.shape, generator=gen, dtype=ht.dtype)).sum())


def _run(call, x, mode=None):
    leaves = _leaves(x)
    with mode or torch.autograd.grad_mode.enable_grad():
        o, ht = call(leaves)
        node = o.grad_fn.name()
        _loss(o, ht).backward()
    return node, [o, ht] + [leaves[n].grad for n in NAMES]


@pytest.mark.parametrize("pass_,call,node", [
    ("stages", _chunked, "dplr_chunk_state_fwdBackward"),
    ("split", _chunked, "dplr_chunk_fwdBackward"),
    ("stages", _per_token, "dplr_recurrent_fwdBackward"),
])
def test_eager_nodes_give_the_op_path_bit_for_bit(monkeypatch, pass_, call, node):
    monkeypatch.setenv(dataflow.TRAINING_PASS_VAR, pass_)
    x = make_inputs(2, 40, 2, 16, seed=3)
    eager_node, eager = _run(call, x)
    op_node, through_ops = _run(call, x, _PassThrough())
    assert eager_node == node
    assert op_node != node and "dplr" in op_node
    for got, want in zip(eager, through_ops):
        assert torch.equal(got, want)


def test_varlen_call_records_eager_nodes():
    x = make_inputs(1, 40, 2, 16, seed=4, num_states=3)
    cu = torch.tensor([0, 7, 23, 40])
    node, eager = _run(lambda leaves: _chunked(leaves, 16, cu), x)
    _, through_ops = _run(lambda leaves: _chunked(leaves, 16, cu), x, _PassThrough())
    assert node == "dplr_chunk_state_fwdBackward"
    assert all(torch.equal(g, w) for g, w in zip(eager, through_ops))


def test_plain_checkpoint_matches_no_checkpoint():
    x = make_inputs(2, 40, 2, 16, seed=5)
    _, plain = _run(_chunked, x)
    _, checkpointed = _run(lambda leaves: checkpoint(_chunked, leaves, use_reentrant=False), x)
    for got, want in zip(checkpointed, plain):
        assert torch.equal(got, want)


@contextlib.contextmanager
def _counting_cpu_kernels(counts: Counter):
    """Counts the calls of each forward op's CPU kernel (its PyTorch kernel, unchanged)."""
    with torch.library._scoped_library("dplr", "IMPL") as lib:
        for op in policies.FORWARD_OPS:
            if op.namespace != "dplr":
                continue
            kernel = OPDEFS[op.name()]._init_fn

            def counting(*args, op=op, kernel=kernel):
                counts[op] += 1
                return kernel(*args)
            with warnings.catch_warnings():  # overriding a registered kernel warns
                warnings.simplefilter("ignore")
                lib.impl(op.name().split("::")[1], counting, "CPU", allow_override=True)
        yield


@pytest.mark.parametrize("pass_", ["stages", "split"])
@pytest.mark.parametrize("policy", sorted(policies.POLICIES))
def test_policies_on_eager_nodes(monkeypatch, policy, pass_):
    monkeypatch.setenv(dataflow.TRAINING_PASS_VAR, pass_)
    context_fn = policies.context_fn(policy)
    x = make_inputs(2, 40, 2, 16, seed=8)
    _, plain = _run(_chunked, x)
    forward, backward = Counter(), Counter()
    leaves = _leaves(x)
    with _counting_cpu_kernels(forward):
        o, ht = checkpoint(_chunked, leaves, use_reentrant=False, context_fn=context_fn)
    with _counting_cpu_kernels(backward):
        _loss(o, ht).backward()
    assert o.grad_fn.name() in ("dplr_chunk_state_fwdBackward", "dplr_chunk_fwdBackward")
    checkpointed = [o, ht] + [leaves[n].grad for n in NAMES]
    assert all(torch.equal(g, w) for g, w in zip(checkpointed, plain))
    assert forward and set(forward.values()) == {1}
    assert set(backward) == set(forward) & policies.recomputed_ops(policy)


def test_backward_twice_through_a_freed_graph_raises():
    x = make_inputs(1, 20, 1, 16, seed=6)
    leaves = _leaves(x)
    o, _ = _chunked(leaves)
    o.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        o.sum().backward()


@pytest.mark.parametrize("mode", [None, _PassThrough], ids=["eager", "op"])
def test_second_derivative_raises(mode):
    x = make_inputs(1, 20, 1, 16, seed=7)
    leaves = _leaves(x)
    with mode() if mode else torch.autograd.grad_mode.enable_grad():
        o, _ = _chunked(leaves)
        (dq,) = torch.autograd.grad((o * o).sum(), leaves["q"], create_graph=True)
        with pytest.raises(RuntimeError, match="twice|no autograd formula"):
            dq.sum().backward()
