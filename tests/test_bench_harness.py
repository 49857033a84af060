"""The benchmark harness on the CPU: envelope, report from synthetic records, tiny cells, the
per-stage breakdown."""
import json
import os
import random
import time

import pytest

import torch

from benchmarks import cells, first_call, harness, inputs, report, stages
from benchmarks.fla_routes import ENV, FLA


def test_envelope_matches_issue_4():
    envelope = cells.envelope()
    shapes = {(c.shape.B, c.shape.T, c.shape.H, c.shape.D, c.shape.N) for c in envelope}
    assert shapes == {(8, 4096, 32, 64, None), (4, 4096, 32, 128, None), (2, 4096, 8, 64, None),
                      (1, 65536, 32, 64, None), (1, 32768, 32, 64, 8), (1, 32768, 32, 64, 64)}
    # 6 shapes x (3 RWKV-7 + 2 unbounded chunk sizes) x 2 states x (fwd + 2 fwd_bwd policies)
    assert len(envelope) == 6 * 5 * 2 * 3 == len({c.id for c in envelope})
    assert {c.chunk_size for c in envelope if c.gates == "unbounded"} == {16, 32}
    assert {c.policy for c in envelope if c.mode == "fwd_bwd"} == {"none", cells.SHIPPED_POLICY}
    assert {c.policy for c in envelope if c.mode == "fwd"} == {"none"}
    assert len({c.id for c in cells.envelope(shrink=True)}) == len(envelope)
    quick = cells.envelope(quick=True)
    assert {c.shape for c in quick} == {cells.DESIGN} and len(quick) == 6


def test_varlen_offsets_split_every_token():
    for N, T in ((8, 32768), (64, 32768), (64, 256)):
        cu = inputs.varlen_offsets(N, T)
        assert cu[0] == 0 and cu[-1] == T and len(cu) == N + 1 and bool((cu.diff() > 0).all())


