"""DeepSeek sparse attention (DSA, DeepSeek-V3.2 §2.1) as torch.compile-first ``dsa::`` ops.

Public functions (:mod:`.api`): :func:`dsa_attention` (the composed layer: indexer, top-k,
sparse MLA attention, indexer KL loss) and its stages :func:`indexer_topk`, :func:`sparse_mla`,
:func:`indexer_kl_loss`; checkpoint policies in :mod:`.policies`; the dense fp64 reference in
:mod:`.testing`.  Every tensor is packed along tokens (``[T, ...]``, sequences by
``cu_seqlens``); shapes: ``q [T, H, D_qk]``, ``kv [T, D_qk]``, ``q_idx [T, H_idx, D_idx]``,
``k_idx [T, D_idx]``, ``w [T, H_idx]``, ``indices [T, k]``.

Operators (``torch.ops.dsa.*``; functional, fixed arity, a fake and a plain-PyTorch kernel
each, registered for every device; an op with a GPU kernel registers it with
``register_kernel("cuda")``, same schema, and keeps the PyTorch kernel where it does not
apply):

============================  ==========================================  ====================
op                            returns                                     backward op
============================  ==========================================  ====================
``indexer_topk(q_idx, k_idx,  ``indices [T, topk]`` int32                  none (integer output)
w, cu_seqlens, topk)``
``sparse_mla_fwd(q, kv,       ``o [T, H, d_v]`` (q's dtype), ``lse [T, H]``  ``sparse_mla_bwd(q, kv,
indices, scale, d_v)``                                                    indices, o, lse, do,
                                                                          dlse, scale, d_v)``
                                                                          -> dq, dkv
``indexer_fwd(q_idx, k_idx,   ``scores [T, k]``                           ``indexer_bwd(q_idx,
w, indices)``                                                             k_idx, w, indices,
                                                                          dscores)`` -> dq_idx,
                                                                          dk_idx, dw
``indexer_loss_fwd(scores, q, ``loss`` (0-dim), ``target [T, k]``           ``indexer_loss_bwd(
kv, indices, lse, scale,                                                  scores, target,
coeff, reduction)``                                                       indices, dloss, coeff,
                                                                          reduction)`` -> dscores
============================  ==========================================  ====================

GPU kernels: on sm_90, ``sparse_mla_fwd`` / ``_bwd`` run the TileLang kernels
``csrc_tl.dsa_sparse_mla_fwd`` / ``_bwd`` for bf16 / fp16 data at (D_qk, d_v) = (576, 512),
(192, 128) or (64, 64), and ``indexer_topk``, ``indexer_fwd`` / ``_bwd`` theirs at
(H_idx, D_idx) = (64, 128) or (32, 64) (each op decides from shapes and dtypes only; a kernel's
``TORCH_DPLR_DSA_TILELANG_*=0`` keeps its op on the PyTorch kernel); docs/dsa.md lists which
calls take them.  The KL loss forward runs ``csrc_tl.dsa_indexer_loss`` there for
D_qk 576, 192 or 64 and its backward the Triton kernel ``csrc_triton.dsa_loss_bwd``
(``TORCH_DPLR_DSA_TILELANG_LOSS=0`` keeps both on their PyTorch kernels).  Above 32 heads the
sparse MLA forward runs its warp-specialized schedule, ``csrc_tl.dsa_sparse_mla_fwd_ws``
(``TORCH_DPLR_DSA_MLA_FWD_WS=0`` keeps the two-warpgroup kernel).

Conventions (Megatron-LM's unfused DSA path where it defines one):

- Index score ``Σ_h w[t, h] · ReLU(q_idx[t, h] · k_idx[s])`` with no scaling inside the op:
  DeepSeek-V3.2 and Megatron-LM multiply ``w`` by ``H_idx ** -0.5 · D_idx ** -0.5`` before.
- Visibility: causal within a sequence (``cu_seqlens[n] <= s <= t``); tokens at
  ``t >= cu_seqlens[-1]`` are padding and see no key.
- ``indices``: int32 positions in the packed token axis; the top-k op writes them ascending with
  ``-1`` in the slots it cannot fill (Megatron-LM's ``sort_topk_by_index``); ties go to the
  smaller position.  The other ops take any order and ignore ``-1`` slots; a key may appear
  once per row.
- ``scores`` at a ``-1`` slot are ``-inf``.  Scores, ``lse``, the loss and its target are fp32
  (fp64 for fp64 inputs); every reduction accumulates in fp32 (fp64).
- ``lse`` is the natural-log log-sum-exp of ``scale · q · kv`` over a row's valid slots; a row
  with none has ``o = 0`` and ``lse = -inf`` (the log of an empty sum: it merges with other
  partial attentions as weight zero).
- Indexer loss: ``p`` = the head-averaged main attention over the selected keys, renormalized
  (Megatron-LM: heads summed, then L1-normalized: the same); ``KL = Σ_j p (log max(p, 1e-10) -
  log_softmax(scores))`` per row; ``"mean"`` divides the summed KL by the rows with a valid slot
  (at least 1), ``"sum"`` does not; times ``coeff``.  Gradient only into the scores:
  ``(softmax(scores) - p) · coeff / denominator``.  With ``topk`` at least the longest
  sequence the selected set is every visible key: DeepSeek's dense warm-up loss.
"""
from . import ops  # noqa: F401  (registers torch.ops.dsa)
from . import policies
from .api import DSAOutput, dsa_attention, indexer_kl_loss, indexer_topk, sparse_mla

__all__ = ["DSAOutput", "dsa_attention", "indexer_kl_loss", "indexer_topk", "sparse_mla",
           "policies"]
