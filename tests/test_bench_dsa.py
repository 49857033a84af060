"""The DSA benchmark on the CPU: FLOP counts, cells, inputs, records, the markdown's targets, a
tiny run, the TileLang-example adapters against a pure-PyTorch stand-in with their signatures."""
import json
import sys
import textwrap

import pytest

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import dsa, dsa_peers, report
from benchmarks.timing import Timer
from torch_dplr.dsa import validation
from torch_dplr.dsa.ops import sparse_mla as sparse_mla_ops
from torch_dplr.dsa.testing import visible_mask


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_flop_counts_against_an_independent_count():
    T, H, k, D, V, Hi, Di = 12, 3, 5, 24, 16, 2, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=gen, requires_grad=True)
    kv = torch.randn(T, D, generator=gen, requires_grad=True)
    idx = torch.randint(0, T, (T, k), generator=gen)

    def attention():  # the gather formulation: one q·k and one p·v product per slot
        keys = kv[idx]
        logits = torch.einsum("thd,tkd->thk", q, keys)
        return torch.einsum("thk,tkv->thv", logits.softmax(-1), keys[..., :V])

    forward = _counted(attention)
    o = attention()
    backward = _counted(lambda: torch.autograd.grad(o, (q, kv), torch.ones_like(o)))
    assert dsa.sparse_mla_flops(T, H, k, D, V, "fwd") == forward
    # a flash-style backward also recomputes q·kᵀ (autograd kept it)
    assert dsa.sparse_mla_flops(T, H, k, D, V, "bwd") == backward + 2 * T * H * k * D
    assert dsa.sparse_mla_flops(T, H, k, D, V, "fwd_bwd") == forward + backward + 2 * T * H * k * D

    q_idx = torch.randn(T, Hi, Di, generator=gen, requires_grad=True)
    k_idx = torch.randn(T, Di, generator=gen, requires_grad=True)
    dense = _counted(lambda: torch.einsum("thd,sd->ths", q_idx, k_idx))
    pairs = int(visible_mask(T).sum())
    assert pairs == dsa.visible_pairs(T)
    topk_cell = dsa.Cell("indexer_topk", "fwd", T, k=k, H_idx=Hi, D_idx=Di)
    assert dsa.cell_flops(topk_cell) == dense * pairs // (T * T)

    def scores():  # weighting by w is elementwise: no product counted
        return torch.einsum("thd,tkd->thk", q_idx, k_idx[idx]).relu().sum(1)

    s = scores()
    index_fwd, index_bwd = _counted(scores), _counted(
        lambda: torch.autograd.grad(s, (q_idx, k_idx), torch.ones_like(s)))
    cell = dict(T=T, H=H, k=k, D_qk=D, d_v=V, H_idx=Hi, D_idx=Di)
    assert dsa.cell_flops(dsa.Cell("indexer", "fwd", **cell)) == index_fwd
    assert dsa.cell_flops(dsa.Cell("indexer", "fwd_bwd", **cell)) == index_fwd + index_bwd
    loss = _counted(lambda: torch.einsum("thd,tkd->thk", q, kv[idx]))
    assert dsa.cell_flops(dsa.Cell("indexer_loss", "fwd", **cell)) == loss
    assert dsa.cell_flops(dsa.Cell("indexer_loss", "fwd_bwd", **cell)) == loss  # elementwise bwd
    assert dsa.cell_flops(dsa.Cell("dsa_attention", "fwd_bwd", **cell)) == (
        dense * pairs // (T * T) + index_fwd + index_bwd + loss + forward + backward
        + 2 * T * H * k * D)
    assert dsa.tflops(2e12, 1000.0) == 2.0 and dsa.tflops(1, None) is None
    assert dsa.valid_slots(T, k) == sum(min(t + 1, k) for t in range(T))
    assert dsa.valid_slots(3, 5) == 6


