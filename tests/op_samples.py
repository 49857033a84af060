"""Sample argument tuples for every dplr op: rect and varlen, odd T, with and without grad
(the no-grad op ``chunk_fwd_fused`` without)."""
from __future__ import annotations

import torch

from torch_dplr.testing import make_inputs

NO_BOUND = float("-inf")
CONFIGS = [  # (B, T, H, K, V, chunk_size, cu_seqlens, dtype)
    (2, 37, 2, 8, 6, 16, None, torch.float32),
    (1, 45, 2, 8, 8, 32, [0, 1, 13, 45], torch.float32),
    (1, 70, 1, 16, 16, 64, [0, 70], torch.float64),
    (2, 21, 2, 8, 8, 16, None, torch.bfloat16),
]


def _cu(cu, device):
    return torch.empty(0, dtype=torch.int64, device=device) if cu is None else \
        torch.tensor(cu, dtype=torch.int32, device=device)


def forward_samples(device="cpu"):
    """Yields (op_name, args) for the forward ops; requires_grad on floats in half of them."""
    for B, T, H, K, V, C, cu, dtype in CONFIGS:
        inp = make_inputs(B, T, H, K, V, dtype=dtype, device=device,
                          num_states=B if cu is None else len(cu) - 1)
        cu_t = _cu(cu, device)
        q, k, v, a, b, gk, h0 = (inp[n] for n in "q k v a b gk initial_state".split())
        intra_out = torch.ops.dplr.chunk_intra_fwd(q, k, a, b, gk, cu_t, 0.3, C, NO_BOUND)
        gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = intra_out
        _, w, u = torch.ops.dplr.chunk_wy_fwd(A_ab, A_ak, ag, v, cu_t, C)
        tables = torch.ops.dplr.chunk_tables(cu_t, B, T, C)
        yield "chunk_tables", (cu_t, B, T, C)
        for grad in (False, True):
            g = lambda x: x.detach().clone().requires_grad_(grad)  # noqa: E731
            # with grad: the packed chunk tables, as the public functions pass them (saved for
            # the backward); without: none, as a direct call (the op builds its own)
            t = (tables,) if grad else ()
            yield "chunk_intra_fwd", (g(q), g(k), g(a), g(b), g(gk), cu_t, 0.3, C, -0.6065, *t)
            yield "chunk_wy_fwd", (g(A_ab), g(A_ak), g(ag), g(v), cu_t, C, *t)
            yield "chunk_state_fwd", (g(qg), g(kg), g(bg), g(w), g(u), g(v), g(A_qk), g(A_qb),
                                      g(gl), g(h0), cu_t, C, True, True, *t)
            yield "recurrent_fwd", (g(q), g(k), g(v), g(a), g(b), g(gk), g(h0), cu_t, 0.3,
                                    True, grad)
            # a and b as RWKV-7's kk and a (fused_mul_recurrent_rwkv7's call)
            yield "recurrent_fwd", (g(q), g(k), g(v), g(a), g(b), g(gk), g(h0), cu_t, 0.3,
                                    True, False, True)
            yield "chunk_fwd", (g(q), g(k), g(v), g(a), g(b), g(gk), g(h0), cu_t, 0.3, C,
                                -0.6065, True, *t)
        yield "chunk_fwd", (q, k, v, a, b, gk, h0.new_empty(0), cu_t, 0.3, C, NO_BOUND, False)
        # Absent initial state and no kept activations (the no-grad forward's call).
        yield "chunk_state_fwd", (qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0.new_empty(0), cu_t, C,
                                  False, False)
        # The fused no-grad forward: never with requires_grad (its backward raises).
        yield "chunk_fwd_fused", (q, k, v, a, b, gk, h0, cu_t, 0.3, C, -0.6065, True, tables)
        yield "chunk_fwd_fused", (q, k, v, a, b, gk, h0.new_empty(0), cu_t, 0.3, C, NO_BOUND,
                                  False)


def backward_samples(device="cpu"):
    """Yields (op_name, args) for the backward ops, built from real forward results."""
    gen = torch.Generator().manual_seed(1)
    for B, T, H, K, V, C, cu, dtype in CONFIGS:
        inp = make_inputs(B, T, H, K, V, dtype=dtype, device=device,
                          num_states=B if cu is None else len(cu) - 1)
        cu_t = _cu(cu, device)
        q, k, v, a, b, gk, h0 = (inp[n] for n in "q k v a b gk initial_state".split())
        rand_like = lambda x: torch.randn(x.shape, generator=gen).to(x)  # noqa: E731
        intra_out = torch.ops.dplr.chunk_intra_fwd(q, k, a, b, gk, cu_t, 0.3, C, NO_BOUND)
        gl, A_qk, A_qb, A_ak, A_ab, qg, kg, ag, bg = intra_out
        yield "chunk_intra_bwd", (q, k, a, b, gk, cu_t, gl, *map(rand_like, intra_out), 0.3,
                                  C, NO_BOUND)
        A_inv, w, u = torch.ops.dplr.chunk_wy_fwd(A_ab, A_ak, ag, v, cu_t, C)
        yield "chunk_wy_bwd", (A_inv, A_ak, ag, v, rand_like(w), rand_like(u), cu_t, C,
                               torch.ops.dplr.chunk_tables(cu_t, B, T, C))
        o, ht, h, v_new = torch.ops.dplr.chunk_state_fwd(qg, kg, bg, w, u, v, A_qk, A_qb, gl, h0,
                                                         cu_t, C, True, True)
        for use_h0, use_dht in ((True, True), (False, False)):
            yield "chunk_state_bwd", (qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, rand_like(o),
                                      rand_like(ht) if use_dht else ht.new_empty(0),
                                      h0 if use_h0 else h0.new_empty(0), cu_t, C, use_h0, use_dht)
            yield "recurrent_bwd", (q, k, v, a, b, gk, h0 if use_h0 else h0.new_empty(0), cu_t,
                                    rand_like(o), rand_like(ht) if use_dht else ht.new_empty(0),
                                    0.3, use_h0, use_dht, False)
            yield "chunk_bwd", (q, k, v, a, b, gk, h0 if use_h0 else h0.new_empty(0), h, cu_t,
                                rand_like(o), rand_like(ht) if use_dht else ht.new_empty(0),
                                0.3, C, NO_BOUND, use_h0, use_dht)
