"""FLA's RWKV-7 layer and model side by side: flash-linear-attention's kernels against the same
module under ``torch_dplr.patch_fla()``, in one process on the same inputs.

- ``kind: "layer"``: ``fla.layers.RWKV7Attention`` at the design size (B 8, T 4096, hidden 2048,
  head dim 64: 32 heads; bf16; ``fuse_norm`` as ``RWKV7ForCausalLM`` builds it), ``mode``
  ``fwd`` (no grad: ``chunk_rwkv7`` without saving, as in a prefill) and ``fwd_bwd`` (training
  mode: forward, then the backward of a fixed output gradient; ``.grad`` is set to None after
  every rep).  ``o_rms_ratio``: RMS(o - o_FLA) / RMS(o_FLA) of the two forwards;
  ``fla_o_nonfinite`` / ``torch_dplr_o_nonfinite``: how many elements of each output are not
  finite (a NaN ratio means some are); where FLA's is not, ``fla_first_nonfinite`` names the
  first submodule whose output is not finite.
- ``kind: "generate"``: a small ``RWKV7ForCausalLM``'s greedy ``generate`` (``GENERATE``
  below): the prompt's prefill on ``chunk_rwkv7``, then one decode step per token on
  ``fused_mul_recurrent_rwkv7``.  ``*_tokens_per_s``: batch x new tokens per
  second; ``tokens_equal``: the fraction of new tokens both picked (bf16: a near tie of the top
  two logits may go either way, so this is reported, not required).

Both implementations are timed with :class:`benchmarks.timing.Timer` (first call apart,
warm-ups, CUDA events around each rep, median, L2 flushed between the layer's reps; peak memory
of one more call): ``fla_*`` and ``torch_dplr_*`` fields (``_ms``, ``_peak_mb``, ``_first_call_s``,
``_reps``, ``_spread_ms``), and ``fla_over_torch_dplr`` = FLA's time / torch_dplr's (above 1:
torch_dplr is faster).  ``torch_dplr_calls``: the patch's calls per FLA function over the
measurement (proof the patched run ran torch_dplr).  FLA runs its Triton kernels
(``FLA_TILELANG=0``; its TileLang backend refuses the layer's chunk size 64 on sm_90).  Only
the attention op changes between the two: FLA's other kernels (token shift, the fused
norms, the output correction, ...) run in both.

    python -m benchmarks.layers --out benchmarks/results/h200-layers.jsonl
"""
from __future__ import annotations

import argparse
import importlib
import sys
import warnings

import torch

from .jsonl import emit
from .timing import Timer

GENERATE = dict(layers=4, hidden=1024, head_dim=64, vocab=8192, batch=8, prompt=512,
                new_tokens=128)


def _load_fla():
    """FLA (benchmarks.fla_routes.FLA) with its layers and models, or exit saying what is
    missing."""
    try:
        from .fla_routes import FLA
        handle = FLA()
        importlib.import_module("fla.layers")  # its layers and models import transformers
    except ImportError as exc:
        raise SystemExit(f"benchmarks.layers needs flash-linear-attention 0.6.0 and transformers "
                         f"(pip install flash-linear-attention==0.6.0): {exc}") from exc
    return handle


def _perturb(module: torch.nn.Module) -> None:
    """Seeded noise on every parameter (N(0, 1/fan_in) on matrices, N(0, 0.1²) elsewhere):
    FLA's init zeroes ``o_proj`` and the LoRAs' first projections, which would make the layer's
    output zero and the comparison of the two runs' outputs empty."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.add_((noise * (p.shape[1] ** -0.5 if p.dim() == 2 else 0.1)).to(p.dtype))


def _side_by_side(timer: Timer, fla, fn, grad: bool) -> dict:
    """``fn`` timed on FLA's Triton kernels, then under patch_fla(): both measurements' fields,
    the ratio and the patch's call counts."""
    import torch_dplr
    with fla.route("triton"), torch.set_grad_enabled(grad):
        ref = timer.measure(fn)
        with torch_dplr.patch_fla() as patch:
            mine = timer.measure(fn)
    calls = {name: n for name, n in patch.calls.items() if n}
    if not calls:
        raise RuntimeError("patch_fla() routed no call to torch_dplr")
    return {**ref.fields("fla"), **mine.fields("torch_dplr"),
            "fla_over_torch_dplr": round(ref.ms / mine.ms, 3), "torch_dplr_calls": calls}


