"""Selective-checkpoint policies (torch_dplr.policies): same gradients as no checkpoint, and the
backward recomputes exactly the ``dplr`` forward ops ``recomputed_ops(policy)`` names.

Eagerly the recomputation is counted with a dispatch mode active during ``.backward()``;
under ``torch.compile(checkpoint(fn))`` it is read off AOT autograd's backward graph, where
SAC puts the recomputed ops.
"""
from collections import Counter

import pytest
import torch

from torch_dplr import policies

from ._support import (ARG_NAMES, BACKWARD_OPS, CHUNK_FWD, FORWARD_OPS, INDUCTOR_DTYPES,
                       INDUCTOR_TOL, RECURRENT_FWD, SPLIT_FWD, DispatchCounter,
                       assert_all_close, block_input, checkpointed, differentiable, dplr,
                       dtype_id, make_block, make_inputs, recurrent_fn, run_and_grad,
                       two_chunk_calls)

# the chunked forward ops a policy saves or recomputes (not the chunk tables, always kept):
# the stage ops, or chunk_fwd in the two-op training pass
CHUNK_STAGES = CHUNK_FWD & FORWARD_OPS
SPLIT_STAGES = SPLIT_FWD & FORWARD_OPS

CUSTOM_POLICIES = {
    "custom_save_wy": frozenset({dplr.chunk_wy_fwd.default}),
    "custom_save_intra_state": frozenset({dplr.chunk_intra_fwd.default,
                                          dplr.chunk_state_fwd.default}),
}
POLICY_CASES = [*policies.POLICIES, *CUSTOM_POLICIES]


def resolve(policy_id):
    return CUSTOM_POLICIES.get(policy_id, policy_id)


# Regions under test: each returns (fn, tensors the loss is differentiated against, args, kwargs).
def region_two_chunk_calls():
    x = make_inputs(T=41, initial_state=True)
    return two_chunk_calls, differentiable(x), [x[n] for n in ARG_NAMES], \
        dict(initial_state=x["initial_state"])


def region_two_chunk_calls_varlen():
    x = make_inputs(B=1, T=50, cu_seqlens=[0, 17, 50], initial_state=True)
    return two_chunk_calls, differentiable(x), [x[n] for n in ARG_NAMES], \
        dict(initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])


def region_recurrent():
    x = make_inputs(T=21, initial_state=True)
    return recurrent_fn, differentiable(x), [x[n] for n in ARG_NAMES], \
        dict(initial_state=x["initial_state"])


def region_rwkv7_block(dtype=torch.float32):
    block, x = make_block(dtype=dtype), block_input(T=37, dtype=dtype)
    return block, [x, *block.parameters()], [x], {}


REGIONS = {"two_chunk_calls": region_two_chunk_calls,
           "two_chunk_calls_varlen": region_two_chunk_calls_varlen,
           "recurrent": region_recurrent,
           "rwkv7_block": region_rwkv7_block,
           # the same chunked regions in the two-op training pass
           "two_chunk_calls_split": region_two_chunk_calls,
           "two_chunk_calls_varlen_split": region_two_chunk_calls_varlen,
           "rwkv7_block_split": region_rwkv7_block}


def stage_ops(region, request):
    """The forward ops a policy decides on in ``region`` (the recurrent op, the stage ops, or
    ``chunk_fwd``); a ``_split`` region turns the two-op pass on for the test."""
    if region == "recurrent":
        return RECURRENT_FWD
    if region.endswith("_split"):
        request.getfixturevalue("split_pass")
        return SPLIT_STAGES
    return CHUNK_STAGES


def only(counts, ops):
    return Counter({op: n for op, n in counts.items() if op in ops})


def expected_recompute(policy, forward_calls):
    """Each recomputed op runs again once per call in the region; every other op never."""
    return Counter({op: forward_calls[op] for op in policies.recomputed_ops(policy)
                    if forward_calls[op]})


def test_shipped_policies_recompute_what_they_document():
    intra, wy = dplr.chunk_intra_fwd.default, dplr.chunk_wy_fwd.default
    assert policies.recomputed_ops("recompute_all") == FORWARD_OPS
    assert policies.recomputed_ops("save_state") & CHUNK_STAGES == {intra, wy}
    assert not policies.recomputed_ops("save_state") & SPLIT_STAGES  # the states are kept
    assert policies.recomputed_ops("save_all") == frozenset()
    assert policies.recomputed_ops({wy}) == FORWARD_OPS - {wy}


