"""WY stage in plain PyTorch: A_ab_inv = (I - A_ab)^-1, w = A_ab_inv·ag, u = A_ab_inv·A_ak·v.

Chunk-major ``[n, H, C, *]`` tensors in the compute dtype.  Only the strictly lower part of
A_ab and A_ak is read, so gradients are masked to it.
"""
from __future__ import annotations

import torch


def _strict_lower(x: torch.Tensor) -> torch.Tensor:
    return x.tril(-1)


def wy_fwd(A_ab, A_ak, ag, v):
    C = A_ab.shape[-1]
    eye = torch.eye(C, dtype=A_ab.dtype, device=A_ab.device)
    A_inv = torch.linalg.solve_triangular(eye - _strict_lower(A_ab), eye.expand_as(A_ab),
                                          upper=False, unitriangular=True)
    w = A_inv @ ag
    u = A_inv @ (_strict_lower(A_ak) @ v)
    return A_inv, w, u


def wy_bwd(A_inv, A_ak, ag, v, dw, du):
    """VJP of :func:`wy_fwd` given A_inv from the forward; returns (dA_ab, dA_ak, dag, dv)."""
    A_ak = _strict_lower(A_ak)
    A_inv_t = A_inv.transpose(-1, -2)
    dag = A_inv_t @ dw
    m = A_ak @ v
    dm = A_inv_t @ du
    dA_ak = _strict_lower(dm @ v.transpose(-1, -2))
    dv = A_ak.transpose(-1, -2) @ dm
    dA_inv = dw @ ag.transpose(-1, -2) + du @ m.transpose(-1, -2)
    dA_ab = _strict_lower(A_inv_t @ dA_inv @ A_inv_t)
    return dA_ab, dA_ak, dag, dv