def measure_layer(fla, timer: Timer, device, B=8, T=4096, hidden=2048, head_dim=64) -> list[dict]:
    import torch_dplr
    from fla.layers import RWKV7Attention
    from torch_dplr.testing import rms_ratio
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FLA's RWKV-7 layer warns on every construction
        layer = RWKV7Attention(hidden_size=hidden, head_dim=head_dim, layer_idx=1,
                               num_hidden_layers=24, fuse_norm=True)
    _perturb(layer)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda: torch.randn(B, T, hidden, generator=gen, device=device,  # noqa: E731
                               dtype=torch.bfloat16)
    x, v_first, do = rand().requires_grad_(), rand().requires_grad_(), rand()
    base = dict(kind="layer", B=B, T=T, hidden=hidden, head_dim=head_dim,
                heads=hidden // head_dim, dtype="bfloat16", fuse_norm=True, layer_idx=1)

    def forward():
        return layer(x, v_first=v_first)[0]

    def forward_backward():
        # FLA 0.6.0's fused addcmul backward (fla/ops/rwkv7/fused_addcmul.py, addcmul_bwd1 with
        # inplace=True) writes the hidden-state gradient into the layer's input: each backward
        # gets its own copy of x, as a layer inside a model gets a fresh activation (an x
        # reused across calls grows with each forward+backward until it, and both layers'
        # outputs, are NaN)
        layer(x.clone(), v_first=v_first)[0].backward(do)
        # dropped at the end, so no rep (nor the peak-memory call) starts holding them
        layer.zero_grad(set_to_none=True)
        x.grad = v_first.grad = None

    layer.eval()
    records = [{**base, "mode": "fwd", **_side_by_side(timer, fla, forward, grad=False)}]
    layer.train()
    records.append({**base, "mode": "fwd_bwd",
                    **_side_by_side(timer, fla, forward_backward, grad=True)})
    with torch.no_grad(), fla.route("triton"):  # after the timing: first calls stay first
        o_fla = forward()
        with torch_dplr.patch_fla():
            o_mine = forward()
    # a non-finite output makes the ratio NaN: say whose it is, and where it first appears
    check = dict(o_rms_ratio=float(f"{rms_ratio(o_mine, o_fla):.3g}"),
                 fla_o_nonfinite=int((~torch.isfinite(o_fla)).sum()),
                 torch_dplr_o_nonfinite=int((~torch.isfinite(o_mine)).sum()))
    if check["fla_o_nonfinite"]:
        with torch.no_grad(), fla.route("triton"):
            check["fla_first_nonfinite"] = first_nonfinite(layer, forward)
    return [{**rec, **check} for rec in records]


def _finite(value) -> bool:
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    return all(torch.isfinite(t).all().item() for t in tensors if torch.is_tensor(t))


def first_nonfinite(module: torch.nn.Module, run) -> str:
    """``run()`` with forward hooks on every submodule: the first one (in call order) whose
    output is not finite, and whether its inputs were (so a non-finite layer output can be
    traced to the FLA kernel that made it, or to the attention op between two modules)."""
    found = []

    def hook(name):
        def check(_, args, out):
            if not found and not _finite(out):
                found.append(f"{name} (inputs finite: {_finite(args)})")
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in module.named_modules() if n]
    try:
        out = run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else f"no submodule (output finite: {_finite(out)})"


def generate_call(device, layers, hidden, head_dim, vocab, batch, prompt, new_tokens):
    """A small random-initialised bf16 ``RWKV7ForCausalLM`` and its greedy ``generate`` of
    ``new_tokens`` after a ``[batch, prompt]`` prompt, as a call of no arguments."""
    from fla.models import RWKV7Config, RWKV7ForCausalLM
    torch.manual_seed(0)
    config = RWKV7Config(hidden_size=hidden, head_dim=head_dim, num_hidden_layers=layers,
                         vocab_size=vocab)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = RWKV7ForCausalLM(config)
    _perturb(model)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(3, vocab, (batch, prompt), generator=gen, device=device)

    def generate():
        # min_new_tokens: no early stop at the config's eos token
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0)
    return generate


def measure_generate(fla, timer: Timer, device, layers, hidden, head_dim, vocab, batch, prompt,
                     new_tokens) -> dict:
    import torch_dplr
    generate = generate_call(device, layers, hidden, head_dim, vocab, batch, prompt, new_tokens)
    rec = dict(kind="generate", layers=layers, hidden=hidden, head_dim=head_dim, vocab=vocab,
               batch=batch, prompt=prompt, new_tokens=new_tokens, dtype="bfloat16",
               **_side_by_side(timer, fla, generate, grad=False))
    with fla.route("triton"):  # after the timing, as for the layer
        ref = generate()[:, prompt:]
        with torch_dplr.patch_fla():
            mine = generate()[:, prompt:]
    rec["tokens_equal"] = round((ref == mine).float().mean().item(), 4)
    for name in ("fla", "torch_dplr"):
        rec[f"{name}_tokens_per_s"] = round(batch * new_tokens / (rec[f"{name}_ms"] / 1e3), 1)
    return rec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layers",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-generate", action="store_true", help="the layer only")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.layers times FLA's CUDA kernels: no CUDA GPU here")
    fla = _load_fla()
    from .harness import install_fla_autotune_cache, run_meta
    device = torch.device("cuda")
    print(f"FLA {fla.version}; Triton autotune cache: {install_fla_autotune_cache()}",
          file=sys.stderr)
    meta = run_meta(device, fla)

    def record(rec):
        emit({**rec, **meta}, args.out)

    timer = Timer(device, reps=args.reps, warmup=args.warmup)
    for rec in measure_layer(fla, timer, device, args.batch, args.seq_len, args.hidden,
                             args.head_dim):
        record(rec)
    if not args.no_generate:
        torch.cuda.empty_cache()
        # a generate call takes about a second: fewer reps, no L2 flush (it would be noise)
        record(measure_generate(fla, Timer(device, reps=5, warmup=1, flush_l2=False), device,
                                **GENERATE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
