"""Prefill then decode equals one prefill: a chunked call's final state handed to per-token
decode (fused_recurrent_rwkv7, fused_mul_recurrent_rwkv7, the state pool) continues exactly
where one long chunked call over the same tokens goes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_dplr
from torch_dplr.testing import RWKV7_BOUND, TOLERANCES, make_gates, recurrence_oracle, rms_ratio

H, K = 2, 16
DTYPES = (torch.float64, torch.bfloat16)


def _rwkv7(T, dtype, seed=0, B=1):
    """RWKV-7 inputs in the layer's terms: r, w, k, v, kk, iclr (w fp32, fp64 with fp64)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda: torch.randn(B, T, H, K, generator=g)  # noqa: E731
    x = dict(r=rand(), k=rand() * K ** -0.5, v=rand(), kk=F.normalize(rand(), dim=-1),
             iclr=torch.sigmoid(rand()))
    x = {n: t.to(dtype) for n, t in x.items()}
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    x["w"] = make_gates((B, T, H, K), "rwkv7", g).to(wide)
    return x


def _ab(x):
    return -x["kk"], x["kk"] * x["iclr"]


def _cut(x, start, end):
    return {n: t[:, start:end] for n, t in x.items()}


def _chunk(x, **kw):
    a, b = _ab(x)
    return torch_dplr.chunk_rwkv7(x["r"], x["w"], x["k"], x["v"], a, b, chunk_size=16,
                                  lower_bound=RWKV7_BOUND, output_final_state=True, **kw)


def _bars(dtype):
    """(outputs, states) bars: fp64 tight; bf16 data against the fp64 oracle at the suite's
    output bar (the state stays fp32, so it is held to the same bar)."""
    return (TOLERANCES[dtype][0],) * 2


def _oracle(x, cu=None):
    a, b = _ab(x)
    return recurrence_oracle(x["r"], x["k"], x["v"], a, b, x["w"], 1.0, None, cu)


def _decoders():
    """Per-token decode of ``x`` from state ``h`` by each public form: returns (o, state)."""
    def fused_recurrent(x, h):
        a, b = _ab(x)
        return torch_dplr.fused_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], a, b, scale=1.0,
                                                initial_state=h, output_final_state=True)

    def fused_mul(x, h):
        return torch_dplr.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], x["kk"],
                                                    x["iclr"], initial_state=h,
                                                    output_final_state=True)

    def pool(x, h):
        # the request's state in slot 3 of a pool whose other slots hold other histories
        N = h.shape[0]
        state_pool = torch.randn(N + 4, *h.shape[1:], dtype=h.dtype)
        slots = torch.arange(3, 3 + N, dtype=torch.int32)
        state_pool[slots.long()] = h
        a, b = _ab(x)
        with torch.no_grad():
            o = torch_dplr.rwkv7_decode(x["r"], x["w"], x["k"], x["v"], a, b, state_pool, slots)
        return o, state_pool[slots.long()]

    return dict(fused_recurrent=fused_recurrent, fused_mul=fused_mul, pool=pool)