def test_every_policy_keeps_the_chunk_tables():
    from torch.utils.checkpoint import CheckpointPolicy

    for name in policies.POLICIES:
        decide = policies.policy_fn(name)
        assert decide(None, dplr.chunk_tables.default) == CheckpointPolicy.MUST_SAVE, name


def test_unknown_policy_name_raises():
    with pytest.raises(ValueError, match="save_state"):
        policies.context_fn("save_everything")
    with pytest.raises(ValueError):
        policies.recomputed_ops("recompute")


@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("policy", POLICY_CASES)
def test_policy_eager(policy, region, request):
    stages = stage_ops(region, request)
    fn, tensors, args, kwargs = REGIONS[region]()
    out_ref, grads_ref = run_and_grad(fn, tensors, *args, **kwargs)

    fwd, bwd = DispatchCounter(), DispatchCounter()
    out, grads = run_and_grad(checkpointed(fn, resolve(policy)), tensors, *args,
                              forward_ctx=fwd, backward_ctx=bwd, **kwargs)
    assert_all_close(out, out_ref)
    assert_all_close(grads, grads_ref)

    forward_calls = only(fwd.counts, FORWARD_OPS)
    calls = 2 if region.startswith("two_chunk") else 1
    assert forward_calls == {op: calls for op in stages}
    assert only(bwd.counts, FORWARD_OPS) == expected_recompute(resolve(policy), forward_calls)
    assert dplr.chunk_tables.default not in bwd.counts  # kept, never rebuilt
    # The backward ops run once per call whatever the policy (recompute adds, never replaces).
    assert sum(only(bwd.counts, BACKWARD_OPS).values()) == sum(forward_calls.values())


COMPILED_CASES = [(policy, region) for policy in policies.POLICIES
                  for region in ("two_chunk_calls", "two_chunk_calls_varlen", "rwkv7_block",
                                 "two_chunk_calls_split", "rwkv7_block_split")]
COMPILED_CASES += [(policy, "two_chunk_calls") for policy in CUSTOM_POLICIES]


@pytest.mark.parametrize("policy,region", COMPILED_CASES)
def test_policy_compiled(recorder, policy, region, request):
    """``torch.compile(checkpoint(fn, context_fn=policy))``: one graph, same gradients, and
    the backward graph recomputes exactly the policy's ops."""
    stages = stage_ops(region, request)
    fn, tensors, args, kwargs = REGIONS[region]()
    out_ref, grads_ref = run_and_grad(fn, tensors, *args, **kwargs)

    compiled = torch.compile(checkpointed(fn, resolve(policy)), backend=recorder,
                             fullgraph=True)
    out, grads = run_and_grad(compiled, tensors, *args, **kwargs)
    assert_all_close(out, out_ref)
    assert_all_close(grads, grads_ref)

    assert recorder.frames == 1
    calls = 2 if region.startswith("two_chunk") else 1
    forward_calls = only(recorder.counts("forward"), FORWARD_OPS)
    assert forward_calls == {op: calls for op in stages}
    assert len(recorder.backward) == 1
    backward = recorder.counts("backward")
    assert only(backward, FORWARD_OPS) == expected_recompute(resolve(policy), forward_calls)
    assert dplr.chunk_tables.default not in backward  # kept, never rebuilt
    assert sum(only(backward, BACKWARD_OPS).values()) == sum(forward_calls.values())


@pytest.mark.parametrize("policy", [*policies.POLICIES])
def test_policy_compiled_recurrent(recorder, policy):
    """``recurrent_bwd`` reads only the region's inputs, so under compile nothing needs
    recomputing, whatever the policy: the partitioner drops ``recurrent_fwd`` from the
    backward (eager checkpointing reruns the whole region instead, see test_policy_eager)."""
    fn, tensors, args, kwargs = region_recurrent()
    out_ref, grads_ref = run_and_grad(fn, tensors, *args, **kwargs)
    compiled = torch.compile(checkpointed(fn, policy), backend=recorder, fullgraph=True)
    out, grads = run_and_grad(compiled, tensors, *args, **kwargs)
    assert_all_close(out, out_ref)
    assert_all_close(grads, grads_ref)
    assert recorder.frames == 1
    assert recorder.counts("forward") == {dplr.recurrent_fwd.default: 1}
    assert recorder.counts("backward") == {dplr.recurrent_bwd.default: 1}


# ---------------------------------------------------------------------------------------------
# extra_save_ops: non-dplr ops (the block's projections) kept instead of recomputed
# ---------------------------------------------------------------------------------------------

