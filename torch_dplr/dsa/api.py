"""Public DSA functions: they validate, then only compose ``torch.ops.dsa.*`` ops, so under
``torch.compile(fullgraph=True)`` a model sees opaque ``dsa::`` nodes and no graph break.

Every tensor is packed along tokens (``[T, ...]``): a batch of sequences is flattened and
described by ``cu_seqlens``.  Token ``t`` of a sequence sees the keys of that sequence up to and
including itself; tokens at ``t >= cu_seqlens[-1]`` are padding and see none.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..api import _under_autocast
from . import ops  # noqa: F401  (registers torch.ops.dsa)
from . import validation as check

__all__ = ["DSAOutput", "dsa_attention", "indexer_topk", "sparse_mla", "indexer_kl_loss"]


class DSAOutput(NamedTuple):
    """What :func:`dsa_attention` returns."""

    o: Tensor                       # [T, H, d_v], q's dtype
    lse: Tensor                     # [T, H] fp32: log-sum-exp over the selected keys
    indices: Tensor                 # [T, topk] int32: the selected keys (reusable by another layer)
    indexer_loss: Optional[Tensor]  # 0-dim fp32, or None when indexer_loss_coeff == 0


def _cu_sentinel(cu_seqlens, like):
    """Fixed-arity ops: no ``cu_seqlens`` travels as a size-0 tensor (one sequence)."""
    return cu_seqlens if cu_seqlens is not None else like.new_empty(0, dtype=torch.int64)


def dsa_attention(q: Tensor, kv: Tensor, q_idx: Tensor, k_idx: Tensor, w: Tensor, *,
                  topk: int, scale: float, d_v: int, cu_seqlens: Optional[Tensor] = None,
                  cu_seqlens_cpu: Optional[Tensor] = None, indexer_loss_coeff: float = 0.0,
                  indexer_loss_reduction: str = "mean") -> DSAOutput:
    r"""DeepSeek sparse attention: lightning indexer, top-k selection, sparse MLA attention,
    and the indexer's KL loss when ``indexer_loss_coeff != 0``.

    ::

        score[t, s] = Σ_h w[t, h] · ReLU(q_idx[t, h] · k_idx[s])          (visible s)
        S_t         = the topk visible keys of highest score
        o[t, h]     = Σ_{s ∈ S_t} softmax_s(scale · q[t, h] · kv[s]) · kv[s, :d_v]
        loss        = coeff · mean_t KL(p_t ‖ softmax(score[t, S_t]))

    where ``p_t`` is the main attention over ``S_t`` averaged over heads (a constant).  ``o``
    gets gradients into ``q`` and ``kv``; the loss into ``q_idx``, ``k_idx`` and ``w`` only (the
    selection itself has none).  Detach the indexer's inputs in the model, as DeepSeek-V3.2
    does, so that the indexer learns from its loss alone.

    Args:
        q: ``[T, H, D_qk]`` queries (absorbed MLA: ``D_qk = kv_lora_rank + rope dim``).
        kv: ``[T, D_qk]`` one latent key-value row per token, shared by every head; its first
            ``d_v`` columns are the value.  Same dtype as ``q`` (bf16, fp16, fp32, fp64).
        q_idx: ``[T, H_idx, D_idx]`` indexer queries; ``k_idx``: ``[T, D_idx]`` indexer keys
            (one per token, shared by the index heads), same dtype as ``q_idx``.
        w: ``[T, H_idx]`` index-head weights, any float dtype.  No scaling is applied:
            DeepSeek-V3.2 multiplies ``w`` by ``H_idx ** -0.5 · D_idx ** -0.5`` first.
        topk: keys per query (DeepSeek: 2048); with fewer visible keys the rest of a row is
            ``-1`` and the row attends to what it sees.
        scale: softmax scale of ``q · kv`` (required: absorbed MLA's comes from the unabsorbed
            head dim, e.g. ``192 ** -0.5`` times YaRN's mscale² for DeepSeek-V3).
        d_v: value columns of ``kv`` (DeepSeek: 512 of 576).
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences, starting at 0, ending
            at most at ``T`` (later tokens are padding: zero output, ``lse = -inf``, no loss).
            None: one sequence of ``T`` tokens.
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens``; validation reads it instead of the device.
        indexer_loss_coeff: the KL loss's coefficient; 0 computes no loss.
        indexer_loss_reduction: ``"mean"`` over query rows with a selected key (Megatron-LM's
            default) or ``"sum"`` (its ``calculate_per_token_loss``).

    Returns:
        :class:`DSAOutput` ``(o, lse, indices, indexer_loss)``.

    Example: an absorbed-MLA attention layer with DSA (projections only sketched)::

        class DSAAttention(torch.nn.Module):
            def __init__(self, d_model, heads=4, kv_rank=64, rope=16, idx_heads=2, idx_dim=32,
                         topk=64):
                super().__init__()
                self.heads, self.kv_rank, self.topk = heads, kv_rank, topk
                self.idx_heads, self.idx_dim = idx_heads, idx_dim
                self.wq = torch.nn.Linear(d_model, heads * (kv_rank + rope), bias=False)
                self.wkv = torch.nn.Linear(d_model, kv_rank + rope, bias=False)
                self.wq_idx = torch.nn.Linear(d_model, idx_heads * idx_dim, bias=False)
                self.wk_idx = torch.nn.Linear(d_model, idx_dim, bias=False)
                self.w_idx = torch.nn.Linear(d_model, idx_heads, bias=False)
                self.wo = torch.nn.Linear(heads * kv_rank, d_model, bias=False)
                self.scale = (kv_rank + rope) ** -0.5

            def forward(self, x, cu_seqlens=None):      # x: [T, d_model], packed tokens
                T = x.shape[0]
                q = self.wq(x).view(T, self.heads, -1)
                kv = self.wkv(x)
                xi = x.detach()                          # the indexer learns from its loss only
                q_idx = self.wq_idx(xi).view(T, self.idx_heads, self.idx_dim)
                w = self.w_idx(xi) * (self.idx_heads * self.idx_dim) ** -0.5
                out = torch_dplr.dsa.dsa_attention(
                    q, kv, q_idx, self.wk_idx(xi), w, topk=self.topk, scale=self.scale,
                    d_v=self.kv_rank, cu_seqlens=cu_seqlens, indexer_loss_coeff=0.01)
                return self.wo(out.o.reshape(T, -1)), out.indexer_loss

        y, indexer_loss = layer(x, cu_seqlens)
        (lm_loss(y) + indexer_loss).backward()
    """
    q, kv, q_idx, k_idx = _under_autocast(dict(q=q, kv=kv, q_idx=q_idx, k_idx=k_idx)).values()
    T, device = check.check_index_inputs(q_idx, k_idx, w)
    check.check_attention_inputs(q, kv, scale, d_v, device=device, tokens=(T, "q_idx"))
    check.check_topk(topk)
    check.check_loss_options(indexer_loss_coeff, indexer_loss_reduction,
                             "indexer_loss_coeff", "indexer_loss_reduction")
    check.check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T, device)
    scale = float(scale)
    indices = torch.ops.dsa.indexer_topk(q_idx, k_idx, w, _cu_sentinel(cu_seqlens, q), topk)
    o, lse = torch.ops.dsa.sparse_mla_fwd(q, kv, indices, scale, d_v)
    loss = None
    if indexer_loss_coeff != 0:
        scores = torch.ops.dsa.indexer_fwd(q_idx, k_idx, w, indices)
        loss, _ = torch.ops.dsa.indexer_loss_fwd(scores, q.detach(), kv.detach(), indices,
                                                 lse.detach(), scale, float(indexer_loss_coeff),
                                                 indexer_loss_reduction)
    return DSAOutput(o, lse, indices, loss)


def indexer_topk(q_idx: Tensor, k_idx: Tensor, w: Tensor, topk: int, *,
                 cu_seqlens: Optional[Tensor] = None,
                 cu_seqlens_cpu: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The lightning indexer's top-k selection: ``(indices, scores)``.

    ``indices [T, topk]`` int32: the selected key positions per query, ascending, ``-1`` in the
    slots left when fewer keys are visible; among equal scores the earlier key wins.
    ``scores [T, topk]`` fp32: their index scores (``-inf`` on ``-1`` slots), differentiable
    with respect to ``q_idx``, ``k_idx`` and ``w``.  Shapes and dtypes as in
    :func:`dsa_attention`.
    """
    q_idx, k_idx = _under_autocast(dict(q_idx=q_idx, k_idx=k_idx)).values()
    T, device = check.check_index_inputs(q_idx, k_idx, w)
    check.check_topk(topk)
    check.check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T, device)
    indices = torch.ops.dsa.indexer_topk(q_idx, k_idx, w, _cu_sentinel(cu_seqlens, q_idx), topk)
    return indices, torch.ops.dsa.indexer_fwd(q_idx, k_idx, w, indices)


