"""FLA's own RWKV-7 layer and model, on FLA's kernels and under ``torch_dplr.patch_fla()``.

The same module runs on the same inputs twice in one process: once with flash-linear-attention's
kernels (forced to its Triton route, ``FLA_TILELANG=0``: FLA's TileLang backend would refuse
the layer's chunk size 64 on sm_90 anyway), once inside ``torch_dplr.patch_fla()``.  Outputs,
caches, the loss and every parameter gradient must agree; greedy generation must pick the same
tokens.  Each test also checks that the patched run reached torch_dplr's functions and that the
reference run did not, so a patch that silently routes nothing fails.

Which FLA 0.6.0 functions run (fla/layers/rwkv7.py, ``RWKV7Attention.forward``):

- ``chunk_rwkv7`` when training, when grad is enabled, or for 64 tokens or more;
- ``fused_mul_recurrent_rwkv7`` otherwise (eval under ``no_grad``, fewer than 64 tokens: decode
  steps and short prefills).  The layer's ``mode`` argument is not consulted, and
  ``fused_recurrent_rwkv7`` is never called by the layer.

Around the attention op the layer and the model run FLA's other Triton kernels, patched or not:
``token_shift``, ``fused_addcmul_rwkv7`` and ``fused_k_rwkv7`` (PyTorch for one token),
``gate_output_correction``; with ``fuse_norm`` (the model's default) ``l2_norm``, FLA's
``GroupNorm`` and ``LayerNorm``; and the model's ``FusedCrossEntropyLoss``.

All tests need a CUDA GPU (marker ``cuda``) and skip when flash-linear-attention does not
import (its ``fla.layers`` and ``fla.models`` import transformers: ``fla-core`` alone, the ops,
is not enough).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import warnings

import pytest
import torch

import torch_dplr

pytestmark = pytest.mark.cuda

DEVICE = "cuda"

# Error bars, as max|out - ref| / max|ref| per tensor (relative to the tensor's largest value).
# bf16 keeps 8 significant bits: neighbouring bf16 values lie 2**-8 to 2**-7 (3.9e-3 to 7.8e-3)
# apart, so one rounding of the largest element can move it by up to 7.8e-3 of the maximum.
# Both implementations take the same bf16 inputs and accumulate in fp32, but round their outputs
# to bf16 (o, and in the backward dr, dw, dk, dv, da, db) at different points and sum in
# different orders: each is about one rounding off the exact result, so up to two apart,
# 1.6e-2 -> bar 2e-2 for outputs.  Gradients take one more bf16 round trip (the incoming
# gradient, the attention's input gradients, the projections' backward in bf16) -> 3e-2.
# Behind more layers a rounding difference is amplified (LayerNorms, the FFN, the next layer),
# so each tensor's bar is also at least twice FLA's own bf16 error, measured against the same
# module run in fp32 on FLA's kernels: torch_dplr and FLA must not differ by more than bf16
# moves FLA itself.  A routing or argument bug (wrong scale, a = -kk dropped, the state not
# carried) changes results by O(1).
BF16_OUT_TOL = 2e-2
BF16_GRAD_TOL = 3e-2
# fp32 generation, logits relative to their max.  A prefill under 64 tokens and every decode
# step run FLA's fused_mul_recurrent kernel: fp32 multiply-adds, no matmul unit, so the two
# implementations agree to ~1e-6 per element; the per-head GroupNorm and two layers amplify that
# (noise of 1e-4 of the attention output's maximum, injected on the CPU, moved this model's
# logits by 8e-3 of theirs) -> 1e-3.  A prefill of 64 tokens or more runs FLA's chunk kernels, whose
# fp32 dots run in TF32 (10-bit mantissa: ~5e-4 per product) -> 5e-2.
FP32_LOGITS_TOL = {"recurrent": 1e-3, "chunk": 5e-2}

HIDDEN, HEAD_DIM = 256, 64  # 4 heads


# ---- setup ---------------------------------------------------------------------------------

def _import_or_skip(name: str, what: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 (absent, or present without what it needs)
        pytest.skip(f"{what} does not import here ({type(exc).__name__}: {exc})"[:300])


@pytest.fixture
def fla_env(monkeypatch):
    """FLA's layer module, on its Triton route, with torch_dplr's entry points counted.

    ``counts`` counts the calls that reach torch_dplr's own functions (behind the patch's
    adapters): zero in a reference run proves FLA's kernels ran, non-zero in a patched run
    proves torch_dplr's did.
    """
    _import_or_skip("fla", "flash-linear-attention")
    layers = _import_or_skip("fla.layers.rwkv7", "flash-linear-attention (fla.layers.rwkv7)")
    monkeypatch.setenv("FLA_TILELANG", "0")  # read by FLA's backend dispatch on every call
    counts = {"chunk_rwkv7": 0, "fused_mul_recurrent_rwkv7": 0}

    def counting(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counting(torch_dplr.api, "chunk_rwkv7")
    counting(torch_dplr.rwkv7, "fused_mul_recurrent_rwkv7")
    yield layers, counts
    torch_dplr.unpatch_fla()


@contextlib.contextmanager
def _fla_kernels(layers, counts):
    """The reference run: FLA's own functions, and torch_dplr not reached."""
    assert layers.chunk_rwkv7.__module__.startswith("fla."), layers.chunk_rwkv7.__module__
    before = dict(counts)
    yield
    assert counts == before, f"the reference run reached torch_dplr: {before} -> {counts}"


