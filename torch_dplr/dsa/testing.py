"""Test helpers for the DSA ops: input makers and a dense masked fp64 reference.

The reference holds the ``[T, T]`` matrices (test sizes only) and builds every result from
masks over the dense scores, independently of the ops' gather-based kernels; gradients come
from ``torch.autograd``.
"""
from __future__ import annotations

import contextlib

import torch

from ..testing import rms_ratio
from .reference.loss import EPS

# RMS(out - ref) / RMS(ref) bars per input dtype, against the fp64 reference on the same
# rounded inputs: ``o`` (rounded once to the input dtype), ``lse`` and the loss (fp32 outputs
# of fp32 accumulation: near fp32 round-off whatever the input dtype), the gradients.
TOLERANCES = {
    torch.bfloat16: dict(o=4e-3, lse=1e-6, loss=1e-6, grad=8e-3),
    torch.float16: dict(o=5e-4, lse=1e-6, loss=1e-6, grad=1e-3),
    torch.float32: dict(o=1e-6, lse=1e-6, loss=1e-6, grad=2e-6),
    torch.float64: dict(o=1e-12, lse=1e-12, loss=1e-12, grad=1e-12),
}
GRAD_NAMES = ("q", "kv", "q_idx", "k_idx", "w")


def make_inputs(T, H=3, D_qk=24, H_idx=2, D_idx=16, *, dtype=torch.float32, seed=0,
                device="cpu", index_scale=True) -> dict:
    """Random ``q, kv, q_idx, k_idx, w`` (drawn on the CPU in fp32, then cast and moved).

    ``w`` carries DeepSeek's ``(H_idx · D_idx) ** -0.5`` when ``index_scale``.
    """
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    w_scale = (H_idx * D_idx) ** -0.5 if index_scale else 1.0
    tensors = dict(q=rand(T, H, D_qk), kv=rand(T, D_qk), q_idx=rand(T, H_idx, D_idx),
                   k_idx=rand(T, D_idx), w=rand(T, H_idx) * w_scale)
    return {n: x.to(device=device, dtype=dtype) for n, x in tensors.items()}


def key_bounds(T: int, cu_seqlens) -> list[tuple[int, int]]:
    """Per token ``(first, last)`` visible key; ``(t + 1, t)`` (none) for padding tokens."""
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    bounds = [(t + 1, t) for t in range(T)]
    for start, end in zip(cu[:-1], cu[1:]):
        for t in range(start, end):
            bounds[t] = (start, t)
    return bounds


def visible_mask(T: int, cu_seqlens=None, device="cpu") -> torch.Tensor:
    """``[T, T]`` bool: query ``t`` may see key ``s``."""
    mask = torch.zeros(T, T, dtype=torch.bool, device=device)
    for t, (first, last) in enumerate(key_bounds(T, cu_seqlens)):
        mask[t, first:last + 1] = True
    return mask


def dense_index_scores(q_idx, k_idx, w) -> torch.Tensor:
    """``[T, T]`` fp64 ``Σ_h w · ReLU(q_idx · k_idx)`` for every pair (no mask)."""
    per_head = torch.einsum("thd,sd->ths", q_idx.double(), k_idx.double()).relu()
    return (per_head * w.double()[..., None]).sum(1)


def dense_topk(q_idx, k_idx, w, topk: int, cu_seqlens=None) -> torch.Tensor:
    """The top-k rule on the dense scores: the first ``topk`` of a stable descending sort (ties
    to the smaller position), invisible keys never, then ascending with ``-1`` after."""
    T = q_idx.shape[0]
    visible = visible_mask(T, cu_seqlens, q_idx.device)
    scores = dense_index_scores(q_idx, k_idx, w).masked_fill(~visible, float("-inf"))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
    chosen = visible.gather(1, order)
    key = torch.where(chosen, order, T).sort(dim=1).values
    out = torch.where(key == T, -1, key)
    if out.shape[1] < topk:  # topk > T: the rest of every row is empty
        out = torch.cat([out, out.new_full((T, topk - out.shape[1]), -1)], dim=1)
    return out.to(torch.int32)


def selection_mask(indices: torch.Tensor, T: int) -> torch.Tensor:
    """``[T, T]`` bool: key ``s`` is among row ``t``'s valid indices."""
    mask = torch.zeros(T, T + 1, dtype=torch.bool, device=indices.device)
    idx = indices.long()
    mask.scatter_(1, torch.where(idx >= 0, idx, T), True)
    return mask[:, :T]


