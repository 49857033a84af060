"""Eager training calls record each op's formula as a plain ``autograd.Function``
(``torch_dplr.ops.direct_call``): the public chunked and per-token calls, with a gradient to
build, outside torch.compile, functorch transforms and dispatch modes.

* The graph holds the eager nodes in eager mode and the ops' own autograd nodes under a
  dispatch mode (a checkpoint policy's, here a pass-through one); both give bit-identical o,
  final state and gradients, for the stage pass, the two-op pass and the per-token op.
* The eager nodes free their saved tensors like the op's nodes: a plain (policy-less)
  ``torch.utils.checkpoint`` gives the same gradients, and a backward through a freed graph
  raises.
* A second derivative raises, through the eager nodes as through the ops.

The policies' counts (compile_tests/test_policies.py) and the compiled graphs
(compile_tests/test_fullgraph.py) check the op path.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import torch_dplr
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


def _run(call, x, mode=None):
    leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    with mode or torch.autograd.grad_mode.enable_grad():
        o, ht = call(leaves)
        node = o.grad_fn.name()
        gen = torch.Generator().manual_seed(1)
        loss = ((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
                + (ht * torch.randn(ht.shape, generator=gen, dtype=ht.dtype)).sum())
        loss.backward()
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


def test_backward_twice_through_a_freed_graph_raises():
    x = make_inputs(1, 20, 1, 16, seed=6)
    leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    o, _ = _chunked(leaves)
    o.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        o.sum().backward()


@pytest.mark.parametrize("mode", [None, _PassThrough], ids=["eager", "op"])
def test_second_derivative_raises(mode):
    x = make_inputs(1, 20, 1, 16, seed=7)
    leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    with mode() if mode else torch.autograd.grad_mode.enable_grad():
        o, _ = _chunked(leaves)
        (dq,) = torch.autograd.grad((o * o).sum(), leaves["q"], create_graph=True)
        with pytest.raises(RuntimeError, match="twice|no autograd formula"):
            dq.sum().backward()