@contextlib.contextmanager
def _patched(layers, counts, expect):
    """The run under patch_fla(): FLA's names bound to torch_dplr, and each function in
    ``expect`` called that many times (through the adapter and into torch_dplr)."""
    before = dict(counts)
    with torch_dplr.patch_fla() as patch:
        assert "fla.layers.rwkv7.chunk_rwkv7" in patch.rebound
        assert layers.chunk_rwkv7.__module__ == "torch_dplr.fla_patch"
        assert layers.fused_mul_recurrent_rwkv7.__module__ == "torch_dplr.fla_patch"
        yield patch
    reached = {n: counts[n] - before[n] for n in counts}
    for name, n in expect.items():
        assert patch.calls[name] == n and reached[name] == n, \
            f"{name}: expected {n} calls, adapter ran {patch.calls[name]}, torch_dplr {reached}"
    assert layers.chunk_rwkv7.__module__.startswith("fla."), "patch not undone"


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded noise on every parameter.  FLA's init zeroes the LoRAs' first projections,
    ``o_proj`` and the FFN's value projection, so most gradients would be zero or one-signed;
    weight matrices get N(0, 1/fan_in) added, everything else N(0, 0.1²)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=gen)
            noise *= p.shape[1] ** -0.5 if p.dim() == 2 else 0.1
            p.add_(noise.to(p.dtype))


def _layer(layers, layer_idx=0, fuse_norm=False, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)  # FLA's init draws orthogonal matrices from the global generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FLA's RWKV-7 layer warns on every construction
        layer = layers.RWKV7Attention(hidden_size=HIDDEN, head_dim=HEAD_DIM, layer_idx=layer_idx,
                                      num_hidden_layers=2, fuse_norm=fuse_norm)
    _randomize(layer, seed)
    return layer.to(device=DEVICE, dtype=dtype)


def _randn(*shape, seed):
    """fp32 on DEVICE; each run casts it to its dtype."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _rel_max(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _assert_agree(out: dict, ref: dict, bar: float, what: str, exact: dict | None = None):
    """Each tensor of ``out`` (torch_dplr) within ``bar`` of ``ref`` (FLA), relative to the
    maximum; with ``exact`` (FLA in fp32) the bar is at least twice FLA's own error."""
    assert out.keys() == ref.keys(), f"{what}: {sorted(out)} vs {sorted(ref)}"
    for name, r in ref.items():
        assert r is not None and out[name] is not None, f"{what}: {name} has no value"
        assert torch.isfinite(r).all() and r.abs().max() > 0, \
            f"{what}: FLA's {name} is zero or not finite: the test checks nothing there"
    errors = {name: _rel_max(out[name], r) for name, r in ref.items()}
    bars = {name: max(bar, 2 * _rel_max(r, exact[name])) if exact else bar
            for name, r in ref.items()}
    bad = {n: f"{e:.3g} > {bars[n]:.3g}" for n, e in errors.items() if not e <= bars[n]}
    assert not bad, (f"{what}: max|torch_dplr - FLA| / max|FLA| over the bar for {bad}; "
                     f"all: { {n: f'{e:.3g}' for n, e in errors.items()} }")


def _grads(module: torch.nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}


