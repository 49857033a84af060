"""``dplr::chunk_state_fwd`` / ``dplr::chunk_state_bwd``: the walk over chunks.

The forward makes ``o`` and the final state in one sweep, and (when ``keep_activations``)
the per-chunk start states ``h`` and ``v_new`` that the backward reads; without it those two
are size-0 (a no-grad call writes nothing it does not need).  ``h`` and ``v_new`` are
auxiliary outputs for the backward, marked non-differentiable.  The backward is one reverse
sweep: ``dh`` (the gradient of the state at a chunk's end) is carried.  On the GPU one kernel
does it (one CTA per (sequence, head), ``dh`` never stored); with few pairs
(:func:`_split_backward_pays`) two kernels do (``csrc_tl/state_bwd_split.py``): a reverse scan
split over V that writes ``dh`` per chunk into an fp32 workspace laid out like ``h``, then a
kernel over chunks, in parallel, that makes the other gradients from ``h`` and ``dh``.
"""

from typing import Optional

import torch
from torch import Tensor

from ..reference import state as ref
from .chunked import ChunkedView, start_state, without_autocast
from .direct_call import call_op, register_autograd, register_kernel
from .shapes import allocate, num_sequences, state_bwd_shapes, state_fwd_shapes, zeros_for_missing
from .kernels import kernel_for
from .tilelang_path import MAX_GRID_YZ, device_index, kernels_apply, sm_count
from .varlen import as_one_sequence_list as flat
from .varlen import tables_for


def _state_kernel_applies(v, cu_seqlens, chunk_size, K, V) -> bool:
    # one CTA row per sequence on grid y / z (read from shapes: no host sync)
    return num_sequences(v, cu_seqlens) <= MAX_GRID_YZ and kernels_apply(v, chunk_size, K, V)


# The split kernels pass dh through an fp32 buffer the size of h: 2 GiB for one sequence of
# 65536 tokens, H32 D64, chunk 16. Beyond this the single kernel runs (slower, no buffer).
SPLIT_DH_BYTES_MAX = 4 << 30


def few_pairs(pairs: int, sms: int) -> bool:
    """Whether (sequence, head) ``pairs`` leave the single backward kernel short of work on
    ``sms`` SMs: at most a quarter as many pairs as SMs."""
    return 4 * pairs <= sms


def _split_backward_pays(v, h, cu_seqlens) -> bool:
    """At most a quarter as many (sequence, head) pairs as SMs, and a dh buffer (fp32, h's
    shape) of at most :data:`SPLIT_DH_BYTES_MAX`: the single backward kernel's serial walks
    leave most SMs idle, the split one gives its scan V/BV times the CTAs.  On the H200 (132
    SMs, tools/ab_state_bwd.py, benchmarks/results/h200-notes.md) the split took 0.29 vs 0.62 ms
    at 16 pairs and 3.7 vs 9.2 ms at 32, but 1.58 vs 1.27 ms at 128 (D128) and lost at 256; 64
    pairs was not timed.  Shapes only."""
    pairs = num_sequences(v, cu_seqlens) * v.shape[2]
    dh_bytes = h.numel() * 4
    return few_pairs(pairs, sm_count(device_index(v.device))) and dh_bytes <= SPLIT_DH_BYTES_MAX


