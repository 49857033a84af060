"""Runs every TileLang kernel once or more at small shapes, for compute-sanitizer.

    compute-sanitizer --tool racecheck python tools/sanitize_kernels.py [dplr | dsa]
    compute-sanitizer --tool memcheck  python tools/sanitize_kernels.py [dplr | dsa]

(a family's kernels only with its name; both without).

Covers the six kernels (intra fwd/bwd in both gate schemes, WY fwd/bwd, state fwd/bwd) at
K = V = 64 and 128 and chunk 16 and 64, rect with state and varlen (empty and 1-token
sequences, a partial last chunk) without, through the public op (forward + backward), each on
a small grid (2 heads: the state backward runs its split kernels) and on one with as many
(sequence, head) pairs as SMs (its single kernel); then the fused no-grad forward
(C = K = V = 64) rect with state and varlen, with enough pairs for it to apply; then every
variant of the DSA sparse MLA kernels (``csrc_tl.dsa_sparse_mla_fwd`` / ``_bwd``: each (D_qk,
d_v) x dtype x heads per CTA; at 64 heads per CTA the forward both as its warp-specialized
schedule ``_fwd_ws`` and as the two-warpgroup kernel) once, through
``torch.ops.dsa.sparse_mla_fwd``'s autograd, with a padded head block, k not a multiple of the
slot block, -1 and out-of-range slots, a row without a valid slot, kv rows shared by many
tokens (the backward's atomics) and a kv longer than q; then every variant of the DSA indexer
kernels (``csrc_tl.dsa_indexer_topk``, ``dsa_indexer_fwd`` / ``_bwd``: each (H_idx, D_idx) x
dtype) through ``dsa::indexer_topk`` and ``dsa::indexer_fwd``'s autograd, packed sequences with
an empty one, a short one and a padding tail, top-k rows with -1 tails and out-of-range slots;
then every variant of the KL loss forward (``csrc_tl.dsa_indexer_loss``) and its Triton
backward through ``dsa::indexer_loss_fwd``'s autograd, with a padded head, slots past kv and
padding rows; fails if any stage or DSA op fell back to its PyTorch kernel.
"""
from __future__ import annotations

import sys

import torch

import torch_dplr
from csrc_tl import dsa_indexer_loss, dsa_sparse_mla_fwd
from torch_dplr.dsa.testing import forbid_pytorch_kernels
from torch_dplr.testing import RWKV7_BOUND, forbid_pytorch_stages, make_inputs


def run(C, K, bounded, varlen, H):
    inp = make_inputs(1 if varlen else 2, 150, H, K, dtype=torch.bfloat16, device="cuda",
                      gates="rwkv7" if bounded else "unbounded", num_states=2)
    names = ["q", "k", "v", "a", "b", "gk"] + ([] if varlen else ["initial_state"])
    leaves = {n: inp[n].requires_grad_() for n in names}
    cu = torch.tensor([0, 0, 1, C + 5, 150], device="cuda") if varlen else None
    o, ht = torch_dplr.chunk_dplr_delta_rule(
        *(leaves[n] for n in names[:6]), initial_state=leaves.get("initial_state"),
        output_final_state=not varlen, cu_seqlens=cu, chunk_size=C,
        lower_bound=RWKV7_BOUND if bounded else None)
    (o.float().sum() + (ht.sum() if ht is not None else 0)).backward()
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and all(torch.isfinite(t.grad).all() for t in leaves.values())