def test_fla_route_sets_and_restores_the_switch(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with FLA.route("triton"):
        assert os.environ[ENV] == "0"
    with FLA.route("tilelang"):
        assert os.environ[ENV] == "1"
    assert ENV not in os.environ


def _synthetic(cell, rng):
    triton, tilelang = rng.uniform(1, 10), rng.uniform(1, 10)
    fallback = cell.chunk_size == 64
    record = {**cell.fields(), "torch_dplr_ms": rng.uniform(0.5, 5), "fla_triton_ms": triton,
              "fla_tilelang_ms": None if fallback else tilelang, "fla_tilelang_fallback": fallback,
              "torch_dplr_peak_mb": rng.uniform(100, 5000), "fla_triton_peak_mb": 3000.0,
              "fla_tilelang_peak_mb": None if fallback else 2000.0, "device": "NVIDIA H200",
              "fla": "0.6.0", "torch": "2.11", "wind_rwkv": "d1d85d9d0d01"}
    if cell.shape.D == 128:
        record["wind_refusal"] = "head dim 128"
    else:
        record.update(wind_ms=1.6 * record["torch_dplr_ms"], wind_peak_mb=2000.0)
    return harness.summarize(record)


def test_report_from_synthetic_jsonl(tmp_path):
    rng = random.Random(0)
    records = [_synthetic(c, rng) for c in cells.envelope()]
    records.append({"cell": "first_call/x", "mode": "first_call", "B": 8, "T": 4096, "H": 32,
                    "D": 64, "N": None, "chunk_size": 64, "cold_s": 25.0, "warm_s": 3.0,
                    "warm_profile": {"fwd_bwd_s": 4.0, "by_self": [["<launch>", 1.5]],
                                     "by_cumulative": [["step", 4.0], ["backward", 2.5]]}})
    records[0] = dict(records[0], torch_dplr_ms=None, ratio=None, ratio_wind=None,
                      torch_dplr_error="RuntimeError: x")
    path = tmp_path / "h200.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    written = report.write_report(path)
    md = (tmp_path / "h200.md").read_text()
    assert written["md"] == str(tmp_path / "h200.md")
    assert md.count("\n| B") == len(records)  # one row per cell
    assert "## Targets" in md and "→Triton" in md and "## Errors" in md and "RuntimeError: x" in md
    # the wind column: its time, its ratio (none where torch_dplr failed), 'refused' with the reason
    assert "| wind_rwkv ms |" in md and f"| {records[1]['wind_ms']:.3f} | **" in md
    assert md.count("| 1.60x |") == sum(r.get("ratio_wind") == 1.6 for r in records) == 5 * 30 - 1
    assert md.count("| refused |") == sum(r.get("wind_refusal") is not None for r in records) == 30
    assert "## wind_rwkv: cells it does not run" in md and "| 30 | head dim 128 |" in md
    assert "| first call, warm cache <= 2 s | 3.00 s | **no** |" in md
    assert "Where the time goes" not in md  # no stage records
    assert "| `<launch>` | 1.500 | `step` | 4.000 |\n|  | – | `backward` | 2.500 |" in md
    (tmp_path / "h200-notes.md").write_text("## Why the misses\n\nmeasured reasons\n")
    report.write_report(path)
    assert (tmp_path / "h200.md").read_text().endswith("## Why the misses\n\nmeasured reasons\n")
    ratio = records[1]["ratio"]
    assert ratio == round(min(records[1]["fla_triton_ms"], records[1]["fla_tilelang_ms"] or 1e9)
                          / records[1]["torch_dplr_ms"], 3)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "png" not in written
    else:
        assert (tmp_path / "h200.png").stat().st_size > 0


def test_harness_on_tiny_cpu_cells(tmp_path):
    argv = ["--device", "cpu", "--no-fla", "--out", str(tmp_path), "--name", "t", "--reps", "1",
            "--warmup", "0", "--modes", "fwd,fwd_bwd",
            "--cells", r"^B2-T128-H2-D64/c64/rwkv7/state/fwd_bwd/s|^B1-T512-N8-H2-D64/c16/rwkv7/nostate/fwd/"]
    assert harness.main(argv) == 0
    records = report.load(tmp_path / "t.json")
    assert [(r["mode"], r["policy"], r["N"], r["state"]) for r in records] == [
        ("fwd_bwd", cells.SHIPPED_POLICY, None, True), ("fwd", "none", 8, False)]
    for r in records:
        assert set(harness.REQUIRED) <= set(r)
        assert r["torch_dplr_ms"] > 0 and "torch_dplr_error" not in r
        assert r["fla_triton_ms"] is None and r["ratio"] is None and r["fla_skipped"] == "--no-fla"
        # wind_rwkv's columns: null, with the reason
        assert r["wind_ms"] is None and r["wind_peak_mb"] is None and r["ratio_wind"] is None
        assert r["wind_skipped"] == "wind_rwkv needs CUDA" and r["wind_rwkv"] is None
        assert r["device"] == "cpu" and r["gates"] == "rwkv7"
    assert (tmp_path / "t.md").exists()


def test_first_call_record(monkeypatch):
    calls = []

    def fake_run(shape, device, cache_dir, timeout, extra=()):
        calls.append((cache_dir, extra))
        result = {"fwd_bwd_s": 20.0 - 18 * (len(calls) > 1), "fwd_s": 0.1, "new_layout_s": 0.01,
                  "import_s": 1.0}
        if extra:
            result["profile"] = {"by_self": [["launch", 0.5]], "by_cumulative": [["step", 2.4]]}
        return result

    monkeypatch.setattr(harness, "_first_call_run", fake_run)
    record = harness.measure_first_call(cells.DESIGN, torch.device("cpu"), 10, {})
    assert record["mode"] == "first_call" and record["cold_s"] == 20.0 and record["warm_s"] == 2.0
    # the warm runs read the cache the cold run filled; only the third is profiled
    assert calls[0][0] == calls[1][0] == calls[2][0] and [bool(c[1]) for c in calls] == [0, 0, 1]
    assert record["warm_profile"]["by_self"] == [["launch", 0.5]]


def test_first_call_measure_on_cpu():
    result = first_call.measure(cells.Shape(1, 32, 1, 16), 16, "rwkv7", "cpu")
    assert set(result) == {"import_s", "dynamo_import_s", "fwd_bwd_s", "kernels_s", "fwd_s",
                           "new_layout_s"}
    assert result["kernels_s"] <= result["fwd_bwd_s"]  # a part of the first call
    assert all(v >= 0 for v in result.values())
    profiled = first_call.measure(cells.Shape(1, 32, 1, 16), 16, "rwkv7", "cpu", profile_top=5)
    ranks = profiled["profile"]
    assert len(ranks["by_self"]) == len(ranks["by_cumulative"]) == 5
    for ranking in ranks.values():
        seconds = [t for _, t in ranking]
        assert seconds == sorted(seconds, reverse=True) and seconds[0] <= profiled["fwd_bwd_s"] + 0.05
    assert any("step" in where for where, _ in ranks["by_cumulative"])  # the profiled call itself


class FakeFLA:
    """Stands in for FLA on the CPU: torch_dplr's functions, a TileLang backend refusing chunk 64."""

    version = "fake"
    route = staticmethod(FLA.route)

    def __init__(self):
        import torch_dplr
        self.routes_seen = []

        def entry(fn):
            def call(*args, disable_recompute=False, **kwargs):
                self.routes_seen.append((os.environ[ENV], disable_recompute))
                return fn(*args, **kwargs)
            return call
        self.entries = {name: entry(getattr(torch_dplr, name))
                        for name in ("chunk_rwkv7", "chunk_dplr_delta_rule")}

    def tilelang_refusal(self, call_forward):
        return "verifier: chunk 64" if call_forward(lambda *a, **kw: kw["chunk_size"]) == 64 else None


def test_measure_cell_with_both_fla_routes():
    fla = FakeFLA()
    timer = harness.Timer("cpu", reps=1, warmup=0)
    shape = cells.Shape(1, 32, 1, 16)
    inp = inputs.make(shape, "rwkv7", "cpu")
    for chunk, fallback in ((64, True), (16, False)):
        cell = cells.Cell(shape, chunk, "rwkv7", True, "fwd")
        record = harness.measure_cell(cell, inp, inp.leaves(), timer, fla, {}, {"device": "cpu"})
        assert record["fla_tilelang_fallback"] is fallback and record["fla_triton_ms"] > 0
        assert (record["fla_tilelang_ms"] is None) == fallback
        assert record["ratio"] == round(min(record["fla_triton_ms"], record["fla_tilelang_ms"] or 1e9)
                                        / record["torch_dplr_ms"], 3)
        assert record["diff_vs_fla_triton"]["o"] == 0.0 and "final_state" in record["diff_vs_fla_triton"]
    assert {"0", "1"} == {env for env, _ in fla.routes_seen}
    assert not any(keep for _, keep in fla.routes_seen)


def test_like_with_like_fla_settings():
    shape = cells.Shape(1, 32, 1, 16)
    inp = inputs.make(shape, "unbounded", "cpu")

    def keeps(mode, policy):
        return harness.fla_kwargs(cells.Cell(shape, 16, "unbounded", False, mode, policy),
                                  inp)["disable_recompute"]
    assert not keeps("fwd", "none") and keeps("fwd_bwd", "none") and not keeps("fwd_bwd", "save_state")


def test_stage_modes_and_cells():
    assert cells.STAGE not in harness.parse_args([]).modes
    assert cells.STAGE in harness.parse_args(["--quick"]).modes
    assert harness.parse_args(["--stages", "--modes", "fwd"]).modes == ["fwd", cells.STAGE]
    staged = cells.envelope(quick=True, stages=True)
    assert [c.id for c in staged if c.mode == cells.STAGE] == [
        "B8-T4096-H32-D64/c64/rwkv7/nostate/stage", "B8-T4096-H32-D64/c64/rwkv7/state/stage"]


def test_stage_breakdown_on_tiny_cpu_cell():
    shape = cells.Shape(1, 40, 1, 16, N=3)
    cell = cells.Cell(shape, 16, "unbounded", True, cells.STAGE)
    records = stages.measure(cell, inputs.make(shape, "unbounded", "cpu"),
                             harness.Timer("cpu", reps=1, warmup=0), {"device": "cpu"})
    ops = {r["op"]: r for r in records if r["mode"] == "stage"}
    assert list(ops) == list(stages.OPS)
    for r in ops.values():
        assert {"B", "T", "H", "D", "N", "chunk_size", "gates", "state", "op", "ms", "bytes", "gb_s",
                "bw_fraction"} <= set(r) and not any(k.endswith("_error") for k in r)
        assert r["ms"] > 0 and r["bytes"] > 0 and r["gb_s"] >= 0 and r["bw_fraction"] >= 0
        assert (r["N"], r["gates"], r["state"], r["stage_cell"]) == (3, "unbounded", True, cell.id)
    assert ops[stages.KEEP]["bytes"] > ops[stages.NO_KEEP]["bytes"]  # h and v_new
    # the no-grad op: on the CPU it composes the stages; where its fused kernel runs it is the
    # whole forward path
    assert ops[stages.FUSED]["fused_kernel"] is False
    assert stages.path_ops("fwd", True) == (stages.FUSED,)
    assert stages.path_ops("fwd", False) == stages.PATHS["fwd"]
    sums = {r["path"]: r for r in records if r["mode"] == stages.STAGE_SUM}
    assert set(sums) == set(stages.PATHS)
    for path, r in sums.items():
        assert r["stages_ms"] == round(sum(ops[op]["ms"] for op in stages.PATHS[path]), 4)
        assert r["end_to_end_ms"] > 0 and r["glue_ms"] == round(r["end_to_end_ms"] - r["stages_ms"], 4)
        assert 0 < r["io_bytes"] < r["bytes"]
    assert stages.done_stage_cells(records) == {cell.id}
    assert stages.done_stage_cells(records[1:]) == set()  # an op missing: not done


def _synthetic_stages(cell, rng):
    ops = [{**cell.fields(), "cell": f"{cell.id}/{op}", "stage_cell": cell.id, "mode": "stage",
            "op": op, "ms": rng.uniform(0.1, 3), "bytes": rng.randrange(10 ** 8, 10 ** 9)}
           for op in stages.OPS]
    for r in ops:
        r["gb_s"] = r["bytes"] / (r["ms"] * 1e6)
        r["bw_fraction"] = r["gb_s"] / stages.HBM_GB_S
    sums = [{**cell.fields(), "cell": f"{cell.id}/{path}", "stage_cell": cell.id,
             "mode": stages.STAGE_SUM, "path": path, "ops": list(ops_of), "stages_ms": 2.0,
             "end_to_end_ms": 2.5, "glue_ms": 0.5, "bytes": 4.3e9, "gb_s": 2150.0, "io_bytes": 10 ** 9}
            for path, ops_of in stages.PATHS.items()]
    return ops + sums


def test_report_where_the_time_goes(tmp_path):
    rng = random.Random(1)
    envelope = cells.envelope(quick=True, stages=True)
    records = [r for c in envelope if c.mode == cells.STAGE for r in _synthetic_stages(c, rng)]
    records += [_synthetic(c, rng) for c in envelope if c.mode != cells.STAGE]
    path = tmp_path / "h200.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    report.write_report(path)
    md = (tmp_path / "h200.md").read_text()
    assert md.count("## Where the time goes") == 1
    assert md.count("### B8 T4096 H32 D64, chunk 64, rwkv7 gates, with") == 2
    assert md.count("| chunk_state_fwd:nokeep |") == 2 and md.count("| fwd_bwd (") == 2
    assert "| 2.000 | 2.500 | 0.500 | 2150 | 1.000 | 0.233 |" in md
    assert md.count("\n| B") == len(envelope) - 2  # the comparison tables are unchanged


def test_harness_stage_cell_and_resume(tmp_path):
    argv = ["--device", "cpu", "--no-fla", "--out", str(tmp_path), "--name", "s", "--reps", "1",
            "--warmup", "0", "--modes", "stage", "--cells", r"^B2-T128-H2-D64/c16/unbounded/nostate/"]
    assert harness.main(argv) == 0
    lines = (tmp_path / "s.json").read_text().splitlines()
    assert [json.loads(x)["mode"] for x in lines] == ["stage"] * len(stages.OPS) + [stages.STAGE_SUM] * 2
    assert harness.main(argv + ["--resume"]) == 0
    assert (tmp_path / "s.json").read_text().splitlines() == lines  # done: nothing measured again
    assert "## Where the time goes" in (tmp_path / "s.md").read_text()


def test_harness_skips_cells_done_in_other_files(tmp_path):
    cell = r"^B2-T128-H2-D64/c16/unbounded/nostate/fwd/none$"
    argv = ["--device", "cpu", "--no-fla", "--out", str(tmp_path), "--reps", "1", "--warmup", "0",
            "--modes", "fwd,fwd_bwd"]
    assert harness.main(argv + ["--name", "earlier", "--cells", cell]) == 0
    earlier = tmp_path / "earlier.json"
    assert harness.main(argv + ["--name", "later", "--cells", r"^B2-T128-H2-D64/c16/unbounded/nostate/",
                                "--skip-done-in", str(earlier)]) == 0
    done = [json.loads(x)["cell"] for x in earlier.read_text().splitlines()]
    later = [json.loads(x)["cell"] for x in (tmp_path / "later.json").read_text().splitlines()]
    assert len(done) == 1 and later and done[0] not in later  # the other file's cell is not redone
    with pytest.raises(SystemExit):  # a file that is not there is an error, not an empty skip set
        harness.parse_args(argv + ["--skip-done-in", str(tmp_path / "absent.json")])


def test_prewarm_jobs_keep_each_layout_short():
    from benchmarks import prewarm

    envelope = cells.envelope()
    jobs = prewarm.fla_jobs(envelope)
    # one FLA job per kernel set (gate style, chunk size, head dim, heads, state, varlen): the
    # long shape shares the design shape's set and the two varlen layouts share one; stage
    # cells add none
    assert len(jobs) == 4 * 5 * 2
    assert prewarm.fla_jobs(cells.envelope(stages=True)) == jobs
    sets = {prewarm.fla_kernel_set(c.shape, c.gates, c.chunk_size, c.state) for c in envelope}
    assert {prewarm.fla_kernel_set(cells.Shape(j["B"], j["T"], j["H"], j["D"], j["N"]), j["gates"],
                                   j["chunk_size"], j["state"]) for j in jobs} == sets
    heavy = [j["N"] is not None or (j["D"], j["chunk_size"]) == (128, 16) for j in jobs]
    assert heavy == sorted(heavy, reverse=True) and sum(heavy) == 14  # the longest jobs first
    design = [j for j in jobs if (j["D"], j["H"], j["N"]) == (64, 32, None)]
    assert {j["B"] for j in design} == {cells.DESIGN.B}  # the larger grid stands for the set
    for job in jobs:
        full = next(c.shape for c in envelope if (c.shape.B, c.shape.H, c.shape.D, c.shape.N)
                    == (job["B"], job["H"], job["D"], job["N"]))
        assert job["T"] <= full.T and job["T"] % 64 == 0
        if job["N"] is not None:  # every sequence keeps some tokens
            assert job["T"] >= 64 * job["N"]
    # torch_dplr, over the envelope's 6 (chunk size, head dim) pairs and 10 (chunk size, head
    # dim, gate bound) configurations (rwkv7: 3 chunk sizes x 2 head dims, unbounded: 2 x 2):
    # WY forward and backward, state forward and backward and the two split state-backward
    # kernels per pair (both gate styles share them); the two intra kernels of each rwkv7
    # configuration and their two exact kernels in the redo form (the unbounded
    # configurations, chunks 16 and 32, run the same four: the checked centred schemes); the
    # fused forward (chunk 64, D64, rwkv7)
    assert len(prewarm.dplr_items(envelope)) == 6 * 6 + 6 * 2 + 6 * 2 + 1


def test_prewarm_tunes_nothing_it_would_drop():
    import functools

    from benchmarks import prewarm

    class StandInAutotuner:  # Triton 3.2+: do_bench is a cached property (timing on the GPU)
        @functools.cached_property
        def do_bench(self):
            raise AssertionError("the timing benchmarker must not be used")

    class OldAutotuner:  # older Triton: a plain attribute set per instance, left alone
        def __init__(self):
            self.do_bench = "timer"

    assert prewarm.compile_only_autotuning(StandInAutotuner)
    launches = []
    timings = StandInAutotuner().do_bench(lambda: launches.append(1), quantiles=(0.5, 0.2, 0.8))
    assert launches == [1] and timings == [1.0, 1.0, 1.0]  # launched (compiled) once, not timed
    assert StandInAutotuner().do_bench(lambda: launches.append(2)) == 1.0 and launches == [1, 2]
    assert not prewarm.compile_only_autotuning(OldAutotuner) and OldAutotuner().do_bench == "timer"


def test_prewarm_leaves_out_cells_done_elsewhere(tmp_path, monkeypatch):
    from benchmarks import prewarm

    envelope = cells.envelope()
    done, failed = envelope[0], envelope[1]
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"cell": done.id}) + "\n"
                    + json.dumps({"cell": failed.id, "torch_dplr_error": "x"}) + "\n")
    assert harness.done_in([path]) == {done.id} and harness.done_in([]) == set()
    selected = []  # what prewarm.main would compile for: stands in for prewarm.prewarm
    monkeypatch.setattr(prewarm, "prewarm", lambda cells_, **kw: selected.extend(cells_) or 0.0)
    assert prewarm.main(["--skip-done-in", str(path)]) == 0
    every = cells.select(envelope, None, cells.MODES)
    assert done not in selected and failed in selected and len(selected) == len(every) - 1
    with pytest.raises(SystemExit):
        prewarm.main(["--skip-done-in", str(tmp_path / "absent.json")])