def sparse_mla(q: Tensor, kv: Tensor, indices: Tensor, *, scale: float, d_v: int,
               cu_seqlens: Optional[Tensor] = None,
               cu_seqlens_cpu: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of each query over its selected keys: ``(o [T, H, d_v], lse [T, H] fp32)``.

    ``indices [T, k]`` int32, any order, ``-1`` for an unused slot; each valid index must be a
    key its query may see under ``cu_seqlens`` (checked outside torch.compile, with one device
    read).  A row with no valid index gives ``o = 0`` and ``lse = -inf``.
    """
    q, kv = _under_autocast(dict(q=q, kv=kv)).values()
    T, _ = check.check_attention_inputs(q, kv, scale, d_v)
    cu_values = check.check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T, q.device)
    check.check_indices(indices, T, q.device, cu_values)
    return torch.ops.dsa.sparse_mla_fwd(q, kv, indices, float(scale), d_v)


def indexer_kl_loss(scores: Tensor, q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *,
                    scale: float, coeff: float = 1.0, reduction: str = "mean",
                    cu_seqlens: Optional[Tensor] = None,
                    cu_seqlens_cpu: Optional[Tensor] = None) -> Tensor:
    """The indexer's KL loss over the selected keys (0-dim fp32).

    ``coeff · mean over rows with a valid slot of KL(p ‖ softmax(scores))`` (``reduction="sum"``:
    the sum), ``p`` the head-averaged main attention ``exp(scale · q · kv - lse)`` over the
    row's selected keys, renormalized.  ``q``, ``kv`` and ``lse`` are constants here (detached);
    only ``scores`` gets a gradient.
    """
    q, kv = _under_autocast(dict(q=q, kv=kv)).values()
    T, H = check.check_attention_inputs(q, kv, scale)
    cu_values = check.check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T, q.device)
    check.check_indices(indices, T, q.device, cu_values)
    check.check_scores(scores, indices.shape, q.device)
    check.check_lse(lse, T, H, q.device)
    check.check_loss_options(coeff, reduction)
    loss, _ = torch.ops.dsa.indexer_loss_fwd(scores, q.detach(), kv.detach(), indices,
                                             lse.detach(), float(scale), float(coeff), reduction)
    return loss
