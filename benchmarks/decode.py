"""Decode steps side by side: torch_dplr's per-token path against FLA's
``fused_recurrent_rwkv7`` and FlashRWKV2's ``tmix_wkv7_recurrent`` (its default
configuration, untuned), in one process on the same values (bf16 r, k, v, a, b; RWKV-7 gates
``-exp(-0.5)·sigmoid(x)``; fp32 state in and out).

Per (batch, head dim), with ``T`` tokens per request (1: one decode step):

- ``torch_dplr_us``: ``torch_dplr.fused_recurrent_rwkv7`` (functional: a new final state);
- ``torch_dplr_pool_us``: ``torch_dplr.rwkv7_decode`` over a state pool (in place);
- ``torch_dplr_pool_bf16_us``: the same over a bf16 pool (half the state bytes; its floor
  ``floor_bf16_us``);
- ``fla_us``, ``frwkv_us``: the peers, where they import;
- ``floor_us``: reading and writing the fp32 state once at 4.3 TB/s;
- ``*_o_vs_dplr``: RMS ratio of each peer's output against torch_dplr's;
- ``best_peer_over_torch_dplr_*``, ``best_peer_over_pool_*``: the faster peer's time over
  torch_dplr's functional call (the peers' like) and over its pool step (above 1: torch_dplr is
  faster).

``*_us`` are ``triton.testing.do_bench`` medians of eager calls (host time included);
``*_graph_us`` the same calls captured in a CUDA graph and replayed (device time, as a serving
engine runs decode steps), where the implementation can be captured.

    python -m benchmarks.decode --out benchmarks/results/h200-decode.jsonl

``--kernel-configs 16x1,32x1,32x4,64x4`` adds, per cell, a ``kind: "decode_config"`` record per
``BVxWARPS`` of the per-token kernel (its V-block width and warps in place of
``csrc_triton.recurrent.config``'s choice): the functional and fp32-pool steps' graph-replay
times, to choose that default per head dim and batch.
"""
from __future__ import annotations

import argparse
import contextlib
import math

import torch

from .jsonl import emit

HBM_BYTES_PER_S = 4.3e12


def _inputs(B, T, H, D, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    kk = torch.nn.functional.normalize(rand(B, T, H, D), dim=-1)
    logits = rand(B, T, H, D)
    w = -math.exp(-0.5) * torch.sigmoid(logits)
    return dict(r=rand(B, T, H, D).bfloat16(), w=w, logits=logits.bfloat16(),
                k=(rand(B, T, H, D) * D ** -0.5).bfloat16(), v=rand(B, T, H, D).bfloat16(),
                a=(-kk).bfloat16(), b=(kk * torch.sigmoid(rand(B, T, H, D))).bfloat16(),
                state=rand(B, H, D, D) * 0.1)


def _us(fn) -> float:
    import triton
    return round(1e3 * triton.testing.do_bench(fn, warmup=25, rep=200), 2)


def _graph_us(fn):
    """Replay time of ``fn`` captured in a CUDA graph, or None when it cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 (not capturable: recorded as missing)
        return None
    return _us(graph.replay)


def _time(rec, name, fn):
    rec[f"{name}_us"] = _us(fn)
    graph = _graph_us(fn)
    if graph is not None:
        rec[f"{name}_graph_us"] = graph


def _rms_ratio(x, ref) -> float:
    from torch_dplr.testing import rms_ratio
    return float(f"{rms_ratio(x, ref):.3g}")


def _own_calls(x: dict) -> dict:
    """torch_dplr's decode steps on ``x``: the functional call, and ``rwkv7_decode`` over an
    fp32 and a bf16 pool holding ``x``'s states in slots 0..B-1."""
    import torch_dplr
    args = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    slots = torch.arange(x["state"].shape[0], dtype=torch.int32, device=x["state"].device)
    pools = {"torch_dplr_pool": x["state"].clone(),
             "torch_dplr_pool_bf16": x["state"].to(torch.bfloat16)}

    def over(pool):
        return lambda: torch_dplr.rwkv7_decode(*args, pool, slots, check_values=False)

    return {"torch_dplr": lambda: torch_dplr.fused_recurrent_rwkv7(
                *args, scale=1.0, initial_state=x["state"], output_final_state=True),
            **{name: over(pool) for name, pool in pools.items()}}


def measure(B: int, T: int, H: int, D: int) -> dict:
    x = _inputs(B, T, H, D)
    args = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    state_bytes = B * H * D * D
    rec = dict(kind="decode", B=B, T=T, H=H, D=D,
               floor_us=round(1e6 * 2 * 4 * state_bytes / HBM_BYTES_PER_S, 2),
               floor_bf16_us=round(1e6 * 2 * 2 * state_bytes / HBM_BYTES_PER_S, 2))
    own = _own_calls(x)
    o_ref, _ = own["torch_dplr"]()
    for name, fn in own.items():
        _time(rec, name, fn)
    try:
        from fla.ops.rwkv7 import fused_recurrent_rwkv7 as fla_recurrent
        fla = lambda: fla_recurrent(*args, scale=1.0, initial_state=x["state"],  # noqa: E731
                                    output_final_state=True)
        rec["fla_o_vs_dplr"] = _rms_ratio(fla()[0], o_ref)
        _time(rec, "fla", fla)
    except Exception as exc:  # noqa: BLE001 (a missing or failing peer is recorded, not fatal)
        rec["fla_error"] = f"{type(exc).__name__}: {exc}"[:200]
    try:
        from flashrwkv2.tmix.wkv7.tilelang import tmix_wkv7_recurrent
        flat = lambda t: t.reshape(B * T, H, D)  # noqa: E731
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device="cuda")
        frwkv = lambda: tmix_wkv7_recurrent(  # noqa: E731
            *map(flat, (x["r"], x["logits"], x["k"], x["v"], x["a"], x["b"])), x["state"], cu,
            scale=1.0, block_values=64, prefetch_tokens=1)
        rec["frwkv_o_vs_dplr"] = _rms_ratio(frwkv()[0].reshape(o_ref.shape), o_ref)
        _time(rec, "frwkv", frwkv)
    except Exception as exc:  # noqa: BLE001
        rec["frwkv_error"] = f"{type(exc).__name__}: {exc}"[:200]
    for suffix in ("us", "graph_us"):
        peers = [rec[f"{n}_{suffix}"] for n in ("fla", "frwkv") if f"{n}_{suffix}" in rec]
        # the functional call is the peers' like (state in, new state out); the pool is ours
        for mine, label in (("torch_dplr", "torch_dplr"), ("torch_dplr_pool", "pool")):
            if peers and rec.get(f"{mine}_{suffix}"):
                rec[f"best_peer_over_{label}_{suffix}"] = round(
                    min(peers) / rec[f"{mine}_{suffix}"], 3)
    return rec