def test_prewarm_merges_compiled_kernels_not_autotune_results(tmp_path):
    import shutil

    from benchmarks import prewarm

    shared, private = tmp_path / "shared", tmp_path / "private"
    (shared / "tuned").mkdir(parents=True)
    (shared / "tuned" / "kernel.autotune.json").write_text("{}")
    (shared / "old").mkdir()
    (shared / "old" / "kernel.cubin").write_text("shared")
    prewarm.seed_private_cache(shared, private)
    assert sorted(p.name for p in private.iterdir()) == ["old", "tuned"]
    shutil.rmtree(private / "old")
    (private / "new").mkdir()
    (private / "new" / "kernel.cubin").write_text("compiled")
    (private / "retuned").mkdir()
    (private / "retuned" / "kernel.autotune.json").write_text("{}")  # tuned on a short input
    (private / "old").mkdir()
    (private / "old" / "kernel.cubin").write_text("private")
    assert prewarm.merge_compiled(private, shared) == 1
    assert sorted(p.name for p in shared.iterdir()) == ["new", "old", "tuned"]
    assert (shared / "old" / "kernel.cubin").read_text() == "shared"


def test_prewarm_worker_pool_runs_every_job_and_kills_a_hung_one(tmp_path, monkeypatch):
    import subprocess
    import sys

    from benchmarks import prewarm

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(prewarm, "WORKER_TIMEOUT_S", 3.0)
    started, lines = [], []

    def launch(job, private, log):
        started.append(job["id"])
        (private / f"kernel{job['id']}").mkdir()  # a compiled kernel to merge
        code = "import time; time.sleep(60)" if job["id"] == 2 else f"print('job {job['id']}')"
        with log.open("w") as out:
            return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    jobs = [{"id": i, "B": 1, "T": 64, "H": 1, "D": 64, "N": None, "gates": "rwkv7",
             "chunk_size": 16, "state": False} for i in range(4)]
    gpus = {}

    def launch_recording_gpu(job, private, log):
        gpus[job["id"]] = job.get("gpu")
        return launch(job, private, log)

    prewarm.run_fla_jobs(jobs, workers=2, say=lines.append, launch=launch_recording_gpu,
                         gpus=["0", "1"])
    assert sorted(started) == [0, 1, 2, 3] and len(lines) == 4
    assert gpus == {0: "0", 1: "1", 2: "0", 3: "1"}  # the GPUs in turn
    assert sorted(p.name for p in (tmp_path / "triton").iterdir()) == [f"kernel{i}" for i in range(4)]
    assert any("job 3" in line for line in lines) and any("exit -9" in line for line in lines)