def dense_sparse_mla(q, kv, indices, scale: float, d_v: int):
    """``(o, lse)`` in fp64 from a dense masked softmax; differentiable."""
    T = q.shape[0]
    sel = selection_mask(indices, T)
    rows = sel.any(dim=1)
    logits = torch.einsum("thd,sd->hts", q.double(), kv.double()) * scale
    masked = logits.masked_fill(~sel, float("-inf"))
    safe = torch.where(rows[None, :, None], masked, 0.0)  # keep empty rows finite for autograd
    lse_all = torch.logsumexp(safe, dim=-1)
    probs = torch.where(sel, torch.exp(safe - lse_all[..., None]), 0.0)
    o = torch.einsum("hts,sd->thd", probs, kv.double()[:, :d_v])
    lse = torch.where(rows[:, None], lse_all.T, float("-inf"))
    return o, lse, probs


def dense_indexer_loss(q_idx, k_idx, w, probs, indices, coeff: float, reduction="mean"):
    """The KL loss from the dense index scores (differentiable in ``q_idx, k_idx, w``) and the
    per-head main attention ``probs [H, T, T]`` of :func:`dense_sparse_mla` (a constant)."""
    T = q_idx.shape[0]
    sel = selection_mask(indices, T)
    rows = sel.any(dim=1)
    p = probs.detach().mean(0)
    p = p / p.sum(dim=-1, keepdim=True).clamp(min=EPS)
    scores = dense_index_scores(q_idx, k_idx, w).masked_fill(~sel, float("-inf"))
    log_q = torch.log_softmax(torch.where(rows[:, None], scores, 0.0), dim=-1)
    terms = torch.where(sel, p * (torch.log(p.clamp(min=EPS)) - log_q), 0.0)
    denom = 1.0 if reduction == "sum" else rows.sum().clamp(min=1).double()
    return coeff * terms.sum() / denom


def dense_dsa(q, kv, q_idx, k_idx, w, indices, *, scale, d_v, coeff, reduction="mean"):
    """``{o, lse, loss}`` of ``dsa_attention`` for given ``indices``, in fp64."""
    o, lse, probs = dense_sparse_mla(q, kv, indices, scale, d_v)
    loss = dense_indexer_loss(q_idx, k_idx, w, probs, indices, coeff, reduction)
    return dict(o=o, lse=lse, loss=loss)


