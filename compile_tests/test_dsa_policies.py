"""DSA selective-checkpoint policies (torch_dplr.dsa.policies): the same outputs and gradients
as without checkpointing, and the backward recomputes exactly the ``dsa`` forward ops
``recomputed_ops(policy)`` names, eagerly (a dispatch counter during ``.backward()``) and under
``torch.compile(checkpoint(fn))`` (AOT autograd's backward graph)."""
from collections import Counter

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from torch_dplr.dsa import policies
from torch_dplr.dsa.testing import TinyDSALayer, attention_region, make_inputs

from ._support import DispatchCounter, assert_all_close, index_tensor, on_device, run_and_grad

dsa = torch.ops.dsa
FORWARD_OPS = policies.FORWARD_OPS
BACKWARD_OPS = frozenset({dsa.sparse_mla_bwd.default, dsa.indexer_bwd.default,
                          dsa.indexer_loss_bwd.default})
CUSTOM = {"custom_save_topk": frozenset({dsa.indexer_topk.default})}
POLICY_CASES = [*policies.POLICIES, *CUSTOM]


def resolve(name):
    return CUSTOM.get(name, name)


def checkpointed(fn, policy):
    context_fn = policies.context_fn(policy)

    def wrapped(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 context_fn=context_fn, **kwargs)
    return wrapped


def region_attention():
    x = {n: on_device(t).requires_grad_() for n, t in make_inputs(33).items()}
    tensors = list(x.values())
    return attention_region, tensors, [*tensors, index_tensor([0, 14, 15, 30])]


def region_layer():
    torch.manual_seed(0)
    layer = TinyDSALayer().to(on_device(torch.zeros(0)).device)
    x = on_device(torch.randn(27, 32, generator=torch.Generator().manual_seed(2))).requires_grad_()
    return layer, [x, *layer.parameters()], [x, index_tensor([0, 20, 27])]


REGIONS = {"attention": region_attention, "layer": region_layer}


def only(counts, ops):
    return Counter({op: n for op, n in counts.items() if op in ops})


def test_shipped_policies_recompute_what_they_document():
    topk, scores = dsa.indexer_topk.default, dsa.indexer_fwd.default
    attention, loss = dsa.sparse_mla_fwd.default, dsa.indexer_loss_fwd.default
    assert policies.recomputed_ops("recompute_all") == FORWARD_OPS
    assert policies.recomputed_ops("recompute_indexer") == {topk, scores}
    assert policies.recomputed_ops("save_indexer") == {attention, loss}
    assert policies.recomputed_ops("save_all") == frozenset()
    assert policies.recomputed_ops(["dsa::indexer_topk"]) == FORWARD_OPS - {topk}


def test_policy_decisions():
    decide = policies.policy_fn("recompute_indexer", extra_save_ops=[torch.ops.aten.mm.default])
    assert decide(None, dsa.sparse_mla_fwd.default) == CheckpointPolicy.MUST_SAVE
    assert decide(None, dsa.indexer_topk.default) == CheckpointPolicy.MUST_RECOMPUTE
    assert decide(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert decide(None, torch.ops.aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def test_bad_policies_raise():
    with pytest.raises(ValueError, match="recompute_indexer"):
        policies.context_fn("recompute_everything")
    with pytest.raises(ValueError, match="unknown op"):
        policies.recomputed_ops(["dsa::no_such_op"])
    with pytest.raises(TypeError, match="checkpoint policies take ops"):
        policies.recomputed_ops([3])


@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("policy", POLICY_CASES)
def test_policy_eager(policy, region):
    fn, tensors, args = REGIONS[region]()
    out_ref, grads_ref = run_and_grad(fn, tensors, *args)
    fwd, bwd = DispatchCounter(), DispatchCounter()
    out, grads = run_and_grad(checkpointed(fn, resolve(policy)), tensors, *args,
                              forward_ctx=fwd, backward_ctx=bwd)
    assert_all_close(out, out_ref)
    assert_all_close(grads, grads_ref)
    assert only(fwd.counts, FORWARD_OPS) == {op: 1 for op in FORWARD_OPS}
    assert only(bwd.counts, FORWARD_OPS) == {op: 1 for op in policies.recomputed_ops(resolve(policy))}
    assert only(bwd.counts, BACKWARD_OPS) == {op: 1 for op in BACKWARD_OPS}


@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("policy", POLICY_CASES)
def test_policy_compiled(recorder, policy, region):
    """``torch.compile(checkpoint(fn, context_fn=policy))``: one graph, the same gradients,
    and the backward graph recomputes exactly the policy's ops, once each."""
    fn, tensors, args = REGIONS[region]()
    out_ref, grads_ref = run_and_grad(fn, tensors, *args)
    compiled = torch.compile(checkpointed(fn, resolve(policy)), backend=recorder, fullgraph=True)
    out, grads = run_and_grad(compiled, tensors, *args)
    assert_all_close(out, out_ref)
    assert_all_close(grads, grads_ref)
    assert recorder.frames == 1 and len(recorder.backward) == 1
    assert only(recorder.counts("forward", "dsa"), FORWARD_OPS) == {op: 1 for op in FORWARD_OPS}
    backward = recorder.counts("backward", "dsa")
    assert only(backward, FORWARD_OPS) == {op: 1 for op in policies.recomputed_ops(resolve(policy))}
    assert only(backward, BACKWARD_OPS) == {op: 1 for op in BACKWARD_OPS}