def test_prewarm_stops_its_workers_when_interrupted(tmp_path, monkeypatch):
    import subprocess
    import sys

    from benchmarks import prewarm

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    procs = []

    def launch(job, private, log):
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                      start_new_session=True))
        return procs[-1]

    def interrupted(line):
        raise KeyboardInterrupt

    jobs = [{"id": i, "B": 1, "T": 64, "H": 1, "D": 64, "N": None, "gates": "rwkv7",
             "chunk_size": 16, "state": False} for i in range(3)]
    monkeypatch.setattr(prewarm, "WORKER_TIMEOUT_S", 1.0)  # the first report interrupts
    try:
        prewarm.run_fla_jobs(jobs, workers=3, say=interrupted, launch=launch)
    except KeyboardInterrupt:
        pass
    assert len(procs) == 3 and all(p.poll() is not None for p in procs)  # none left running


def test_shards_split_the_envelope_into_balanced_disjoint_parts():
    envelope = cells.envelope(stages=True)
    parts = [cells.shard(envelope, i, 2) for i in range(2)]
    ids = [[c.id for c in part] for part in parts]
    assert not set(ids[0]) & set(ids[1])
    assert sorted(ids[0] + ids[1]) == sorted(c.id for c in envelope)
    for part in parts:  # original order kept, units whole
        assert [c.id for c in envelope if c in part] == [c.id for c in part]
    units = [{(c.shape, c.gates, c.chunk_size) for c in part} for part in parts]
    assert not units[0] & units[1]
    loads = [sum(cells._weight(c) for c in part) for part in parts]
    assert max(loads) < 1.25 * min(loads)
    with pytest.raises(ValueError, match="shard index"):
        cells.shard(envelope, 2, 2)


