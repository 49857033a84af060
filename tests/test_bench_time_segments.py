"""benchmarks.time_segments on the CPU: shrunk shapes, torch_dplr alone."""
import json

from benchmarks import time_segments


def test_time_segments_records_every_dividing_segment_count(tmp_path):
    out = tmp_path / "segments.jsonl"
    time_segments.main(["--device", "cpu", "--shapes", "B2-T4096-H8-D64", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # tiny(B2 T4096 H8) is T 128: chunk 64 divides it into 1 or 2 segments
    got = {(r["mode"], r["segments"]) for r in records}
    assert got == {(mode, S) for mode in ("fwd", "fwd_bwd") for S in (1, 2)}
    assert all(r["impl"] == "torch_dplr" and r["torch_dplr_ms"] > 0 for r in records)
    assert all(r["cell"].startswith("B2-T128-H1-D64/c64/rwkv7/nostate/") for r in records)