def parse_kernel_configs(text: str) -> list[tuple[int, int]]:
    """``"32x1,64x4"`` -> ``[(32, 1), (64, 4)]`` (V-block width, warps)."""
    configs = []
    for item in filter(None, text.split(",")):
        bv, _, warps = item.partition("x")
        if not (bv.isdigit() and warps.isdigit()):
            raise ValueError(f"--kernel-configs: {item!r} is not BVxWARPS (e.g. 32x4)")
        configs.append((int(bv), int(warps)))
    return configs


@contextlib.contextmanager
def kernel_config(bv: int, warps: int):
    """Inside, the per-token kernel launches with V-blocks of ``bv`` (at most V) and ``warps``."""
    from csrc_triton import recurrent
    default = recurrent.config
    recurrent.config = lambda K, V: (min(bv, V), warps)
    try:
        yield
    finally:
        recurrent.config = default


def measure_configs(B: int, T: int, H: int, D: int, configs) -> list[dict]:
    if not configs:
        return []
    own = _own_calls(_inputs(B, T, H, D))
    records = []
    for bv, warps in configs:
        rec = dict(kind="decode_config", B=B, T=T, H=H, D=D, block_v=min(bv, D), num_warps=warps)
        with kernel_config(bv, warps):  # _graph_us runs each call before capturing it
            for name in ("torch_dplr", "torch_dplr_pool"):
                rec[f"{name}_graph_us"] = _graph_us(own[name])
        records.append(rec)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,128,512")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--out", default=None, help="append JSON lines here")
    parser.add_argument("--kernel-configs", default="",
                        help="BVxWARPS list of per-token kernel configurations to time as well")
    args = parser.parse_args(argv)
    configs = parse_kernel_configs(args.kernel_configs)
    from .harness import card_meta
    meta = card_meta(torch.device("cuda"))  # the card and the commit, in every record
    for D in map(int, args.head_dims.split(",")):
        for T in map(int, args.tokens.split(",")):
            for B in map(int, args.batches.split(",")):
                emit({**measure(B, T, args.heads, D), **meta}, args.out)
                for rec in measure_configs(B, T, args.heads, D, configs):
                    emit({**rec, **meta}, args.out)


if __name__ == "__main__":
    main()
