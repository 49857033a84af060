"""The chunked sweep kernels (``csrc_triton.chunk_fwd`` / ``chunk_bwd``) launched directly,
over their schedule knobs, with the bytes each launch moves.

Per (shape, chunk size, knobs) one JSON line: ``fwd`` (no states kept: the no-grad forward),
``fwd_states`` (the training forward: also the state at every chunk start), ``bwd`` (every
gradient from the kept states), and the split forward (``csrc_triton.state_sweep``) as
``split`` / ``split_states`` with its halves ``tile_terms`` and ``state_walk`` timed alone, and
the split backward (``csrc_triton.chunk_grads``) as ``split_bwd`` with its ``grad_walk`` and
``chunk_grads`` parts; ``--walk-rows 64`` (chunk 64) takes every chunk's terms
(``csrc_triton.chunk_terms``, timed as ``tile_terms``) and walks a 64-row step per chunk,
each in ms (:class:`benchmarks.timing.Timer`: CUDA events, L2 flushed, median), with ``*_mb``
(the bytes each launch must move: every input read once, every output written once, the split's
intermediates included, in 1e6 bytes) and ``*_gbps``.  Knobs: value blocks, warps, pipeline
stages and ``--state-split`` (1: the state and v_new enter products as hi/lo pairs, 0: rounded
once to bf16).  Inputs are the harness's (bf16, RWKV-7 gates, fp32 initial state, a declared
bound: the centred scheme plus its exact pass).

    python -m benchmarks.sweep_kernels --out benchmarks/results/h200-sweep.jsonl
    python -m benchmarks.sweep_kernels --shapes design --block-v 64,32,16 --warps 4,2
    python -m benchmarks.sweep_kernels --shapes design,small --stages 1,3 --state-split 1,0
    python -m benchmarks.sweep_kernels --walk-rows 16,64 --modes split_states,split_bwd
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from torch_dplr.ops.varlen import as_one_sequence_list as flat
from torch_dplr.ops.varlen import kernel_tables

from . import inputs
from .cells import Shape
from .timing import Timer

SHAPES = {"design": Shape(8, 4096, 32, 64), "small": Shape(2, 4096, 8, 64),
          "long": Shape(1, 65536, 32, 64), "varlen": Shape(1, 32768, 32, 64, N=8)}
MODES = ("fwd", "fwd_states", "bwd", "split", "split_states", "split_bwd")


def _mb(*tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


class SweepCase:
    """One shape's inputs and every buffer of a sweep forward and backward at chunk size C."""

    def __init__(self, shape: Shape, C: int, walk_rows: int = 16):
        x = inputs.make(shape, "rwkv7", "cuda")
        self.C, self.walk_rows = C, walk_rows
        self.cu = (x.cu_seqlens if x.cu_seqlens is not None
                   else torch.zeros(0, dtype=torch.int64, device="cuda"))
        self.tables = kernel_tables(self.cu, shape.B, shape.T, C, x.q.device)
        N, H, D = self.tables.cu_seqlens.shape[0] - 1, shape.H, shape.D
        self.tokens = tuple(map(flat, (x.q, x.k, x.v, x.a, x.b, x.gk)))
        self.h0, self.dht, self.do = x.h0.contiguous(), x.dht.contiguous(), flat(x.do)
        self.o = torch.empty_like(self.tokens[2])
        self.ht = torch.empty(N, H, D, D, device="cuda")
        self.states = torch.empty(1, self.tables.chunk_start.shape[0], H, D, D, device="cuda")
        self.flags = torch.empty(N, H, dtype=torch.int32, device="cuda")
        self.grads = [torch.empty_like(t) for t in self.tokens]
        self.dh0 = torch.empty_like(self.ht)
        q, v = self.tokens[0], self.tokens[2]
        # the split forward's intermediates: w, u, A_qk, A_qb (a row against its tile's or
        # chunk's rows), per-16-row flags
        self.terms = (torch.empty_like(q), torch.empty_like(v),
                      q.new_empty(*q.shape[:3], walk_rows), q.new_empty(*q.shape[:3], walk_rows))
        self.tile_flags = torch.empty(self.tables.chunk_start.shape[0] * (C // 16), H,
                                      dtype=torch.int32, device="cuda")
        self.dh_chunks = torch.empty_like(self.states)

    def traffic_mb(self, mode: str) -> float:
        reads = _mb(*self.tokens, self.h0)
        if mode == "fwd":
            return reads + _mb(self.o, self.ht)
        if mode == "fwd_states":
            return reads + _mb(self.o, self.ht, self.states)
        if mode == "bwd":
            return reads + _mb(self.do, self.dht, self.states, *self.grads, self.dh0)
        q, k, v, a, b, gk = self.tokens
        w, u, A_qk, A_qb = self.terms
        if mode == "grad_walk":
            return _mb(q, b, gk, w, A_qb, self.do, self.dht, self.dh_chunks, self.dh0)
        if mode == "chunk_grads":
            return _mb(*self.tokens, self.do, self.states, self.dh_chunks, *self.grads)
        if mode == "split_bwd":
            return sum(map(self.traffic_mb, ("tile_terms", "grad_walk", "chunk_grads")))
        if mode == "tile_terms":
            return _mb(*self.tokens, *self.terms)
        walk = _mb(q, k, v, b, gk, *self.terms, self.h0, self.o, self.ht)
        if mode == "state_walk_states":
            return walk + _mb(self.states)
        if mode == "state_walk":
            return walk
        store = mode == "split_states"
        return self.traffic_mb("tile_terms") + self.traffic_mb(
            "state_walk_states" if store else "state_walk")

    def forward(self, store: bool, **knobs):
        from csrc_triton import chunk_fwd
        chunk_fwd.launch(*self.tokens, self.h0, self.tables.cu_seqlens, self.tables.chunk_offsets,
                         self.o, self.ht, self.states, self.flags, 0.125, self.C, True, store,
                         True, False, **knobs)

    def tile_terms(self, num_warps: int):
        from csrc_triton import chunk_terms, tile_terms
        if self.walk_rows == 16:
            tile_terms.launch(*self.tokens, self.tables.chunk_start, self.tables.chunk_len,
                              *self.terms, self.tile_flags, 0.125, self.C, True,
                              num_warps=num_warps)
        else:
            chunk_terms.launch(*self.tokens, self.tables.chunk_start, self.tables.chunk_len,
                               *self.terms, self.tile_flags, 0.125, True, num_warps=num_warps)

    def state_walk(self, store: bool, num_warps: int, block_v: int, num_stages: int,
                   state_split: bool):
        from csrc_triton import state_sweep
        q, k, v, a, b, gk = self.tokens
        state_sweep.launch(q, k, v, b, gk, *self.terms, self.h0, self.tables.cu_seqlens,
                           self.tables.chunk_offsets, self.o, self.ht, self.states, self.flags,
                           0.125, self.C, True, store, num_warps=num_warps, block_v=block_v,
                           num_stages=num_stages, state_split=state_split,
                           block_flags=None if self.walk_rows == 16 else self.tile_flags)

    def split(self, store: bool, num_warps: int, block_v: int, num_stages: int,
              state_split: bool):
        self.tile_terms(num_warps)
        self.state_walk(store, num_warps, block_v, num_stages, state_split)

    def grad_walk(self, num_warps: int, block_v: int, num_stages: int, state_split: bool):
        from csrc_triton import chunk_grads
        q, k, v, a, b, gk = self.tokens
        w, u, A_qk, A_qb = self.terms
        chunk_grads.launch_walk(q, b, gk, w, A_qb, self.do, self.dht, self.tables.cu_seqlens,
                                self.tables.chunk_offsets, self.dh_chunks, self.dh0, 0.125,
                                self.C, True, True, num_warps=num_warps, block_v=block_v,
                                num_stages=num_stages, state_split=state_split,
                                walk_rows=self.walk_rows)

    def chunk_grads(self, num_warps: int, num_stages: int, state_split: bool):
        from csrc_triton import chunk_grads
        chunk_grads.launch_grads(*self.tokens, self.states, self.dh_chunks, self.do,
                                 self.tables.chunk_start, self.tables.chunk_len, self.tile_flags,
                                 *self.grads, 0.125, self.C, True, num_warps=num_warps,
                                 num_stages=num_stages, state_split=state_split)

    def split_backward(self, num_warps: int, block_v: int, num_stages: int, state_split: bool):
        self.tile_terms(num_warps)
        self.grad_walk(num_warps, block_v, num_stages, state_split)
        self.chunk_grads(num_warps, num_stages, state_split)

    def backward(self, workspace, num_warps: int, num_stages: int, state_split: bool):
        from csrc_triton import chunk_bwd
        chunk_bwd.launch(*self.tokens, self.states, self.do, self.dht, self.tables.cu_seqlens,
                         self.tables.chunk_offsets, self.flags, workspace, *self.grads, self.dh0,
                         0.125, self.C, True, True, True, False, num_warps=num_warps,
                         num_stages=num_stages, state_split=state_split)


def _record(rec: dict, name: str, ms: float, mb: float):
    rec.update({f"{name}_ms": round(ms, 4), f"{name}_mb": round(mb, 1),
                f"{name}_gbps": round(mb / ms, 1)})


def run(shape_names, chunks, block_vs, warps, stages, splits, modes, out=None, reps=15,
        walk_rows=(16,)):
    timer = Timer("cuda", reps=reps, warmup=2, cap_s=3.0)
    for name in shape_names:
        shape = SHAPES[name]
        for C, rows in itertools.product(chunks, walk_rows):
            if rows not in (16, C):  # 64-row steps: chunk 64 only
                continue
            case = SweepCase(shape, C, rows)
            for bv, nw, ns, ss in itertools.product(block_vs, warps, stages, splits):
                rec = dict(shape=shape.label, chunk=C, block_v=bv, num_warps=nw, num_stages=ns,
                           state_split=bool(ss), walk_rows=rows)
                knobs = dict(num_warps=nw, block_v=bv, num_stages=ns, state_split=bool(ss))
                # the backward has no value blocks and the tile terms only warps: timed for
                # the first block_v (the tile terms: also the first stages and split)
                first = bv == block_vs[0]
                terms_first = first and (ns, ss) == (stages[0], splits[0])
                try:
                    for mode in modes:
                        if mode == "bwd" and not first:
                            continue
                        if mode == "bwd":
                            from csrc_triton import chunk_bwd
                            H, D = shape.H, shape.D
                            ws = torch.empty(chunk_bwd.workspace_shape(
                                H, case.flags.shape[0], C // 16, D, D), device="cuda")
                            case.forward(True, **knobs)
                            ms = timer.measure(lambda: case.backward(ws, nw, ns, bool(ss))).ms
                            _record(rec, mode, ms, case.traffic_mb(mode))
                        elif mode == "split_bwd":
                            case.forward(True, **knobs)  # the kept states
                            timed = {mode: lambda: case.split_backward(**knobs),
                                     "grad_walk": lambda: case.grad_walk(**knobs)}
                            if first:  # no value blocks
                                timed["chunk_grads"] = lambda: case.chunk_grads(nw, ns, bool(ss))
                            for part, fn in timed.items():
                                _record(rec, part, timer.measure(fn).ms, case.traffic_mb(part))
                        elif mode.startswith("split"):
                            store = mode == "split_states"
                            walk = "state_walk_states" if store else "state_walk"
                            timed = {mode: lambda: case.split(store, **knobs),
                                     walk: lambda: case.state_walk(store, **knobs)}
                            if terms_first and "tile_terms_ms" not in rec:
                                timed["tile_terms"] = lambda: case.tile_terms(nw)
                            for part, fn in timed.items():
                                _record(rec, part, timer.measure(fn).ms, case.traffic_mb(part))
                        else:
                            store = mode == "fwd_states"
                            ms = timer.measure(lambda: case.forward(store, **knobs)).ms
                            _record(rec, mode, ms, case.traffic_mb(mode))
                except Exception as exc:  # noqa: BLE001  (a config that does not build)
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                line = json.dumps(rec)
                print(line, flush=True)
                if out:
                    with open(out, "a") as f:
                        f.write(line + "\n")
            del case
            torch.cuda.empty_cache()


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep_kernels",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}")
    parser.add_argument("--chunks", default="64")
    parser.add_argument("--block-v", default="0", help="V columns per program (0: all)")
    parser.add_argument("--warps", default="4")
    parser.add_argument("--stages", default="1")
    parser.add_argument("--state-split", default="1",
                        help="1: state and v_new as hi/lo pairs in products, 0: rounded once")
    parser.add_argument("--walk-rows", default="16",
                        help="rows of a split walk step: 16, or 64 (chunk 64: chunk_terms)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {list(MODES)}")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    shapes = [s for s in args.shapes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    for bad in set(shapes) - set(SHAPES):
        parser.error(f"--shapes: unknown shape {bad!r}")
    for bad in set(modes) - set(MODES):
        parser.error(f"--modes: unknown mode {bad!r}")
    run(shapes, _ints(args.chunks), _ints(args.block_v), _ints(args.warps), _ints(args.stages),
        _ints(args.state_split), modes, args.out, walk_rows=_ints(args.walk_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
