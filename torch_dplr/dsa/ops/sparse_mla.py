"""``dsa::sparse_mla_fwd`` / ``dsa::sparse_mla_bwd``: attention over each query's selected keys.

Schemas:

- ``sparse_mla_fwd(Tensor q, Tensor kv, Tensor indices, float scale, int d_v)
  -> (Tensor o, Tensor lse)``
- ``sparse_mla_bwd(Tensor q, Tensor kv, Tensor indices, Tensor o, Tensor lse, Tensor do,
  Tensor dlse, float scale, int d_v) -> (Tensor dq, Tensor dkv)``

``q [T, H, D_qk]`` and ``kv [T, D_qk]`` of one dtype (absorbed MLA: one latent row per token
shared by every head; its first ``d_v`` columns are the value), ``indices [T, k]`` int32 in any
order, ``-1`` for an unused slot.  ``o [T, H, d_v]`` in q's dtype; ``lse [T, H]`` the natural-log
log-sum-exp of ``scale · q · kv`` over the valid slots, fp32 (fp64 for fp64 inputs); a row
without a valid slot gives ``o = 0`` and ``lse = -inf``.  The backward takes ``dlse`` (zeros when
lse got no gradient) and returns ``dq``, ``dkv`` in their inputs' dtypes (fp32 accumulation).

On CUDA the forward and the backward run the TileLang kernels ``csrc_tl.dsa_sparse_mla_fwd``
(above 32 heads its warp-specialized schedule ``csrc_tl.dsa_sparse_mla_fwd_ws``;
:data:`FWD_WS_SWITCH` set to 0 keeps the two-warpgroup one) and ``csrc_tl.dsa_sparse_mla_bwd``
where one is built (:func:`_tilelang_kernel`: bf16 / fp16,
(D_qk, d_v) in their ``DIMS``, an sm_90 GPU; the backward's ``o`` and ``do`` in q's dtype,
``lse`` and ``dlse`` fp32); there an index outside ``[-1, T_kv)`` is not rejected (that would
read the indices on the host) but counts as an empty slot.  The backward kernel adds dkv with
fp32 atomics, so its dkv may differ between runs by fp32 reordering error (bound in the
kernel's docstring); :data:`BWD_KERNEL_SWITCH` set to 0 keeps the backward on its PyTorch
kernel.  Everything else runs the PyTorch kernel.
"""

from torch import Tensor
import torch

from ...ops.chunked import without_autocast
from ...ops.tilelang_path import KERNEL_DTYPES, tilelang_usable
from ..reference import sparse_mla as ref
from ..reference.layout import check_index_range
from .kernels import aligned as _aligned
from .kernels import kernel_for, switched_off
from .shapes import acc_dtype, allocate, sparse_mla_bwd_shapes, sparse_mla_fwd_shapes


def _block_rows(q, indices):
    return ref.block_rows(indices.shape[1], q.shape[1], q.shape[2])


@without_autocast
def sparse_mla_fwd_reference(q: Tensor, kv: Tensor, indices: Tensor, scale: float,
                             d_v: int) -> tuple[Tensor, Tensor]:
    o, lse = allocate(sparse_mla_fwd_shapes(q, d_v), q.device)
    check_index_range(indices, kv.shape[0])
    acc = lse.dtype
    o_acc = torch.empty(o.shape, dtype=acc, device=q.device)
    ref.sparse_mla_fwd(q.to(acc), kv.to(acc), indices, float(scale), d_v, o_acc, lse,
                       _block_rows(q, indices))
    o.copy_(o_acc)
    return o, lse


sparse_mla_fwd = torch.library.custom_op("dsa::sparse_mla_fwd", mutates_args=())(
    sparse_mla_fwd_reference)


@sparse_mla_fwd.register_fake
def _(q, kv, indices, scale, d_v):
    return allocate(sparse_mla_fwd_shapes(q, d_v), q.device)


def _tilelang_config(q: Tensor, kv: Tensor, indices: Tensor, d_v: int) -> dict | None:
    """The TileLang variant of this call (``csrc_tl.dsa_sparse_mla_fwd.config_for``, which the
    backward shares), or None (the PyTorch kernel runs): q and kv bf16 or fp16 of one dtype,
    int32 indices, at least one token, head, kv row and slot, a variant built for its dims, an
    sm_90 GPU.  Shapes, dtypes and the device only: no tensor value is read."""
    if not (q.dtype in KERNEL_DTYPES and kv.dtype == q.dtype and indices.dtype == torch.int32
            and q.numel() and kv.numel() and indices.shape[1] and tilelang_usable(q.device)):
        return None
    from csrc_tl.dsa_sparse_mla_fwd import config_for  # TileLang is importable (checked above)

    return config_for(q.shape[2], d_v, q.shape[1], q.dtype)


def _tilelang_kernel(family: str, q: Tensor, kv: Tensor, indices: Tensor, d_v: int):
    """The TileLang kernel ``csrc_tl.<family>`` of this call, or None (see
    :func:`_tilelang_config`)."""
    config = _tilelang_config(q, kv, indices, d_v)
    return None if config is None else kernel_for(family, config)