MM = torch.ops.aten.mm.default


def mm_calls_eager(policy=None, extra_save_ops=()):
    """(aten.mm calls in the block's forward, in its backward, the backward's counter)."""
    fn, tensors, args, kwargs = region_rwkv7_block()
    if policy is not None:
        fn = checkpointed(fn, policy, extra_save_ops)
    fwd, bwd = DispatchCounter(), DispatchCounter()
    run_and_grad(fn, tensors, *args, forward_ctx=fwd, backward_ctx=bwd, **kwargs)
    return fwd.counts[MM], bwd.counts[MM], bwd


def test_extra_save_ops_eager():
    fwd_mm, base_bwd_mm, _ = mm_calls_eager()
    assert fwd_mm == 6  # r, k, v, w, iclr, out projections
    _, bwd_mm, _ = mm_calls_eager("save_state")
    # Projections are recomputed by default (all but the output projection: nothing after it
    # is needed, and non-reentrant checkpoint stops recomputing early) ...
    assert base_bwd_mm < bwd_mm <= base_bwd_mm + fwd_mm
    _, bwd_mm, bwd = mm_calls_eager("save_state", extra_save_ops={MM})
    assert bwd_mm == base_bwd_mm  # ... and kept when listed
    # The dplr part of the policy is unchanged by extra_save_ops.
    assert only(bwd.counts, FORWARD_OPS) == {op: 1 for op in policies.recomputed_ops("save_state")
                                            if op in CHUNK_STAGES}


def test_extra_save_ops_compiled(recorder):
    """Under compile: the backward graph recomputes the projections' mm unless listed in
    ``extra_save_ops`` (with ``save_all`` no dplr op is left to recompute either)."""
    def backward_mm(policy, extra=()):
        recorder.backward.clear()
        torch._dynamo.reset()
        fn, tensors, args, kwargs = region_rwkv7_block()
        if policy is not None:
            fn = checkpointed(fn, policy, extra)
        out, grads = run_and_grad(torch.compile(fn, backend=recorder, fullgraph=True), tensors,
                                  *args, **kwargs)
        return recorder.counts("backward", namespace=None), grads

    base, grads_ref = backward_mm(None)
    recompute, grads_recompute = backward_mm("save_all")
    saved, grads_saved = backward_mm("save_all", {MM})
    assert recompute[MM] > base[MM]
    assert saved[MM] == base[MM]
    assert only(saved, FORWARD_OPS) == {}
    assert_all_close(grads_recompute, grads_ref)
    assert_all_close(grads_saved, grads_ref)


# ---------------------------------------------------------------------------------------------
# Inductor
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", INDUCTOR_DTYPES, ids=dtype_id)
def test_policy_inductor(inductor_recorder, dtype):
    """The realistic set-up: Inductor compiles the checkpointed block, and its (Inductor
    partitioner's) backward graph recomputes what ``save_state`` says, nothing more.
    (bf16 on CUDA only: at a kernel head size it runs the TileLang kernels.)"""
    fn, tensors, args, kwargs = region_rwkv7_block(dtype)
    out_ref, grads_ref = run_and_grad(fn, tensors, *args, **kwargs)
    compiled = torch.compile(checkpointed(fn, "save_state"), backend=inductor_recorder,
                             fullgraph=True)
    out, grads = run_and_grad(compiled, tensors, *args, **kwargs)
    assert_all_close(out, out_ref, INDUCTOR_TOL)
    assert_all_close(grads, grads_ref, INDUCTOR_TOL)
    forward_calls = only(inductor_recorder.counts("forward"), FORWARD_OPS)
    assert forward_calls == {op: 1 for op in CHUNK_STAGES}
    assert only(inductor_recorder.counts("backward"), FORWARD_OPS) == \
        expected_recompute("save_state", forward_calls)


def test_policy_accepts_packets_and_names():
    from torch_dplr import policies
    by_overload = policies.recomputed_ops({torch.ops.dplr.chunk_state_fwd.default})
    assert policies.recomputed_ops({torch.ops.dplr.chunk_state_fwd}) == by_overload
    assert policies.recomputed_ops({"dplr::chunk_state_fwd"}) == by_overload
    assert policies.recomputed_ops({"chunk_state_fwd"}) == by_overload
    with pytest.raises(ValueError, match="unknown op"):
        policies.recomputed_ops({"chunk_state_fwdd"})
    with pytest.raises(TypeError, match="checkpoint policies take ops"):
        policies.context_fn({3})