@without_autocast
def chunk_state_fwd_reference(qg: Tensor, kg: Tensor, bg: Tensor, w: Tensor, u: Tensor, v: Tensor,
                              A_qk: Tensor, A_qb: Tensor, gl: Tensor, initial_state: Tensor,
                              cu_seqlens: Tensor, chunk_size: int, use_initial_state: bool,
                              keep_activations: bool, tables: Optional[Tensor] = None
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    o, ht, h, v_new = allocate(state_fwd_shapes(qg, v, gl, cu_seqlens, keep_activations), v.device)
    view = ChunkedView(v, cu_seqlens, chunk_size)
    chunks = map(view.read_padded, (qg, kg, bg, w, u, v, A_qk, A_qb))
    h0 = start_state(initial_state, use_initial_state, ht.shape, view.dtype, v.device)
    o_c, h_end, h_all, vn = ref.state_fwd(view.layout.seq_slots, *chunks,
                                          view.read_slots(gl, pad=True), h0, keep_activations)
    view.write(o, o_c)
    ht.copy_(h_end)
    if keep_activations:
        view.write_slots(h, h_all)
        view.write(v_new, vn)
    return o, ht, h, v_new


chunk_state_fwd = torch.library.custom_op("dplr::chunk_state_fwd", mutates_args=())(chunk_state_fwd_reference)


@chunk_state_fwd.register_fake
def _(qg, kg, bg, w, u, v, A_qk, A_qb, gl, initial_state, cu_seqlens, chunk_size,
      use_initial_state, keep_activations, tables=None):
    return allocate(state_fwd_shapes(qg, v, gl, cu_seqlens, keep_activations), v.device)


@register_kernel(chunk_state_fwd, "cuda")
@without_autocast
def chunk_state_fwd_cuda(qg, kg, bg, w, u, v, A_qk, A_qb, gl, initial_state, cu_seqlens,
                         chunk_size, use_initial_state, keep_activations, tables=None):
    B, T, H, K = qg.shape
    V = v.shape[-1]
    kernel = (kernel_for("state_fwd", chunk_size, K, V, v.dtype)
              if _state_kernel_applies(v, cu_seqlens, chunk_size, K, V) else None)
    if kernel is None:
        return chunk_state_fwd_reference(qg, kg, bg, w, u, v, A_qk, A_qb, gl, initial_state,
                                         cu_seqlens, chunk_size, use_initial_state,
                                         keep_activations)
    o, ht, h, v_new = allocate(state_fwd_shapes(qg, v, gl, cu_seqlens, keep_activations),
                               v.device)
    tables = tables_for(tables, cu_seqlens, B, T, chunk_size, v.device)
    h0 = initial_state.float() if use_initial_state else ht.new_empty(0, H, K, V)
    # h / v_new are size 0 without keep_activations: the kernel then writes neither
    kept = (flat(h), flat(v_new)) if keep_activations else (h.view(1, 0, H, K, V), v_new.view(1, 0, H, V))
    kernel(*map(flat, (qg, kg, bg, w, u, v, A_qk, A_qb, gl)), h0.contiguous(),
           tables.cu_seqlens, tables.chunk_offsets, flat(o), ht, *kept)
    return o, ht, h, v_new


@without_autocast
def chunk_state_bwd_reference(qg: Tensor, kg: Tensor, bg: Tensor, w: Tensor, v: Tensor, A_qk: Tensor,
                              A_qb: Tensor, gl: Tensor, h: Tensor, v_new: Tensor, do: Tensor, dht: Tensor,
                              initial_state: Tensor, cu_seqlens: Tensor, chunk_size: int,
                              use_initial_state: bool, use_dht: bool,
                              tables: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                         Tensor, Tensor]:
    outs = allocate(state_bwd_shapes(qg, kg, bg, w, v, A_qk, A_qb, gl, initial_state,
                                     use_initial_state), v.device)
    view = ChunkedView(v, cu_seqlens, chunk_size)
    chunks = map(view.read_padded, (qg, kg, bg, w, v, A_qk, A_qb))
    H, K, V = qg.shape[2], qg.shape[3], v.shape[3]
    N = num_sequences(v, cu_seqlens)
    dh_end = start_state(dht, use_dht, (N, H, K, V), view.dtype, v.device)
    res = ref.state_bwd(view.layout.seq_slots, *chunks, view.read_slots(gl, pad=True),
                        view.read_slots(h, pad=True), view.read_padded(v_new),
                        view.read_padded(do), dh_end)
    *token_grads, dgl, dh0 = res
    for out, x in zip(outs[:8], token_grads):
        view.write(out, x)
    view.write_slots(outs[8], dgl)
    if use_initial_state:
        outs[9].copy_(dh0)
    return outs


chunk_state_bwd = torch.library.custom_op("dplr::chunk_state_bwd", mutates_args=())(chunk_state_bwd_reference)


@chunk_state_bwd.register_fake
def _(qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, do, dht, initial_state, cu_seqlens, chunk_size,
      use_initial_state, use_dht, tables=None):
    return allocate(state_bwd_shapes(qg, kg, bg, w, v, A_qk, A_qb, gl, initial_state,
                                     use_initial_state), v.device)


@register_kernel(chunk_state_bwd, "cuda")
@without_autocast
def chunk_state_bwd_cuda(qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, do, dht, initial_state,
                         cu_seqlens, chunk_size, use_initial_state, use_dht, tables=None):
    B, T, H, K = qg.shape
    V = v.shape[-1]
    reference = (qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, do, dht, initial_state, cu_seqlens,
                 chunk_size, use_initial_state, use_dht)
    if not _state_kernel_applies(v, cu_seqlens, chunk_size, K, V):
        return chunk_state_bwd_reference(*reference)
    dh_scan, chunk_grads = ((kernel_for("state_bwd_dh", chunk_size, K, V, v.dtype),
                             kernel_for("state_bwd_grads", chunk_size, K, V, v.dtype))
                            if _split_backward_pays(v, h, cu_seqlens) else (None, None))
    single = None
    if dh_scan is None or chunk_grads is None:  # a large grid, or the split could not be built
        single = kernel_for("state_bwd", chunk_size, K, V, v.dtype)
        if single is None:
            return chunk_state_bwd_reference(*reference)
    outs = allocate(state_bwd_shapes(qg, kg, bg, w, v, A_qk, A_qb, gl, initial_state,
                                     use_initial_state), v.device)
    dqg, dkg, dbg, dw, du, dv, dA_qk, dA_qb, dgl, dh0 = outs
    tables = tables_for(tables, cu_seqlens, B, T, chunk_size, v.device)
    # dht / dh0 with no rows tell the kernels to start from zero / not to write dh0
    dht4 = dht.float().reshape(-1, H, K, V).contiguous() if use_dht else gl.new_empty(0, H, K, V)
    dh0 = dh0.view(-1, H, K, V)
    if single is not None:
        inputs = map(flat, (qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, do))
        single(*inputs, dht4, tables.cu_seqlens, tables.chunk_offsets, *map(flat, outs[:9]), dh0)
        return outs
    # the gradient of the state at each chunk's end, fp32, laid out like h (slots never
    # written are never read: unused varlen slots have chunk_len 0)
    dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    dh_scan(*map(flat, (qg, bg, w, A_qb, gl, do)), dht4, tables.cu_seqlens,
            tables.chunk_offsets, flat(du), flat(dh), dh0)
    chunk_grads(*map(flat, (kg, v, A_qk, gl, h, v_new, do, du, dh)), tables.chunk_start,
                tables.chunk_len, *map(flat, (dqg, dkg, dbg, dw, dv, dA_qk, dA_qb, dgl)))
    return outs


def _setup_context(ctx, inputs, output):
    (qg, kg, bg, w, u, v, A_qk, A_qb, gl, initial_state, cu_seqlens, chunk_size,
     use_initial_state, keep_activations, tables) = inputs
    _, _, h, v_new = output
    ctx.mark_non_differentiable(h, v_new)
    ctx.save_for_backward(qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, initial_state, cu_seqlens,
                          tables)
    ctx.config = (chunk_size, use_initial_state, keep_activations)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht, dh_unused, dv_new_unused):
    qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new, initial_state, cu_seqlens, tables = ctx.saved_tensors
    chunk_size, use_initial_state, keep_activations = ctx.config
    if not keep_activations:
        raise RuntimeError("dplr::chunk_state_fwd ran with keep_activations=False; "
                           "it cannot be differentiated")
    (do,) = zeros_for_missing((do,), [(v.shape, v.dtype)], v.device)
    use_dht = dht is not None
    if dht is None:
        dht = gl.new_zeros(0)
    grads = call_op(torch.ops.dplr.chunk_state_bwd, qg, kg, bg, w, v, A_qk, A_qb, gl, h, v_new,
                    do, dht, initial_state, cu_seqlens, chunk_size, use_initial_state, use_dht,
                    tables)
    dqg, dkg, dbg, dw, du, dv, dA_qk, dA_qb, dgl, dh0 = grads
    return (dqg, dkg, dbg, dw, du, dv, dA_qk, dA_qb, dgl, dh0 if use_initial_state else None,
            None, None, None, None, None)


register_autograd(chunk_state_fwd, _backward, _setup_context)