def test_cells_cover_the_issue():
    cells = dsa.all_cells()
    ids = [c.id for c in cells]
    assert len(ids) == len(set(ids))
    mla = [c for c in cells if c.op == "sparse_mla"]
    assert {(c.T, c.H, c.mode) for c in mla} == {(T, H, m) for T in (8192, 16384, 32768)
                                                 for H in (128, 64, 16) for m in dsa.MODES}
    assert {(c.k, c.D_qk, c.d_v) for c in mla} == {(2048, 576, 512)}
    (topk,) = [c for c in cells if c.op == "indexer_topk"]
    assert (topk.T, topk.H_idx, topk.D_idx, topk.k) == (8192, 64, 128, 2048)
    assert topk.id == "indexer_topk/fwd/T8192-Hi64-Di128-k2048"
    assert {(c.op, c.mode) for c in cells} == set(dsa.OPS)
    assert {c.T for c in cells if c.op == "indexer_loss"} == {8192, 16384, 32768}
    tiny = dsa.all_cells(shrink=True)
    assert len({c.id for c in tiny}) == len(cells)
    quick = dsa.all_cells(quick=True)
    assert {c.T for c in quick} == {8192} and {c.H for c in quick if c.op == "sparse_mla"} == {128}
    assert [c.id for c in dsa.select(cells, "^sparse_mla/bwd/T8192")] == [
        "sparse_mla/bwd/T8192-H128-k2048-D576-V512", "sparse_mla/bwd/T8192-H64-k2048-D576-V512",
        "sparse_mla/bwd/T8192-H16-k2048-D576-V512"]


def test_random_indices_follow_the_top_k_layout():
    T, k = 150, 32
    idx = dsa.random_indices(T, k, torch.Generator().manual_seed(0), "cpu", block=64)
    assert idx.dtype == torch.int32 and idx.shape == (T, k)
    for t in range(T):
        row = idx[t][idx[t] >= 0].tolist()
        assert len(row) == min(t + 1, k) and row == sorted(set(row)) and row[-1] <= t
        assert (idx[t, len(row):] == -1).all()
    assert int((idx >= 0).sum()) == dsa.valid_slots(T, k)
    validation.check_indices(idx, T, idx.device, None)  # the public functions' checks pass
    again = dsa.random_indices(T, k, torch.Generator().manual_seed(0), "cpu", block=64)
    assert torch.equal(idx, again)


def test_kernel_probe_sees_a_fallback(monkeypatch):
    cell = dsa.Cell("sparse_mla", "fwd_bwd", 16, H=2, k=8, D_qk=64, d_v=64)
    x = dsa.make_inputs(cell, "cpu")
    original = sparse_mla_ops.sparse_mla_fwd_reference
    monkeypatch.setenv(dsa.PYTORCH_ONLY, "1")  # the CUDA function then takes the PyTorch kernel
    with dsa.KernelProbe(cell.ops) as probe:
        sparse_mla_ops.sparse_mla_fwd_cuda(x["q"], x["kv"], x["indices"], x["scale"], 64)
    assert sparse_mla_ops.sparse_mla_fwd_reference is original  # put back
    assert probe.calls == {"sparse_mla_fwd": 1, "sparse_mla_bwd": 0}
    assert probe.kernels("cuda") == {"sparse_mla_fwd": "pytorch", "sparse_mla_bwd": "tilelang"}
    assert probe.kernels("cpu") == {"sparse_mla_fwd": "pytorch", "sparse_mla_bwd": "pytorch"}
    # an op without a CUDA kernel ran its PyTorch kernel, counted or not
    monkeypatch.setattr(dsa, "has_cuda_kernel", lambda op: op != "sparse_mla_bwd")
    assert probe.kernels("cuda") == {"sparse_mla_fwd": "pytorch", "sparse_mla_bwd": "pytorch"}