def test_harness_shard_option(capsys):
    argv = ["--device", "cpu", "--list", "--modes", "fwd,first_call"]
    assert harness.main(argv) == 0
    every = capsys.readouterr().out.split()
    parts = []
    for i in range(2):
        assert harness.main(argv + ["--shard", f"{i}/2"]) == 0
        parts.append(capsys.readouterr().out.split())
    assert sorted(parts[0] + parts[1]) == sorted(c for c in every if not c.startswith("first_call"))
    with pytest.raises(SystemExit):
        harness.parse_args(["--shard", "2/2"])


def test_other_gpu_processes_counts_only_this_gpu():
    smi = "101, GPU-aaaa-1111\n202, GPU-bbbb-2222\n303, GPU-AAAA-1111\n"
    assert harness.processes_on(smi, "aaaa-1111") == [101, 303]
    assert harness.processes_on(smi, None) == [101, 202, 303]
    assert harness.processes_on("", "aaaa-1111") == []


def test_report_merges_shards_in_envelope_order_and_counts_coverage(tmp_path):
    envelope = [c for c in cells.envelope() if c.mode in cells.MODES]
    picked = envelope[:4] + envelope[-2:]
    records = [{**c.fields(), "torch_dplr_ms": 1.0} for c in picked]
    (tmp_path / "a.json").write_text("".join(json.dumps(r) + "\n" for r in records[::2]))
    (tmp_path / "b.json").write_text("".join(json.dumps(r) + "\n" for r in records[1::2][::-1]))
    out = tmp_path / "all.json"
    assert report.merge([tmp_path / "a.json", tmp_path / "b.json"], out) == len(picked)
    assert [r["cell"] for r in report.load(out)] == [c.id for c in picked]
    line = report.coverage(report.load(out))[-1]
    assert line.startswith(f"Cells measured: {len(picked)} of the envelope's {len(envelope)}.")
    assert "B2-T4096-H8-D64 chunk 16 (12)" in line  # a whole group not measured


def test_reps_are_sized_on_a_steady_call_not_on_the_first():
    """A first call slower than the cap (compiling, autotuning) must not leave the cell with
    one rep: the count comes from the warm-up call after it."""
    calls = []

    def step():
        calls.append(None)
        time.sleep(0.2 if len(calls) == 1 else 0.001)

    m = harness.Timer("cpu", reps=5, warmup=2, cap_s=0.1).measure(step)
    assert m.reps == 5 and m.first_call_s >= 0.2 and m.ms < 50