def _compare(fla_env, module, run, expect, what, dtype=torch.bfloat16):
    """``run(module, dtype) -> (outputs, gradients)``, two dicts of tensors: on FLA's kernels in
    ``dtype`` and, for FLA's own error, on a copy of the module in fp32; then under the patch,
    with ``expect`` calls of torch_dplr's functions.  Asserts they agree."""
    layers, counts = fla_env
    module32 = copy.deepcopy(module).float()
    with _fla_kernels(layers, counts):
        ref = run(module, dtype)
        exact = run(module32, torch.float32)
    with _patched(layers, counts, expect):
        out = run(module, dtype)
    _assert_agree(out[0], ref[0], BF16_OUT_TOL, f"{what} outputs", exact[0])
    _assert_agree(out[1], ref[1], BF16_GRAD_TOL, f"{what} gradients", exact[1])


# ---- the layer -----------------------------------------------------------------------------

# (layer index, fuse_norm, varlen): layer 0 sets v_first, layer 1 mixes it in through v_lora
# (and takes its gradient); fuse_norm swaps in FLA's l2_norm and GroupNorm kernels; varlen packs
# three sequences into one row (cu_seqlens), T not a multiple of the chunk size throughout.
LAYER_CASES = {"layer0": (0, False, False), "layer1-fuse_norm": (1, True, False),
               "layer1-varlen": (1, False, True)}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_forward_backward_matches_fla(fla_env, case):
    layer_idx, fuse_norm, varlen = LAYER_CASES[case]
    layer = _layer(fla_env[0], layer_idx, fuse_norm).train()
    B, T = (1, 300) if varlen else (2, 200)
    cu_seqlens = (torch.tensor([0, 37, 101, 300], dtype=torch.long, device=DEVICE)
                  if varlen else None)
    x, v_first, do = (_randn(B, T, HIDDEN, seed=s) for s in (1, 2, 3))

    def run(layer, dtype):
        xs = x.to(dtype, copy=True).requires_grad_()  # a new leaf per run
        vs = v_first.to(dtype, copy=True).requires_grad_()
        layer.zero_grad(set_to_none=True)
        o, _, _, v_out = layer(xs, v_first=vs, cu_seqlens=cu_seqlens)
        o.backward(do.to(dtype))
        grads = _grads(layer)
        grads["x"] = xs.grad
        if layer_idx > 0:
            grads["v_first"] = vs.grad
        return {"o": o.detach(), "v_first_out": v_out.detach()}, grads

    _compare(fla_env, layer, run, {"chunk_rwkv7": 1, "fused_mul_recurrent_rwkv7": 0}, case)


def test_layer_inference_with_cache_matches_fla(fla_env):
    """eval + no_grad through FLA's cache: an 80-token prefill (chunk_rwkv7, final state out),
    three decode steps and a 10-token continuation (fused_mul_recurrent_rwkv7 from the cached
    state), and a short prompt without a cache (fused_mul_recurrent_rwkv7, no state)."""
    cache_utils = _import_or_skip("fla.models.cache_utils",
                                  "flash-linear-attention's cache (needs transformers)")
    layer = _layer(fla_env[0], layer_idx=1).eval()
    B = 2
    lengths = [80, 1, 1, 1, 10]
    steps = [(_randn(B, n, HIDDEN, seed=10 + i), _randn(B, n, HIDDEN, seed=20 + i))
             for i, n in enumerate(lengths)]
    short = [_randn(B, 20, HIDDEN, seed=s) for s in (30, 31)]

    @torch.no_grad()
    def run(layer, dtype):
        cache, out = cache_utils.Cache(), {}
        for i, (x, v_first) in enumerate(steps):
            out[f"step{i}_T{x.shape[1]}"] = layer(x.to(dtype), v_first=v_first.to(dtype),
                                                  past_key_values=cache, use_cache=True)[0]
        out["recurrent_state"] = cache[1]["recurrent_state"]
        out["conv_state"] = cache[1]["conv_state"]
        out["short_no_cache"] = layer(short[0].to(dtype), v_first=short[1].to(dtype))[0]
        return out, {}

    # the cached state is fp32 in both runs, carrying the outputs' bf16 rounding differences
    _compare(fla_env, layer, run, {"chunk_rwkv7": 1, "fused_mul_recurrent_rwkv7": 5},
             "inference")