def test_smoke_run_on_cpu_and_resume(tmp_path, capsys, monkeypatch):
    for name in (*dsa.KERNEL_SWITCHES, dsa.PYTORCH_ONLY):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "cpu-dsa.json"
    argv = ["--device", "cpu", "--quick", "--out", str(out), "--reps", "1",
            "--cells", "sparse_mla/f|indexer_topk|indexer_loss/fwd_bwd|dsa_attention"]
    assert dsa.main(argv) == 0
    records = report.load(out)
    assert [r["cell"] for r in records] == [
        "sparse_mla/fwd/T128-H8-k64-D576-V512", "sparse_mla/fwd_bwd/T128-H8-k64-D576-V512",
        "indexer_topk/fwd/T128-Hi64-Di128-k64", "indexer_loss/fwd_bwd/T128-H8-k64-D576",
        "dsa_attention/fwd_bwd/T128-H8-k64-D576-V512-Hi64-Di128"]
    for r in records:
        assert set(dsa.REQUIRED) <= set(r) and not any(k.endswith("_error") for k in r)
        assert r["torch_dplr_ms"] > 0 and r["pytorch_ms"] > 0 and r["flops"] == dsa.cell_flops(
            dsa.Cell(**{f: r[f] for f in ("op", "mode", "T", "H", "k", "D_qk", "d_v", "H_idx", "D_idx")}))
        assert r["torch_dplr_tflops"] == dsa.tflops(r["flops"], r["torch_dplr_ms"])
        assert r["ratio_pytorch"] == round(r["pytorch_ms"] / r["torch_dplr_ms"], 3)
        assert set(r["torch_dplr_kernels"]) == set(dsa.OPS[(r["op"], r["mode"])])
        assert set(r["torch_dplr_kernels"].values()) == {"pytorch"}  # no GPU
        assert r["tilelang_example_ms"] is None and r["ratio_tilelang_example"] is None
        assert r["tilelang_example_skipped"] == "TileLang's example kernels need CUDA"
        # no switch set
        assert r["device"] == "cpu" and r["switches"] == dict.fromkeys(
            (*dsa.KERNEL_SWITCHES, dsa.PYTORCH_ONLY))
        assert r["dtype"] == "bf16"
    assert records[0]["valid_fraction"] == round(dsa.valid_slots(128, 64) / (128 * 64), 4)
    assert records[2]["valid_fraction"] is None
    md = (tmp_path / "cpu-dsa.md").read_text()
    assert "## Targets" in md and "## Sparse MLA" in md and "## KL loss" in md
    assert md.count("\n| `") == len(records)
    assert "| 5 | TileLang's example kernels need CUDA |" in md
    lines = out.read_text().splitlines()
    assert dsa.main(argv + ["--resume"]) == 0
    assert out.read_text().splitlines() == lines  # every cell done: nothing measured again
    capsys.readouterr()
    assert dsa.main(["--device", "cpu", "--list", "--cells", "^indexer/"]) == 0
    assert capsys.readouterr().out.split() == ["indexer/fwd/T128-Hi64-Di128-k64",
                                               "indexer/fwd_bwd/T128-Hi64-Di128-k64"]
    assert dsa.output_path(tmp_path, torch.device("cpu")) == out
    assert dsa.output_path(None, torch.device("cpu")).name == "cpu-dsa.json"


def _synthetic(cell, **fields):
    record = {**cell.fields(), "flops": dsa.cell_flops(cell), "device": "NVIDIA H200",
              "torch_dplr_kernels": {op: "tilelang" for op in cell.ops}, **fields}
    return dsa.summarize(record)


