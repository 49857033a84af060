"""A declared ``lower_bound`` that the gates break, on the GPU, and what checking it costs.

``table``: ``chunk_dplr_delta_rule(..., lower_bound=-0.6065)`` at B2 T2048 H16 D64 bf16 with
RWKV-7 gates ``-0.6065 sigmoid(5x)`` scaled by a factor (and a few spikes at -1e4), forward
and backward: whether o and the gradients are finite, and the RMS ratio of o and of each
gradient against the same call without a bound on the exact schemes (``exact_intra_schemes``:
without a bound, chunks 16 and 32 would take the checked centred schemes too).

``cost``: the design shape B8 T4096 H32 D64 bf16, chunk 64, gates inside the bound: the
forward+backward and the no-grad forward as shipped, against the same calls with the bound
check taken out (the exact recomputes of ``torch_dplr/ops/gate_bound.py`` skipped), A and B
alternated over several rounds; and the check's own work timed alone (CUDA events).

    python -m benchmarks.gate_bound --out benchmarks/results/h100-gate-bound.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

import torch_dplr
from benchmarks.jsonl import emit
from benchmarks.timing import Timer
from torch_dplr.testing import RWKV7_BOUND, exact_intra_schemes, make_inputs, rms_ratio

NAMES = ("q", "k", "v", "a", "b", "gk")


def _inputs(B, T, H, D, factor, seed=0):
    inp = make_inputs(B, T, H, D, dtype=torch.bfloat16, seed=seed, device="cuda")
    gen = torch.Generator().manual_seed(seed)
    gk = RWKV7_BOUND * torch.sigmoid(5 * torch.randn(B, T, H, D, generator=gen))
    if factor == "spikes":
        flat = gk.view(-1)
        flat[torch.randint(0, flat.numel(), (16,), generator=gen)] = -1e4
    else:
        gk = gk * float(factor)
    inp["gk"] = gk.cuda()
    return inp


def _run(inp, C, bound, grad=True):
    leaves = {n: inp[n].detach().clone().requires_grad_(grad) for n in NAMES}
    h0 = inp["initial_state"].detach().clone().requires_grad_(grad)
    o, ht = torch_dplr.chunk_dplr_delta_rule(*leaves.values(), initial_state=h0,
                                             output_final_state=True, chunk_size=C,
                                             lower_bound=bound)
    if not grad:
        return o, {}
    (o.float().sum() + ht.sum()).backward()
    return o, {"d" + n: x.grad for n, x in leaves.items()} | {"dh0": h0.grad}


def table(out):
    for C in (16, 32, 64):
        for factor in ("1", "2", "10", "100", "spikes"):
            inp = _inputs(2, 2048, 16, 64, factor)
            o, grads = _run(inp, C, RWKV7_BOUND)
            with exact_intra_schemes():
                o_ref, grads_ref = _run(inp, C, None)
            rec = dict(part="table", chunk=C, gates_x=factor,
                       o_finite=bool(torch.isfinite(o).all()),
                       grads_finite=all(bool(torch.isfinite(g).all()) for g in grads.values()),
                       o_vs_unbounded=rms_ratio(o, o_ref),
                       worst_grad_vs_unbounded=max(rms_ratio(g, grads_ref[n])
                                                   for n, g in grads.items()))
            out(rec)


@contextlib.contextmanager
def _without_check():
    """The shipped calls less the bound check: no exact intra recomputes, no per-token redo
    after the fused forward (which then writes its flags for nobody)."""
    from csrc_triton import recurrent
    from torch_dplr.ops import intra
    kernels, launch = intra._kernels, recurrent.launch
    intra._kernels = lambda *a: (kernels(*a)[0], None)
    recurrent.launch = lambda *a, flags=None, **k: None if flags is not None else launch(*a, **k)
    try:
        yield
    finally:
        intra._kernels, recurrent.launch = kernels, launch


def _check_alone_ms(inp, C, timer):
    """The check's work at this shape, alone: the intra forward's and backward's redo kernels
    (every CTA reads its chunk totals and ends), the fused forward's flag buffer and its
    flagged per-token launch (nothing flagged)."""
    from csrc_triton import recurrent
    from torch_dplr.ops.intra import _kernels
    from torch_dplr.ops.varlen import as_one_sequence_list as flat
    from torch_dplr.ops.varlen import kernel_tables
    q, k, v, a, b, gk = (inp[n] for n in NAMES)
    B, T, H, K = q.shape
    cu = torch.empty(0, dtype=torch.int64, device="cuda")
    tables = kernel_tables(cu, B, T, C, q.device)
    outs = torch.ops.dplr.chunk_intra_fwd(q, k, a, b, gk, cu, K ** -0.5, C, RWKV7_BOUND)
    gl = outs[0]
    _, fwd_exact = _kernels("intra_fwd", q, gk, C, RWKV7_BOUND)
    _, bwd_exact = _kernels("intra_bwd", q, gk, C, RWKV7_BOUND)
    tokens = tuple(map(flat, (q, k, a, b, gk)))
    grads = [torch.zeros_like(x) for x in outs]
    bwd_outs = [torch.empty_like(x) for x in (q, k, a, b, gk)]
    per_token_in = tuple(map(flat, (q, k, v, a, b, gk)))
    o, ht = torch.empty_like(v), torch.empty(B, H, K, K, device="cuda")
    N = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device="cuda")

    def forward_check():
        fwd_exact(*tokens, tables.chunk_start, tables.chunk_len, K ** -0.5, *map(flat, outs))

    def backward_check():
        bwd_exact(*tokens, flat(gl), *map(flat, grads), tables.chunk_start, tables.chunk_len,
                  K ** -0.5, *map(flat, bwd_outs))

    def fused_check():
        flags = torch.zeros(B, H, dtype=torch.int32, device="cuda")
        recurrent.launch(*per_token_in, ht, N, N, flat(o), ht, K ** -0.5, False, False,
                         False, flags=flags)

    return {name: timer.measure(fn).ms for name, fn in
            (("fwd_check_ms", forward_check), ("bwd_check_ms", backward_check),
             ("fused_check_ms", fused_check))}


def cost(out, rounds=5):
    inp = _inputs(8, 4096, 32, 64, "1")
    timer = Timer("cuda", reps=20, warmup=3)
    calls = {"fwd_bwd": lambda: _run(inp, 64, RWKV7_BOUND),
             "no_grad_fwd": lambda: _run(inp, 64, RWKV7_BOUND, grad=False)}
    for name, fn in calls.items():
        shipped, unchecked = [], []
        for _ in range(rounds):
            shipped.append(timer.measure(fn).ms)
            with _without_check():
                unchecked.append(timer.measure(fn).ms)
        ms, base = statistics.median(shipped), statistics.median(unchecked)
        out(dict(part="cost", call=name, shape="B8 T4096 H32 D64 bf16 C64", ms=ms,
                 without_check_ms=base, overhead_pct=100 * (ms - base) / base,
                 rounds=rounds))
    alone = _check_alone_ms(inp, 64, timer)
    step = statistics.median([timer.measure(calls["fwd_bwd"]).ms for _ in range(3)])
    fwd = statistics.median([timer.measure(calls["no_grad_fwd"]).ms for _ in range(3)])
    out(dict(part="check_alone", **alone, fwd_bwd_ms=step, no_grad_fwd_ms=fwd,
             training_pct=100 * (alone["fwd_check_ms"] + alone["bwd_check_ms"]) / step,
             no_grad_pct=100 * alone["fused_check_ms"] / fwd))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="append JSON lines here (also printed)")
    parser.add_argument("--parts", default="table,cost")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gate_bound needs a CUDA GPU")

    from .harness import card_meta
    meta = card_meta(torch.device("cuda"))  # the card and the commit, in every record

    def out(rec):
        emit({**rec, **meta}, args.out, digits=5)

    parts = args.parts.split(",")
    if "table" in parts:
        table(out)
    if "cost" in parts:
        cost(out)


if __name__ == "__main__":
    main()
