"""torch.compile(fullgraph=True) of dsa_attention and of a small DSA layer: one graph and no
break, the graphs hold the ``dsa::`` ops (forward ops in the forward, backward ops in the
backward, nothing recomputed), and outputs and every gradient equal eager."""
import pytest
import torch

from torch_dplr.dsa.testing import TinyDSALayer, attention_region, make_inputs

from ._support import (INDUCTOR_TOL, assert_all_close, index_tensor, on_device, run_and_grad)

dsa = torch.ops.dsa
FWD = {dsa.indexer_topk.default, dsa.sparse_mla_fwd.default}
FWD_LOSS = FWD | {dsa.indexer_fwd.default, dsa.indexer_loss_fwd.default}
BWD = {dsa.sparse_mla_bwd.default}
BWD_LOSS = BWD | {dsa.indexer_bwd.default, dsa.indexer_loss_bwd.default}
PACKED = [0, 9, 9, 10, 31]  # an empty and a 1-token sequence, 3 padding tokens


def inputs(T, seed=0):
    return {n: on_device(t).requires_grad_() for n, t in make_inputs(T, seed=seed).items()}


@pytest.mark.parametrize("packed", [False, True], ids=["one_sequence", "packed"])
@pytest.mark.parametrize("coeff", [0.0, 0.5], ids=["no_loss", "loss"])
def test_dsa_attention_fullgraph(recorder, packed, coeff):
    x = inputs(34)
    cu = index_tensor(PACKED) if packed else None
    tensors = list(x.values())
    compiled = torch.compile(attention_region, backend=recorder, fullgraph=True)
    out_c, grads_c = run_and_grad(compiled, tensors, *tensors, cu, coeff=coeff)
    out_e, grads_e = run_and_grad(attention_region, tensors, *tensors, cu, coeff=coeff)

    assert recorder.frames == 1
    fwd, bwd = (FWD_LOSS, BWD_LOSS) if coeff else (FWD, BWD)
    for which in ("dynamo", "forward"):
        assert recorder.counts(which, "dsa") == {op: 1 for op in fwd}, which
    assert len(recorder.backward) == 1
    assert recorder.counts("backward", "dsa") == {op: 1 for op in bwd}
    assert len(out_c) == (3 if coeff else 2)
    assert_all_close(out_c, out_e)
    assert_all_close(grads_c, grads_e)
    if not coeff:  # without the loss the indexer gets no gradient
        assert all(g is None for g in grads_c[2:])


def test_no_grad_call_compiles_to_the_forward_ops(recorder):
    x = {n: t.detach() for n, t in inputs(20).items()}
    compiled = torch.compile(attention_region, backend=recorder, fullgraph=True)
    with torch.no_grad():
        out_c = compiled(*x.values(), index_tensor([0, 12, 20]))
        out_e = attention_region(*x.values(), index_tensor([0, 12, 20]))
    assert recorder.frames == 1 and not recorder.backward
    assert recorder.counts("inference", "dsa") == {op: 1 for op in FWD_LOSS}
    assert_all_close(out_c, out_e)


def test_a_new_length_reuses_a_dynamic_graph(recorder):
    """A second length recompiles once with a symbolic T; a third reuses that graph."""
    compiled = torch.compile(attention_region, backend=recorder, fullgraph=True)
    for T in (21, 30, 26):
        x = inputs(T, seed=T)
        tensors = list(x.values())
        out_c, grads_c = run_and_grad(compiled, tensors, *tensors)
        out_e, grads_e = run_and_grad(attention_region, tensors, *tensors)
        assert_all_close(out_c, out_e)
        assert_all_close(grads_c, grads_e)
    assert recorder.frames == 2


def test_op_bodies_check_cu_seqlens_under_compile(recorder):
    """The trace reads no values: a malformed cu_seqlens is caught by the op body instead."""
    x = {n: t.detach() for n, t in inputs(12).items()}
    compiled = torch.compile(attention_region, backend=recorder, fullgraph=True)
    with pytest.raises(ValueError, match="non-decreasing"):
        compiled(*x.values(), index_tensor([0, 8, 4, 12]))


def test_dsa_layer_inductor(inductor_recorder):
    """The layer's projections around the dsa ops, compiled by Inductor."""
    torch.manual_seed(0)
    layer = TinyDSALayer().to(on_device(torch.zeros(0)).device)
    x = on_device(torch.randn(29, 32, generator=torch.Generator().manual_seed(1))).requires_grad_()
    cu = index_tensor([0, 11, 12, 29])
    tensors = [x, *layer.parameters()]
    compiled = torch.compile(layer, backend=inductor_recorder, fullgraph=True)
    out_c, grads_c = run_and_grad(compiled, tensors, x, cu)
    out_e, grads_e = run_and_grad(layer, tensors, x, cu)
    assert inductor_recorder.frames == 1
    assert inductor_recorder.counts("backward", "dsa") == {op: 1 for op in BWD_LOSS}
    assert_all_close(out_c, out_e, INDUCTOR_TOL)
    assert_all_close(grads_c, grads_e, INDUCTOR_TOL)
