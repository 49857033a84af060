"""Affine state maps ``h -> M·h + c`` and how segments of a sequence are joined with them.

Per head, the DPLR recurrence maps the state at a segment's start to the state at its end by
an affine map: ``h_out = M·h_in + c``, with ``M`` (``[K, K]``) the product of the segment's
token transitions ``diag(exp(gk_t)) + b_t a_tᵀ`` and ``c`` (``[K, V]``) the end state from a
zero start (DESIGN.md §6).  A sequence cut into segments that were processed independently is
joined by a scan over these maps; the same algebra serves segments on one device (time
parallelism) and across ranks (context parallelism, :mod:`torch_dplr.cp`).

Tensors: maps ``M [S, ..., K, K]`` and ``c [S, ..., K, V]`` with the segments along dim 0 and
any batch dimensions (sequences, heads) in between; states ``[..., K, V]``.  Pure PyTorch,
no distributed code.

The backward of the forward scan ``x_{s+1} = M_s x_s + c_s`` is the same scan run backwards
with transposed transitions: ``X_s = dx_s + M_sᵀ X_{s+1}`` (``X`` the adjoint of ``x``), then
``dM_s = X_{s+1} x_sᵀ``, ``dc_s = X_{s+1}``, ``dh0 = X_0``.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["compose", "apply", "prefix_compose", "chain_states", "chain_states_forward",
           "chain_adjoints", "chain_states_backward", "segment_states"]


def compose(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The map of ``first`` followed by ``second``: ``(M2·M1, M2·c1 + c2)``."""
    (M1, c1), (M2, c2) = first, second
    return M2 @ M1, M2 @ c1 + c2


def apply(M: Tensor, c: Tensor, h: Tensor) -> Tensor:
    """``M·h + c``."""
    return M @ h + c


def prefix_compose(M: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Inclusive prefix compositions along dim 0: entry ``s`` maps the start of segment 0 to
    the end of segment ``s``.

    Log-depth (Hillis-Steele): ``ceil(log2 S)`` rounds of batched matmuls, so the depth does
    not grow with the segment count.
    """
    S = M.shape[0]
    step = 1
    while step < S:
        later_M, later_c = M[step:], c[step:]
        M = torch.cat([M[:step], later_M @ M[:-step]])
        c = torch.cat([c[:step], later_M @ c[:-step] + later_c])
        step *= 2
    return M, c


def chain_states_forward(M: Tensor, c: Tensor, h0: Tensor | None = None) -> Tensor:
    """States ``x_0 .. x_S`` (``[S+1, ..., K, V]``) of ``x_0 = h0`` (zeros when None),
    ``x_{s+1} = M_s x_s + c_s``: every segment's start state, then the last one's end."""
    if h0 is None:
        h0 = c.new_zeros(c.shape[1:])
    if M.shape[0] == 0:
        return h0[None]
    PM, Pc = prefix_compose(M, c)
    return torch.cat([h0[None], PM @ h0 + Pc])


def chain_adjoints(M: Tensor, dx: Tensor) -> Tensor:
    """Adjoints ``X_0 .. X_S`` of the states of :func:`chain_states_forward`, given the direct
    gradient ``dx [S+1, ..., K, V]`` of every state: ``X_S = dx_S``,
    ``X_s = dx_s + M_sᵀ X_{s+1}`` -- the forward scan, reversed, with transposed maps."""
    reversed_maps = M.flip(0).transpose(-1, -2)
    return chain_states_forward(reversed_maps, dx[:-1].flip(0), dx[-1]).flip(0)


def chain_states_backward(M: Tensor, x: Tensor, dx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dM, dc, dh0)`` of :func:`chain_states_forward` from its states ``x`` and the
    gradient ``dx`` of every state."""
    X = chain_adjoints(M, dx)
    return X[1:] @ x[:-1].transpose(-1, -2), X[1:], X[0]


class _ChainStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, M, c, h0):
        x = chain_states_forward(M, c, h0)
        ctx.save_for_backward(M, x)
        return x

    @staticmethod
    def backward(ctx, dx):
        M, x = ctx.saved_tensors
        return chain_states_backward(M, x, dx)


def chain_states(M: Tensor, c: Tensor, h0: Tensor | None = None) -> Tensor:
    """:func:`chain_states_forward`, differentiable through :func:`chain_states_backward`."""
    if h0 is None:
        h0 = c.new_zeros(c.shape[1:])
    return _ChainStates.apply(M, c, h0)


def segment_states(M: Tensor, c: Tensor, first: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """Start and end states of segments that belong to several sequences, in order.

    ``first [S]`` (bool) marks the segments that begin a sequence; such a segment starts from
    ``h0[s]`` (``h0 [S, ..., K, V]``, read only where ``first``), every other one from the
    end of the segment before it (a first segment that is not marked starts from zeros).
    Returns ``(x, y)``, both ``[S, ..., K, V]``: ``x_s`` the start state and
    ``y_s = M_s x_s + c_s`` the end state of segment ``s``.  Differentiable.
    """
    if M.shape[0] == 0:
        return c.clone(), c.clone()
    shape = (-1,) + (1,) * (M.dim() - 1)
    starts = first.reshape(shape)
    # A segment that begins a sequence ignores what came before it: the transition into it
    # is the constant map h -> h0[s].
    into_M = torch.where(starts[1:], torch.zeros_like(M[:-1]), M[:-1])
    into_c = torch.where(starts[1:], h0[1:], c[:-1])
    x0 = torch.where(starts[0], h0[0], torch.zeros_like(h0[0]))
    x = chain_states(into_M, into_c, x0)
    return x, apply(M, c, x)