def test_markdown_targets_from_synthetic_records(tmp_path):
    fwd = [dsa.Cell("sparse_mla", "fwd", T) for T in dsa.SEQ_TOKENS]
    records = [_synthetic(c, torch_dplr_ms=c.T / 8192 * 1.1) for c in fwd]
    bwd = dsa.Cell("sparse_mla", "bwd", 8192)
    records.append(_synthetic(bwd, torch_dplr_ms=2.0, torch_dplr_pytorch_ops=["sparse_mla_bwd"]))
    records.append(_synthetic(dsa.Cell("sparse_mla", "fwd", 8192, H=16), torch_dplr_ms=1.0))
    topk = dsa.Cell("indexer_topk", "fwd", 8192)
    records.append(_synthetic(topk, torch_dplr_ms=2.0, pytorch_ms=12.0, pytorch_capped="one call"))
    loss = [dsa.Cell("indexer_loss", "fwd_bwd", T) for T in (8192, 32768)]
    records += [_synthetic(c, torch_dplr_ms=1.0, torch_dplr_peak_mb=c.T * 2048 * 4 * 3 / 1e6)
                for c in loss]
    records.append(_synthetic(dsa.Cell("indexer", "fwd", 8192), torch_dplr_ms=1.0,
                              tilelang_example_refusal=dsa_peers.NO_KERNEL["indexer"]))
    path = tmp_path / "h200-dsa.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    md = dsa.write_report(path).read_text()
    mla_fwd = dsa.sparse_mla_flops(8192, 128, 2048, 576, 512, "fwd") / (1.1 * 1e9)
    assert f"| sparse MLA forward >= 550 TFLOPS (H 128, k 2048) | T8192 {mla_fwd:.0f}, " in md
    assert md.count("| sparse MLA forward >= 550 TFLOPS") == 1  # H 16 is not judged
    assert f"{'yes' if mla_fwd >= 550 else '**no**'} |" in md.split("forward >= 550")[1].split("\n")[0]
    bwd_tflops = dsa.sparse_mla_flops(8192, 128, 2048, 576, 512, "bwd") / (2.0 * 1e9)
    assert (f"| sparse MLA backward >= 230 TFLOPS (H 128, k 2048) | T8192 {bwd_tflops:.0f} "
            f"(PyTorch kernel ran: sparse_mla_bwd) | yes |") in md
    assert ("| indexer top-k >= 5x the PyTorch kernel (T 8192, H_idx 64, D_idx 128) "
            "| 6.00x (2.000 vs 12.000 ms) | yes |") in md
    assert "| T8192 201 MB = 3.00, T32768 805 MB = 3.00 | yes |" in md
    assert "| 12.000* |" in md  # timed once over the cap
    assert f"| 1 | {dsa_peers.NO_KERNEL['indexer']} |" in md
    records[-2]["torch_dplr_peak_mb"] = 32768 ** 2 * 4 / 1e6  # a [T, T] fp32: not O(T·k)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "T32768 4295 MB = 16.00 | **no** |" in dsa.write_report(path).read_text()
    (tmp_path / "h200-dsa-notes.md").write_text("## Why\n\nreasons\n")
    assert dsa.write_report(path).read_text().endswith("## Why\n\nreasons\n")


# --- the TileLang examples, through a stand-in with their signatures and layouts ---------

STAND_IN = {
    "utils.py": """
        import torch

        def per_custom_dims_cast_to_fp8(x, dims, use_ue8m0):
            return x.to(torch.float8_e4m3fn), torch.ones(x.shape[0])
    """,
    "sparse_mla_fwd.py": """
        import math
        import torch
        from utils import per_custom_dims_cast_to_fp8  # the examples import their utils so

        def _attention(q, kv, indices, sm_scale, d_v):
            S = q.shape[1]
            idx = indices[0, :, 0].long()
            keys = kv[0, :, 0][idx]                      # the empty slots' row must exist
            counted = idx <= torch.arange(S)[:, None]
            logits = torch.einsum("shd,skd->shk", q[0], keys) * sm_scale
            logits = logits.masked_fill(~counted[:, None], float("-inf"))
            o = torch.einsum("shk,skd->shd", logits.softmax(-1), keys[..., :d_v])
            return o, logits.logsumexp(-1)

        def sparse_mla_fwd_interface(q, kv, indices, sm_scale=None, return_p_sum=False, d_v=512,
                                     block_I=64, num_stages=2, threads=256):
            o, lse = _attention(q.float(), kv.float(), indices, sm_scale, d_v)
            return o[None].to(q.dtype), (lse / math.log(2))[None]   # base 2
    """,
    "sparse_mla_bwd.py": """
        import torch
        from sparse_mla_fwd import _attention

        def sparse_mla_bwd(q, kv, o, do, indices, lse, sm_scale=None, is_casual=True,
                           return_kernel=False, delta=None):
            q32 = q.float().requires_grad_()
            kv32 = kv.float().requires_grad_()
            with torch.enable_grad():
                out, _ = _attention(q32, kv32, indices, sm_scale, do.shape[-1])
                dq, dkv = torch.autograd.grad(out, (q32, kv32), do[0].float())
            return dq.to(q.dtype), dkv.to(kv.dtype)
    """,
    "fp8_lighting_indexer.py": """
        import torch

        def mqa_attn_return_logits_interface(q, kv, kv_scales, weights, cu_seqlen_ks,
                                             cu_seqlen_ke, clean_logits=True):
            per_head = torch.einsum("shd,nd->shn", q.float(), kv.float()).relu()
            logits = (per_head * weights[..., None]).sum(1) * kv_scales[None]
            n = torch.arange(kv.shape[0])[None]
            seen = (n >= cu_seqlen_ks[:, None]) & (n < cu_seqlen_ke[:, None])
            return logits.masked_fill(~seen, float("-inf"))
    """,
    "topk_selector.py": """
        import torch

        def tl_topk(input, starts, ends, topk):
            return input.topk(topk, dim=-1).indices.flip(-1).to(torch.int32)   # in no order
    """,
}