def objective(o, lse, loss, seed=1):
    """A scalar touching every output: random weights on ``o`` and the finite ``lse`` entries,
    plus the loss."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    dlse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(o.device)
    finite_lse = torch.where(torch.isfinite(lse), lse.double(), 0.0)
    total = (o.double() * do).sum() + (finite_lse * dlse).sum()
    return total if loss is None else total + loss.double()


def parity_errors(T, H=3, D_qk=24, d_v=16, H_idx=2, D_idx=16, *, topk=8, cu_seqlens=None,
                  dtype=torch.float64, coeff=0.7, reduction="mean", seed=0, device="cpu"):
    """``{name: RMS(err) / RMS(ref)}`` of ``dsa_attention`` against the dense reference for
    ``o``, ``lse`` (finite entries; the ``-inf`` pattern must match), the loss and the
    gradients ``dq, dkv, dq_idx, dk_idx, dw``.  The reference uses the op's indices (a
    low-precision selection may differ from the fp64 one at near-ties); ``"indices"`` counts
    rows whose selection differs from the dense rule in fp64."""
    from .api import dsa_attention

    inp = make_inputs(T, H, D_qk, H_idx, D_idx, dtype=dtype, seed=seed, device=device)
    ours = {n: x.detach().clone().requires_grad_() for n, x in inp.items()}
    theirs = {n: x.detach().double().clone().requires_grad_() for n, x in inp.items()}
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    scale = D_qk ** -0.5
    out = dsa_attention(ours["q"], ours["kv"], ours["q_idx"], ours["k_idx"], ours["w"],
                        topk=topk, scale=scale, d_v=d_v, cu_seqlens=cu,
                        indexer_loss_coeff=coeff, indexer_loss_reduction=reduction)
    ref = dense_dsa(theirs["q"], theirs["kv"], theirs["q_idx"], theirs["k_idx"], theirs["w"],
                    out.indices, scale=scale, d_v=d_v, coeff=coeff, reduction=reduction)
    for name, x in (("o", out.o), ("loss", out.indexer_loss)):
        if not torch.isfinite(x).all():
            raise AssertionError(f"non-finite {name}")
    if not torch.equal(torch.isneginf(out.lse), torch.isneginf(ref["lse"])):
        raise AssertionError("lse is -inf on other rows than the reference's")
    finite = torch.isfinite(ref["lse"])
    errors = dict(o=rms_ratio(out.o, ref["o"]), lse=rms_ratio(out.lse[finite], ref["lse"][finite]),
                  loss=rms_ratio(out.indexer_loss, ref["loss"]))
    grads = torch.autograd.grad(objective(out.o, out.lse, out.indexer_loss),
                                [ours[n] for n in GRAD_NAMES])
    ref_grads = torch.autograd.grad(objective(ref["o"], ref["lse"], ref["loss"]),
                                    [theirs[n] for n in GRAD_NAMES])
    for name, g, r in zip(GRAD_NAMES, grads, ref_grads):
        if not torch.isfinite(g).all():
            raise AssertionError(f"non-finite gradient for {name}")
        errors["d" + name] = rms_ratio(g, r)
    if dtype == torch.float64:
        expected = dense_topk(inp["q_idx"], inp["k_idx"], inp["w"], topk, cu_seqlens)
        errors["indices"] = int((expected != out.indices).any(dim=1).sum())
    return errors


def attention_region(q, kv, q_idx, k_idx, w, cu_seqlens=None, *, topk=6, d_v=16, coeff=0.5):
    """``dsa_attention`` with its float outputs as a tuple ``(o, lse, loss)`` (``lse`` with its
    ``-inf`` rows as 0, so a weighted sum of the outputs stays finite; no loss when
    ``coeff == 0``): the region the compile and checkpoint tests run."""
    from .api import dsa_attention

    out = dsa_attention(q, kv, q_idx, k_idx, w, topk=topk, scale=q.shape[-1] ** -0.5, d_v=d_v,
                        cu_seqlens=cu_seqlens, indexer_loss_coeff=coeff)
    lse = torch.where(torch.isfinite(out.lse), out.lse, 0.0)
    return (out.o, lse) if out.indexer_loss is None else (out.o, lse, out.indexer_loss)


class TinyDSALayer(torch.nn.Module):
    """An absorbed-MLA attention layer with DSA at test sizes: query, latent key-value and
    indexer projections (the indexer reads a detached input, as DeepSeek-V3.2 trains it),
    ``dsa_attention``, an output projection.  Returns ``(y, indexer_loss)``."""

    def __init__(self, d_model=32, heads=3, kv_rank=16, rope=8, idx_heads=2, idx_dim=8, topk=6,
                 loss_coeff=0.5, dtype=torch.float32):
        super().__init__()
        self.heads, self.kv_rank, self.topk, self.loss_coeff = heads, kv_rank, topk, loss_coeff
        self.idx_heads, self.idx_dim = idx_heads, idx_dim
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False, dtype=dtype)  # noqa: E731
        self.wq, self.wkv = lin(d_model, heads * (kv_rank + rope)), lin(d_model, kv_rank + rope)
        self.wq_idx, self.wk_idx = lin(d_model, idx_heads * idx_dim), lin(d_model, idx_dim)
        self.w_idx, self.wo = lin(d_model, idx_heads), lin(heads * kv_rank, d_model)
        self.scale = (kv_rank + rope) ** -0.5

    def forward(self, x, cu_seqlens=None):
        from .api import dsa_attention

        T = x.shape[0]
        xi = x.detach()
        out = dsa_attention(self.wq(x).view(T, self.heads, -1), self.wkv(x),
                            self.wq_idx(xi).view(T, self.idx_heads, self.idx_dim),
                            self.wk_idx(xi),
                            self.w_idx(xi) * (self.idx_heads * self.idx_dim) ** -0.5,
                            topk=self.topk, scale=self.scale, d_v=self.kv_rank,
                            cu_seqlens=cu_seqlens, indexer_loss_coeff=self.loss_coeff)
        return self.wo(out.o.reshape(T, -1)), out.indexer_loss


@contextlib.contextmanager
def deterministic_algorithms():
    """Inside, PyTorch takes its deterministic implementations: on CUDA the PyTorch kernels'
    ``index_add_`` of the key gradients sums by atomics otherwise, so two calls of one kernel
    differ by fp32 reordering.  ``warn_only``: cuBLAS's workspace setting is not required."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


#: The PyTorch kernels that the DSA ops with a GPU kernel (TileLang; Triton for the KL loss's
#: backward) fall back to on CUDA:
#: (module of ``torch_dplr.dsa.ops``, function), a global its op's CUDA function calls.
PYTORCH_KERNELS = (("sparse_mla", "sparse_mla_fwd_reference"),
                   ("sparse_mla", "sparse_mla_bwd_reference"),
                   ("topk", "indexer_topk_reference"), ("indexer", "indexer_fwd_reference"),
                   ("indexer", "indexer_bwd_reference"), ("loss", "indexer_loss_fwd_reference"),
                   ("loss", "indexer_loss_bwd_reference"))


@contextlib.contextmanager
def forbid_pytorch_kernels():
    """Inside, a DSA op whose CUDA function would fall back to its PyTorch kernel raises
    instead: proof that a call ran its GPU kernel (GPU tests, the sanitizer driver)."""
    import importlib
    from unittest import mock

    def failing(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"{name} ran: the GPU kernel was not used")
        return fail

    with contextlib.ExitStack() as stack:
        for module, name in PYTORCH_KERNELS:
            ops_module = importlib.import_module(f"{__package__}.ops.{module}")
            stack.enter_context(mock.patch.object(ops_module, name, failing(name)))
        yield