# ---- the model (transformers) --------------------------------------------------------------

def _model(dtype, seed=0):
    _import_or_skip("transformers", "transformers")
    models = _import_or_skip("fla.models", "flash-linear-attention's models")
    config = models.RWKV7Config(hidden_size=HIDDEN, head_dim=HEAD_DIM, num_hidden_layers=2,
                                vocab_size=1000, decay_low_rank_dim=32, gate_low_rank_dim=64,
                                a_low_rank_dim=32, v_low_rank_dim=32)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = models.RWKV7ForCausalLM(config)
    _randomize(model, seed)
    return model.to(device=DEVICE, dtype=dtype)


def test_model_loss_and_gradients_match_fla(fla_env):
    model = _model(torch.bfloat16).train()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (2, 200), generator=gen).to(DEVICE)

    def run(model, dtype):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return {"loss": loss.detach().reshape(1)}, _grads(model)

    n_layers = model.config.num_hidden_layers
    _compare(fla_env, model, run, {"chunk_rwkv7": n_layers, "fused_mul_recurrent_rwkv7": 0},
             "model")


# prompt length -> the op FLA prefills with (under no_grad: chunk_rwkv7 from 64 tokens on)
PROMPTS = {"recurrent": 40, "chunk": 72}


@pytest.mark.parametrize("prefill", list(PROMPTS))
def test_model_greedy_generation_matches_fla(fla_env, prefill):
    """32 greedy tokens from a fixed prompt: the prefill (40 tokens: fused_mul_recurrent_rwkv7;
    72: chunk_rwkv7, handing its state on), then 31 decode steps on fused_mul_recurrent_rwkv7.

    fp32 parameters (FLA's kernels take fp32): in bf16 the top two logits of a random model
    are often within a rounding of each other, and a tie broken differently is not an error.
    In fp32 the two implementations' logits differ far less than the usual gap between the top
    two, so the tokens must be equal.  After a chunked prefill (FLA in TF32) one exception is
    allowed: a step whose top-2 margin is within the difference measured between the two runs'
    logits at that very step (same tokens so far), a tie neither implementation decides, after
    which the sequences are no longer comparable.  The logits of every step up to there are
    compared too.
    """
    layers, counts = fla_env
    model = _model(torch.float32).eval()
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, model.config.vocab_size, (2, PROMPTS[prefill]), generator=gen)
    prompt = prompt.to(DEVICE)
    new = 32

    @torch.no_grad()
    def run():
        # min_new_tokens: no early stop at the config's eos token; output_logits: the raw
        # logits (output_scores' processed ones hold -inf where eos is masked)
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                              do_sample=False, max_new_tokens=new, min_new_tokens=new,
                              pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                              output_logits=True)

    with _fla_kernels(layers, counts):
        ref = run()
    n = model.config.num_hidden_layers
    chunked = prefill == "chunk"
    expect = {"chunk_rwkv7": n if chunked else 0,
              "fused_mul_recurrent_rwkv7": n * (new - 1 if chunked else new)}
    with _patched(layers, counts, expect):
        out = run()
    tokens_ref, tokens = ref.sequences[:, prompt.shape[1]:], out.sequences[:, prompt.shape[1]:]
    assert tokens_ref.shape == tokens.shape == (prompt.shape[0], new)
    differ = (tokens != tokens_ref).any(0).nonzero()
    first = int(differ[0]) if len(differ) else new
    # every step reached from the same tokens: up to and including the first that differs
    steps = range(min(first + 1, new))
    _assert_agree({f"step{i}": out.logits[i] for i in steps},
                  {f"step{i}": ref.logits[i] for i in steps}, FP32_LOGITS_TOL[prefill],
                  "generation logits")
    if first < new:
        rows = tokens[:, first] != tokens_ref[:, first]
        top2 = ref.scores[first][rows].float().topk(2, dim=-1).values  # what greedy chose from
        margin = (top2[:, 0] - top2[:, 1]).max().item()
        diff = (out.logits[first] - ref.logits[first]).abs().max().item()
        assert chunked and margin <= 2 * diff, (
            f"greedy tokens differ from step {first} on; FLA's top-2 logit margin there "
            f"{margin:.3g}, the runs' logit difference {diff:.3g}:"
            f"\nFLA        {tokens_ref.tolist()}\ntorch_dplr {tokens.tolist()}")