@pytest.fixture
def stand_in(tmp_path):
    folder = tmp_path / "examples" / "deepseek_v32"
    folder.mkdir(parents=True)
    for name, text in STAND_IN.items():
        (folder / name).write_text(textwrap.dedent(text))
    (folder / "COMMIT").write_text("github.com/tile-ai/tilelang 0123456789abcdef examples/deepseek_v32\n")
    return tmp_path


def test_examples_load_from_a_checkout_and_leave_short_names_alone(stand_in, monkeypatch):
    sentinel = object()
    monkeypatch.setitem(sys.modules, "utils", sentinel)
    peer = dsa_peers.TileLangExamples.load(stand_in, require_cuda=False)
    assert peer.version == "0123456789ab" and set(peer.modules) == set(dsa_peers.MODULES)
    assert sys.modules["utils"] is sentinel and "sparse_mla_fwd" not in sys.modules


def test_layouts_into_the_examples():
    T, H, D, k = 6, 2, 8, 4
    q, kv = torch.randn(T, H, D), torch.randn(T, D)
    idx = dsa.random_indices(T, k, torch.Generator().manual_seed(1), "cpu")
    q4, kv4, idx4 = dsa_peers.mla_to_peer(q, kv, idx)
    assert q4.shape == (1, T, H, D) and kv4.shape == (1, T + 1, 1, D) and idx4.shape == (1, T, 1, k)
    assert all(x.is_contiguous() for x in (q4, kv4, idx4)) and idx4.dtype == torch.int32
    assert torch.equal(kv4[0, :T, 0], kv) and not kv4[0, T].any()  # the empty slots' zero row
    assert torch.equal(idx4[0, :, 0], torch.where(idx >= 0, idx, T))
    lse = torch.randn(T, H)
    assert torch.allclose(dsa_peers.lse_from_peer(dsa_peers.lse_to_peer(lse)), lse)
    assert torch.allclose(dsa_peers.lse_to_peer(lse)[0], lse / torch.log(torch.tensor(2.0)))
    ks, ke = dsa_peers.key_ranges(5, torch.tensor([0, 2, 4]), "cpu")
    assert ks.tolist() == [0, 0, 2, 2, 5] and ke.tolist() == [1, 2, 3, 4, 5]  # the last: padding


def test_examples_against_our_ops(stand_in):
    peer = dsa_peers.TileLangExamples.load(stand_in, require_cuda=False)
    timer = Timer("cpu", reps=1, warmup=0)
    options = dsa.parse_args(["--device", "cpu"])
    for mode in dsa.MODES:
        cell = dsa.Cell("sparse_mla", mode, 96, H=2, k=64)
        record = dsa.measure_cell(cell, dsa.make_inputs(cell, "cpu"), timer, peer, {}, {}, options)
        assert not any(k.endswith("_error") for k in record), record
        assert record["tilelang_example_ms"] > 0 and record["ratio_tilelang_example"] is not None
        assert record["tilelang_example_tflops"] == dsa.tflops(record["flops"], record["tilelang_example_ms"])
        diffs = record.get("diff_vs_tilelang_example")
        if mode == "fwd_bwd":
            assert diffs is None
        else:  # the same attention, rounded once to bf16 either way
            assert set(diffs) == ({"o", "lse"} if mode == "fwd" else {"dq", "dkv"})
            assert max(diffs.values()) < 1e-2, diffs
    # top-k: integer inputs are exact in e4m3, so only the selection rule is compared
    cell = dsa.Cell("indexer_topk", "fwd", 128, k=64, H_idx=4, D_idx=16)
    x = dsa.make_inputs(cell, "cpu")
    gen = torch.Generator().manual_seed(2)
    x.update(q_idx=torch.randint(-4, 5, x["q_idx"].shape, generator=gen).bfloat16(),
             k_idx=torch.randint(-4, 5, x["k_idx"].shape, generator=gen).bfloat16())
    record = dsa.measure_cell(cell, x, timer, peer, {}, {}, options)
    assert record["tilelang_example_ms"] > 0
    assert record["diff_vs_tilelang_example"]["selection_overlap"] >= 0.99
    # cells the examples have no kernel for
    cell = dsa.Cell("indexer_loss", "fwd", 96, H=2, k=64)
    record = dsa.measure_cell(cell, dsa.make_inputs(cell, "cpu"), timer, peer, {}, {}, options)
    assert record["tilelang_example_refusal"] == dsa_peers.NO_KERNEL["indexer_loss"]
    assert record["tilelang_example_ms"] is None