#: Environment variable that keeps the forward on its two-warpgroup kernel ("0") where the
#: warp-specialized schedule (``csrc_tl.dsa_sparse_mla_fwd_ws``) would run.
FWD_WS_SWITCH = "TORCH_DPLR_DSA_MLA_FWD_WS"


def _forward_kernel(q: Tensor, kv: Tensor, indices: Tensor, d_v: int):
    """The forward's kernel, or None: the warp-specialized schedule where the call takes 64
    heads per CTA (more than 32 heads) at dims it builds, else the two-warpgroup one."""
    config = _tilelang_config(q, kv, indices, d_v)
    if config is None:
        return None
    if config["block_H"] == 64 and not switched_off(FWD_WS_SWITCH):
        from csrc_tl import dsa_sparse_mla_fwd_ws as ws

        if ws.supports(config["D_qk"], d_v):
            return kernel_for("dsa_sparse_mla_fwd_ws",
                              dict(D_qk=config["D_qk"], d_v=d_v, dtype=config["dtype"]))
    return kernel_for("dsa_sparse_mla_fwd", config)


@sparse_mla_fwd.register_kernel("cuda")
@without_autocast
def sparse_mla_fwd_cuda(q, kv, indices, scale, d_v):
    kernel = _forward_kernel(q, kv, indices, d_v)
    if kernel is None:
        return sparse_mla_fwd_reference(q, kv, indices, scale, d_v)
    o, lse = allocate(sparse_mla_fwd_shapes(q, d_v), q.device)
    kernel(_aligned(q), _aligned(kv), indices.contiguous(), float(scale), o, lse)
    return o, lse


@without_autocast
def sparse_mla_bwd_reference(q: Tensor, kv: Tensor, indices: Tensor, o: Tensor, lse: Tensor,
                             do: Tensor, dlse: Tensor, scale: float, d_v: int
                             ) -> tuple[Tensor, Tensor]:
    dq, dkv = allocate(sparse_mla_bwd_shapes(q, kv), q.device)
    check_index_range(indices, kv.shape[0])
    acc = acc_dtype(q.dtype)
    dq_acc = torch.empty(dq.shape, dtype=acc, device=q.device)
    dkv_acc = torch.zeros(dkv.shape, dtype=acc, device=q.device)
    ref.sparse_mla_bwd(q.to(acc), kv.to(acc), indices, o.to(acc), lse.to(acc), do.to(acc),
                       dlse.to(acc), float(scale), d_v, dq_acc, dkv_acc, _block_rows(q, indices))
    dq.copy_(dq_acc)
    dkv.copy_(dkv_acc)
    return dq, dkv


sparse_mla_bwd = torch.library.custom_op("dsa::sparse_mla_bwd", mutates_args=())(
    sparse_mla_bwd_reference)


@sparse_mla_bwd.register_fake
def _(q, kv, indices, o, lse, do, dlse, scale, d_v):
    return allocate(sparse_mla_bwd_shapes(q, kv), q.device)


#: Environment variable that keeps ``sparse_mla_bwd`` on its PyTorch kernel ("0").
BWD_KERNEL_SWITCH = "TORCH_DPLR_DSA_TILELANG_BWD"


@sparse_mla_bwd.register_kernel("cuda")
@without_autocast
def sparse_mla_bwd_cuda(q, kv, indices, o, lse, do, dlse, scale, d_v):
    kernel = None
    if (not switched_off(BWD_KERNEL_SWITCH) and o.dtype == do.dtype == q.dtype
            and lse.dtype == dlse.dtype == torch.float32):
        kernel = _tilelang_kernel("dsa_sparse_mla_bwd", q, kv, indices, d_v)
    if kernel is None:
        return sparse_mla_bwd_reference(q, kv, indices, o, lse, do, dlse, scale, d_v)
    dq, dkv = allocate(sparse_mla_bwd_shapes(q, kv), q.device)
    dkv_acc = torch.zeros(dkv.shape, dtype=torch.float32, device=kv.device)  # the atomics' sum
    kernel(_aligned(q), _aligned(kv), indices.contiguous(), _aligned(o), lse.contiguous(),
           _aligned(do), dlse.contiguous(), float(scale), dq, dkv_acc)
    dkv.copy_(dkv_acc)
    return dq, dkv


def _setup_context(ctx, inputs, output):
    q, kv, indices, scale, d_v = inputs
    o, lse = output
    ctx.save_for_backward(q, kv, indices, o, lse)
    ctx.config = (scale, d_v)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dlse):
    if do is None and dlse is None:
        return None, None, None, None, None
    q, kv, indices, o, lse = ctx.saved_tensors
    scale, d_v = ctx.config
    if do is None:
        do = torch.zeros_like(o)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dkv = torch.ops.dsa.sparse_mla_bwd(q, kv, indices, o, lse, do, dlse, scale, d_v)
    return dq, dkv, None, None, None


sparse_mla_fwd.register_autograd(_backward, setup_context=_setup_context)
