"""RWKV-7's inference form that takes the normalized key and the in-context learning rate.

flash-linear-attention's ``RWKV7Attention`` decodes through ``fused_mul_recurrent_rwkv7``,
which takes ``kk`` (the l2-normalized key) and ``a`` (the in-context learning rate, iclr)
instead of the DPLR pair, and forms ``a_dplr = -kk`` and ``b_dplr = kk·a`` itself.
"""
from __future__ import annotations

from . import api
from .validation import check_inputs

__all__ = ["fused_mul_recurrent_rwkv7"]


def fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, scale=1.0, initial_state=None,
                              output_final_state=False, reverse=False, cu_seqlens=None):
    """RWKV-7 per token with the DPLR pair formed inside: ``a_dplr = -kk``, ``b_dplr = kk·a``.

    ``S_t = diag(exp(w_t)) S_{t-1} + (kk_t·a_t) ((-kk_t)ᵀ S_{t-1}) + k_t v_tᵀ``,
    ``o_t = scale · S_tᵀ r_t``: the same as :func:`torch_dplr.fused_recurrent_rwkv7` called
    with ``a=-kk, b=kk*a``.  Arguments and defaults are flash-linear-attention's.

    Args:
        r, k, kk, a: ``[B, T, H, K]``; v: ``[B, T, H, V]``, one dtype; w: ``[B, T, H, K]``
            log-decay, any float dtype.
        scale: default 1.0 (``None``: ``K ** -0.5``).
        initial_state: ``[N, H, K, V]``; output_final_state: also return the fp32 final state.
        reverse: walk each sequence from its last token.
        cu_seqlens: ``[N+1]`` offsets of packed sequences (``B == 1``).

    Returns:
        ``(o [B, T, H, V], final_state or None)``.  The per-token kernel forms the pair in fp32,
        as FLA's kernel does; sequences longer than the per-token kernel's limit run the
        chunked sweep on the pair rounded to the inputs' dtype.  Differentiable (the per-token
        backward, which keeps every state: short sequences only; it differentiates the pair
        rounded to the inputs' dtype).
    """
    r, k, v, kk, a = api._under_autocast(dict(r=r, k=k, v=v, kk=kk, a=a)).values()
    check_inputs(dict(r=r, k=k, v=v, kk=kk, a=a, w=w), gate="w", value="v", scale=scale,
                 initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=None)
    return api._recurrent(r, k, v, kk, a, w, scale, initial_state, output_final_state,
                          reverse, cu_seqlens, rwkv7_pair=True)