def run_fused(varlen):
    from torch_dplr.ops.fused import fused_kernel

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cu = torch.tensor([0, 0, 1, 69, 150], device="cuda") if varlen else None
    H = -(-sms // (4 if varlen else 2))  # enough (sequence, head) pairs for the fused kernel
    inp = make_inputs(1 if varlen else 2, 150, H, 64, dtype=torch.bfloat16, device="cuda",
                      num_states=4 if varlen else 2)
    args = [inp[n] for n in ("q", "k", "v", "a", "b", "gk")]
    empty = torch.empty(0, dtype=torch.long, device="cuda")
    assert fused_kernel(args[0], args[2], args[5], empty if cu is None else cu, 64,
                        RWKV7_BOUND) is not None, "the fused kernel would not run"
    with torch.no_grad():
        o, ht = torch_dplr.chunk_dplr_delta_rule(
            *args, initial_state=inp["initial_state"], output_final_state=True, cu_seqlens=cu,
            chunk_size=64, lower_bound=RWKV7_BOUND)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()


# heads per DSA variant's block: a full block, a padded one, two blocks of 64 (one padded)
DSA_HEADS = {16: 16, 32: 20, 64: 96}


def run_dsa(config):
    """One sparse MLA variant, forward and backward: T 40, T_kv 150, k 100 (slot blocks of 32
    or 64: a partial last one)."""
    D_qk, d_v, dtype = config["D_qk"], config["d_v"], getattr(torch, config["dtype"])
    H = DSA_HEADS[config["block_H"]]
    assert dsa_sparse_mla_fwd.config_for(D_qk, d_v, H, dtype) == config
    T, T_kv, k = 40, 150, 100
    gen = torch.Generator().manual_seed(H)
    q = torch.randn(T, H, D_qk, generator=gen).to("cuda", dtype).requires_grad_()
    kv = torch.randn(T_kv, D_qk, generator=gen).to("cuda", dtype).requires_grad_()
    idx = torch.stack([torch.randperm(T_kv + 1, generator=gen)[:k] - 1 for _ in range(T)])
    idx[:, ::7] = T_kv + 3  # out of range: an empty slot, never read
    idx[5] = -1  # no valid slot
    idx = idx.to("cuda", torch.int32)
    o, lse = torch.ops.dsa.sparse_mla_fwd(q, kv, idx, D_qk ** -0.5, d_v)
    finite = torch.where(torch.isfinite(lse), lse, 0.0)
    (o.float().sum() + finite.sum()).backward()
    torch.cuda.synchronize()
    assert all(torch.isfinite(x).all() for x in (o, q.grad, kv.grad))


#: (H_idx, D_idx, dtype) of each indexer variant, in ``csrc_tl.dsa_indexer_fwd.variants()``'s
#: order (the top-k kernel has the same variants)
INDEXER_CASES = ((64, 128, "bfloat16"), (64, 128, "float16"), (32, 64, "bfloat16"),
                 (32, 64, "float16"))


def run_indexer(H, D, dtype_name):
    """Top-k selection, then the index scores forward and backward, at T 300 in four packed
    sequences (an empty one, one token, a padding tail of 20 rows), k 100."""
    dtype = getattr(torch, dtype_name)
    T, k = 300, 100
    gen = torch.Generator().manual_seed(H + D)
    q = torch.randn(T, H, D, generator=gen).to("cuda", dtype).requires_grad_()
    key = torch.randn(T, D, generator=gen).to("cuda", dtype).requires_grad_()
    w = torch.randn(T, H, generator=gen).to("cuda").requires_grad_()
    cu = torch.tensor([0, 0, 1, 150, 280], dtype=torch.int32, device="cuda")
    indices = torch.ops.dsa.indexer_topk(q.detach(), key.detach(), w.detach(), cu, k)
    indices[::9, -3:] = T + 5  # out of range: an empty slot, never read
    scores = torch.ops.dsa.indexer_fwd(q, key, w, indices)
    scores.masked_fill(~scores.isfinite(), 0.0).sum().backward()  # empty slots: -inf
    torch.cuda.synchronize()
    assert all(torch.isfinite(x).all() for x in (q.grad, key.grad, w.grad))


def run_loss(config):
    """The KL loss forward at one variant (``csrc_tl.dsa_indexer_loss.variants()``) and its
    backward (the Triton kernel ``csrc_triton.dsa_loss_bwd``), through the op's autograd: T 200,
    k 150 random keys of a kv of 180 rows (blocks of 64 or 128 slots, the last partial), -1
    tails, slots past T_kv, 10 padding rows without a slot, H one below the CTA's heads (a
    padded head)."""
    D_qk, heads, dtype = config["D_qk"], config["heads"], getattr(torch, config["dtype"])
    T, T_kv, k, H = 200, 180, 150, config["heads"] - 1
    assert dsa_indexer_loss.config_for(D_qk, H, dtype) == config
    gen = torch.Generator().manual_seed(D_qk + heads)
    q = torch.randn(T, H, D_qk, generator=gen).to("cuda", dtype)
    kv = torch.randn(T_kv, D_qk, generator=gen).to("cuda", dtype)
    indices = torch.randint(0, T_kv, (T, k), generator=gen, dtype=torch.int32).cuda()
    indices[:, k - 20:] = -1
    indices[::7, 3] = T_kv + 3  # past kv: p = 0, never gathered
    indices[190:] = -1  # padding rows: no valid slot
    scores = torch.randn(T, k, generator=gen).cuda().requires_grad_()
    lse = torch.randn(T, H, generator=gen).cuda() + 8
    loss, target = torch.ops.dsa.indexer_loss_fwd(scores, q, kv, indices, lse, D_qk ** -0.5,
                                                  0.1, "mean")
    loss.backward()
    torch.cuda.synchronize()
    assert torch.isfinite(loss) and torch.isfinite(target).all()
    assert torch.isfinite(scores.grad).all()


def run_dplr():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with forbid_pytorch_stages():
        for C in (16, 64):
            for K in (64, 128):
                for bounded, varlen in ((True, False), (False, True)):
                    # 2 heads: the split state backward; 2 sequences x sms heads: the single one
                    for H in (2, sms):
                        run(C, K, bounded, varlen, H)
                        print(f"ran C={C} K={K} bounded={bounded} varlen={varlen} H={H}",
                              flush=True)
        for varlen in (False, True):
            run_fused(varlen)
            print(f"ran fused forward varlen={varlen}", flush=True)


def main(argv=None) -> int:
    families = sys.argv[1:] if argv is None else argv
    if not set(families) <= {"dplr", "dsa"}:
        print(f"usage: {sys.argv[0]} [dplr | dsa]", file=sys.stderr)
        return 2
    if not families or "dplr" in families:
        run_dplr()
    if not families or "dsa" in families:
        from benchmarks.envvars import scoped_env
        from torch_dplr.dsa.ops import sparse_mla

        # every DSA op on its GPU kernel, a fallback raising
        with forbid_pytorch_kernels():
            # the backward's variants are the forward's; at 64 heads per CTA the forward runs
            # the warp-specialized schedule, and once more switched to the two-warpgroup one
            for config in dsa_sparse_mla_fwd.variants():
                run_dsa(config)
                print(f"ran DSA sparse MLA fwd + bwd {config}", flush=True)
            with scoped_env(sparse_mla.FWD_WS_SWITCH, "0"):
                for config in dsa_sparse_mla_fwd.variants():
                    if config["block_H"] == 64:
                        run_dsa(config)
                        print(f"ran DSA sparse MLA two-warpgroup fwd {config}", flush=True)
            for case in INDEXER_CASES:
                run_indexer(*case)
                print(f"ran DSA indexer top-k + scores fwd + bwd {case}", flush=True)
            for config in dsa_indexer_loss.variants():
                run_loss(config)
                print(f"ran DSA KL loss fwd + bwd {config}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