DECODERS = _decoders()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_prefill_then_token_by_token_decode(decoder, dtype):
    """37 tokens prefilled (chunk 16: a partial last chunk), then 6 tokens one at a time."""
    B, prompt, steps = 2, 37, 6
    x = _rwkv7(prompt + steps, dtype, B=B)
    o_full, h_full = _chunk(x)
    o_pre, h = _chunk(_cut(x, 0, prompt))
    outs = []
    for t in range(prompt, prompt + steps):
        o_t, h = DECODERS[decoder](_cut(x, t, t + 1), h)
        outs.append(o_t)
    o_dec = torch.cat(outs, 1)
    o_bar, h_bar = _bars(dtype)
    if dtype == torch.float64:  # against the one long chunked call
        assert rms_ratio(o_dec, o_full[:, prompt:]) < o_bar
        assert rms_ratio(h, h_full) < h_bar
    o_ref, h_ref = _oracle(x)
    assert rms_ratio(torch.cat([o_pre, o_dec], 1), o_ref) < o_bar
    assert rms_ratio(o_dec, o_ref[:, prompt:]) < o_bar
    assert rms_ratio(h, h_ref) < h_bar


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_prefill_then_pool_decode_of_all_requests_at_once(dtype):
    """Three requests with prompts of 5, 23 and 40 tokens, prefilled in one packed call; their
    states go to arbitrary slots; then every step decodes all three in one call (T = 1), and
    the last step decodes a 3-token block per request (short T)."""
    prompts, steps, block = [5, 23, 40], 4, 3
    total = [p + steps + block for p in prompts]
    full = [_rwkv7(n, dtype, seed=10 + i) for i, n in enumerate(total)]
    cat = lambda parts: {n: torch.cat([p[n] for p in parts], 1) for n in parts[0]}  # noqa: E731
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])  # noqa: E731

    o_long, h_long = _chunk(cat(full), cu_seqlens=cu(total))
    _, h_pre = _chunk(cat([_cut(x, 0, p) for x, p in zip(full, prompts)]), cu_seqlens=cu(prompts))
    pool = torch_dplr.new_state_pool(8, H, K, dtype=h_pre.dtype)
    slots = torch.tensor([6, 1, 3], dtype=torch.int32)
    pool[slots.long()] = h_pre
    decoded = [[] for _ in prompts]
    with torch.no_grad():
        for s in range(steps):  # rect [3, 1]: one token per request
            step = {n: torch.cat([_cut(x, p + s, p + s + 1)[n] for x, p in zip(full, prompts)])
                    for n in full[0]}
            o = torch_dplr.rwkv7_decode(step["r"], step["w"], step["k"], step["v"], *_ab(step),
                                        pool, slots)
            for i in range(len(prompts)):
                decoded[i].append(o[i:i + 1])
        blk = cat([_cut(x, p + steps, p + steps + block) for x, p in zip(full, prompts)])
        o = torch_dplr.rwkv7_decode(blk["r"], blk["w"], blk["k"], blk["v"], *_ab(blk), pool,
                                    slots, cu_seqlens=cu([block] * 3).to(torch.int32))
        for i in range(len(prompts)):
            decoded[i].append(o[:, i * block:(i + 1) * block])

    starts = cu(total)[:-1].tolist()
    o_bar, h_bar = _bars(dtype)
    o_ref, h_ref = _oracle(cat(full), cu(total))
    for i, (p, start) in enumerate(zip(prompts, starts)):
        o_dec = torch.cat(decoded[i], 1)
        positions = slice(start + p, start + total[i])
        if dtype == torch.float64:
            assert rms_ratio(o_dec, o_long[:, positions]) < o_bar
        assert rms_ratio(o_dec, o_ref[:, positions]) < o_bar
    if dtype == torch.float64:
        assert rms_ratio(pool[slots.long()], h_long) < h_bar
    assert rms_ratio(pool[slots.long()], h_ref) < h_bar
    untouched = [0, 2, 4, 5, 7]
    assert not pool[untouched].any()


def test_fused_mul_form_is_the_dplr_recurrence_with_the_pair_formed_inside():
    """FLA's definition: a_dplr = -kk, b_dplr = kk·a (a the in-context rate), scale 1 by
    default, no final state unless asked; reverse walks each sequence backwards; varlen."""
    x = _rwkv7(9, torch.float64, seed=4)
    h0 = torch.randn(2, H, K, K, dtype=torch.float64)
    cu = torch.tensor([0, 4, 9])
    a, b = _ab(x)
    o, ht = torch_dplr.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], x["kk"],
                                                 x["iclr"], initial_state=h0,
                                                 output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = recurrence_oracle(x["r"], x["k"], x["v"], a, b, x["w"], 1.0, h0, cu)
    assert rms_ratio(o, o_ref) < 1e-12 and rms_ratio(ht, ht_ref) < 1e-12
    _, none = torch_dplr.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], x["kk"],
                                                   x["iclr"])
    assert none is None
    flip = {n: t.flip(1) for n, t in x.items()}
    o_rev, ht_rev = torch_dplr.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"],
                                                         x["kk"], x["iclr"], reverse=True,
                                                         output_final_state=True)
    o_flip, ht_flip = recurrence_oracle(flip["r"], flip["k"], flip["v"], *_ab(flip), flip["w"],
                                        1.0)
    assert rms_ratio(o_rev, o_flip.flip(1)) < 1e-12 and rms_ratio(ht_rev, ht_flip) < 1e-12


def test_fused_mul_form_names_its_own_arguments_in_errors():
    x = _rwkv7(3, torch.float32)
    with pytest.raises(ValueError, match="kk must have the shape of r"):
        torch_dplr.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], x["kk"][:, :2],
                                             x["iclr"])
    with pytest.raises(TypeError, match="a has dtype torch.float64"):
        torch_dplr.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], x["kk"],
                                             x["iclr"].double())
