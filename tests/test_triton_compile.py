"""Every Triton kernel (``csrc_triton``) compiles for sm_90a with no GPU: Triton's compiler
and its bundled ptxas run on the CPU.  The compiles run in a child process without
``TRITON_INTERPRET`` (conftest.py turns the interpreter on for CPU test sessions)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def variants():
    """(kernel, pointer dtypes, constexprs): the sweep's three schemes at chunks 16 and 64,
    forward (also in value blocks) and backward, the split forward's terms (16-row tiles and
    64-row chunks) and state walk (16- and 64-row steps) and the split backward's walk and chunk
    kernel, the per-token kernel (functional, pool-indexed, and flagged), and the DSA KL loss's
    backward (fp32 and bf16 scores, the block sizes of k 200 and 2048)."""
    p, f = "*bf16", "*fp32"
    fwd = dict(q=p, k=p, v=p, a=p, b=p, gk=f, h0=f, cu_seqlens="*i32", chunk_offsets="*i32",
               o=p, ht=f, h_out=f, flags="*i32", scale="fp32", H="i32")
    bwd = dict(q=p, k=p, v=p, a=p, b=p, gk=f, h_saved=f, do=p, dht=f, cu_seqlens="*i32",
               chunk_offsets="*i32", flags="*i32", workspace=f, dq=p, dk=p, dv=p, da=p, db=p,
               dgk=f, dh0=f, scale="fp32", H="i32")
    rec = dict(q=p, k=p, v=p, a=p, b=p, gk=f, h0=f, state_rows="*i32", cu_seqlens="*i32",
               flags="*i32", o=p, ht=f, scale="fp32", seq_len="i32", H="i32")
    for mode in (0, 1, 2):
        for tiles in (1, 4):
            yield "chunk_fwd", fwd, dict(K=64, V=64, BV=64, BT=16, TILES_PER_CHUNK=tiles,
                                         USE_H0=True, STORE_H=True, MODE=mode, REVERSE=False,
                                         STATE_SPLIT=True)
    for split in (True, False):  # value blocks; the state rounded once
        yield "chunk_fwd", fwd, dict(K=64, V=64, BV=32, BT=16, TILES_PER_CHUNK=4, USE_H0=True,
                                     STORE_H=False, MODE=0, REVERSE=False, STATE_SPLIT=split)
    for mode, tiles, reverse, split in ((0, 4, False, True), (1, 4, False, True),
                                        (2, 1, True, True), (0, 4, False, False)):
        yield "chunk_bwd", bwd, dict(K=64, V=64, BT=16, TILES_PER_CHUNK=tiles,
                                     USE_DHT=True, WRITE_DH0=True, MODE=mode, REVERSE=reverse,
                                     STATE_SPLIT=split)
    terms = dict(q=p, k=p, v=p, a=p, b=p, gk=f, chunk_start="*i32", chunk_len="*i32", w_out=p,
                 u_out=p, A_qk_out=p, A_qb_out=p, tile_flags="*i32", scale="fp32", H="i32")
    for mode in (0, 1, 2):
        yield "tile_terms", terms, dict(K=64, V=64, BT=16, TILES_PER_CHUNK=4, MODE=mode)
    chunk_terms = dict(terms, block_flags="*i32")
    del chunk_terms["tile_flags"]
    for mode in (0, 1, 2):
        yield "chunk_terms", chunk_terms, dict(K=64, V=64, BT=16, BLOCKS=4, MODE=mode)
    walk = dict(q=p, k=p, v=p, b=p, gk=f, w=p, u=p, A_qk=p, A_qb=p, block_flags="*i32", h0=f,
                cu_seqlens="*i32", chunk_offsets="*i32", o=p, ht=f, h_out=f, flags="*i32",
                scale="fp32", H="i32")
    for bv, rows in ((64, 16), (32, 16), (64, 64)):
        yield "state_sweep", walk, dict(K=64, V=64, BV=bv, BT=rows, TILES_PER_CHUNK=64 // rows,
                                        USE_H0=True, STORE_H=True, STATE_SPLIT=bv == 64)
    grad_walk = dict(q=p, b=p, gk=f, w=p, A_qb=p, do=p, dht=f, cu_seqlens="*i32",
                     chunk_offsets="*i32", dh_chunks=f, dh0=f, scale="fp32", H="i32")
    for rows in (16, 64):
        yield "grad_walk", grad_walk, dict(K=64, V=64, BV=64, BT=rows,
                                           TILES_PER_CHUNK=64 // rows, USE_DHT=True,
                                           WRITE_DH0=True, STATE_SPLIT=True)
    grads = dict(q=p, k=p, v=p, a=p, b=p, gk=f, h_saved=f, dh_chunks=f, do=p,
                 chunk_start="*i32", chunk_len="*i32", tile_flags="*i32", dq=p, dk=p, dv=p,
                 da=p, db=p, dgk=f, scale="fp32", H="i32")
    for mode in (0, 1, 2):
        yield "chunk_grads", grads, dict(K=64, V=64, BT=16, TILES_PER_CHUNK=4, MODE=mode,
                                         STATE_SPLIT=True)
    for indexed, flagged, rect, pair in ((False, False, False, False), (True, False, True, False),
                                         (False, True, False, False), (False, False, True, False),
                                         (False, False, True, True)):
        yield "recurrent", rec, dict(K=64, V=64, BV=64, USE_H0=True, INDEXED=indexed,
                                     REVERSE=False, FLAGGED=flagged, RECT=rect, RWKV7_PAIR=pair)
    # a bf16 state pool (decode_pool's lower-precision storage)
    yield "recurrent", dict(rec, h0=p, ht=p), dict(K=64, V=64, BV=64, USE_H0=True, INDEXED=True,
                                                 REVERSE=False, FLAGGED=False, RECT=True,
                                                 RWKV7_PAIR=False)
    for scores, block in ((f, 256), (p, 1024)):
        yield "dsa_loss_bwd", dict(scores=scores, target=f, indices="*i32", factor=f,
                                   dscores=scores, k="i32"), dict(BLOCK=block)


def compile_all():
    """Compile every variant for sm_90a; print one JSON line each (registers, spills)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernels = {"chunk_fwd": ("csrc_triton.chunk_fwd", "chunk_fwd_kernel", 4),
               "chunk_bwd": ("csrc_triton.chunk_bwd", "chunk_bwd_kernel", 4),
               "recurrent": ("csrc_triton.recurrent", "recurrent_fwd_kernel", 4),
               "tile_terms": ("csrc_triton.tile_terms", "tile_terms_kernel", 1),
               "chunk_terms": ("csrc_triton.chunk_terms", "chunk_terms_kernel", 4),
               "state_sweep": ("csrc_triton.state_sweep", "state_sweep_kernel", 4),
               "grad_walk": ("csrc_triton.chunk_grads", "grad_walk_kernel", 4),
               "chunk_grads": ("csrc_triton.chunk_grads", "chunk_grads_kernel", 4),
               "dsa_loss_bwd": ("csrc_triton.dsa_loss_bwd", "kl_loss_bwd_kernel", 4)}
    for name, pointers, constexprs in variants():
        module, attr, warps = kernels[name]
        fn = getattr(importlib.import_module(module), attr)
        signature = dict(pointers, **{c: "constexpr" for c in constexprs})
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": 1})
        assert compiled.asm["cubin"], name
        print(json.dumps(dict(kernel=name, **constexprs, shared=compiled.metadata.shared)),
              flush=True)


def test_every_triton_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(list(variants()))


def test_register_report_covers_the_split_pass():
    """tools/triton_registers.py compiles every launch of the split pass (captured on CPU
    tensors, not run) and reports each kernel's registers and stack."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "triton_registers.py"),
                          "--chunk", "16", "--warps", "8", "--state-split", "0"], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert {line["kernel"] for line in lines} == {"tile_terms_kernel", "state_sweep_kernel",
                                                  "grad_walk_kernel", "chunk_grads_kernel"}
    for line in lines:
        assert line["num_warps"] == 8 and line["TILES_PER_CHUNK"] == 1, line
        assert 0 < line["regs"] <= 255 and line["stack"] >= 0, line
    assert {line["STATE_SPLIT"] for line in lines if "STATE_SPLIT" in line} == {False}


if __name__ == "__main__":
    compile_all()