def test_without_the_examples(stand_in, tmp_path, monkeypatch):
    monkeypatch.delenv(dsa_peers.ENV, raising=False)
    cuda = torch.device("cuda")
    assert dsa_peers.load(torch.device("cpu")) == (
        None, {"tilelang_example_skipped": "TileLang's example kernels need CUDA"})
    assert dsa_peers.load(cuda, "--no-examples") == (None, {"tilelang_example_skipped": "--no-examples"})
    peer, absent = dsa_peers.load(cuda)
    assert peer is None and "not set" in absent["tilelang_example_skipped"]
    monkeypatch.setenv(dsa_peers.ENV, str(tmp_path / "empty"))
    peer, absent = dsa_peers.load(cuda)
    assert peer is None and "holds neither" in absent["tilelang_example_error"]
    (stand_in / "examples" / "deepseek_v32" / "topk_selector.py").write_text("raise ValueError('x')\n")
    with pytest.raises(ImportError, match="topk_selector.py does not import: ValueError"):
        dsa_peers.TileLangExamples.load(stand_in, require_cuda=False)


def test_cells_the_examples_refuse():
    ok = dsa.Cell("sparse_mla", "bwd", 8192, H=16)
    assert dsa_peers.refusal(ok) is None
    assert dsa_peers.refusal(dsa.Cell("indexer_topk", "fwd", 8192)) is None
    assert "bf16 only" in dsa_peers.refusal(ok, torch.float16)
    assert "576 and 512 only" in dsa_peers.refusal(dsa.Cell("sparse_mla", "fwd", 64, D_qk=192, d_v=128))
    assert "multiple of 64" in dsa_peers.refusal(dsa.Cell("sparse_mla", "fwd", 64, k=100))
    assert "H 96" in dsa_peers.refusal(dsa.Cell("sparse_mla", "fwd", 64, H=96))
    assert "divide 128" in dsa_peers.refusal(dsa.Cell("indexer_topk", "fwd", 64, H_idx=48))
    assert "GB" in dsa_peers.refusal(dsa.Cell("indexer_topk", "fwd", 131072))
    for op in dsa_peers.NO_KERNEL:
        assert dsa_peers.refusal(dsa.Cell(op, "fwd_bwd", 64)) == dsa_peers.NO_KERNEL[op]


def test_preamble_names_each_commit_and_switch_set():
    """Records of two runs (other commits, other switches): the preamble names each with its
    ops; records of one run name it once."""
    mla = _synthetic(dsa.Cell("sparse_mla", "fwd", 8192), torch_dplr_ms=20.0, git="aaaaaaa",
                     switches={"TORCH_DPLR_DSA_TILELANG_BWD": None})
    loss = _synthetic(dsa.Cell("indexer_loss", "fwd", 8192), torch_dplr_ms=7.0, git="bbbbbbb",
                      switches={"TORCH_DPLR_DSA_TILELANG_LOSS": "0"})
    head = dsa.markdown([mla, loss]).splitlines()[2]
    assert "git aaaaaaa (sparse_mla); bbbbbbb (indexer_loss)" in head
    assert "no kernel switch set (sparse_mla); `TORCH_DPLR_DSA_TILELANG_LOSS=0` (indexer_loss)" in head
    head = dsa.markdown([mla]).splitlines()[2]
    assert "(git aaaaaaa)" in head and "; no kernel switch set." in head
