"""benchmarks.pool_precision: the bf16 state pool's error against fp64 stays at one bf16
rounding of the state (it does not grow with the steps), the fp32 pool's at fp32 round-off."""
import json

from benchmarks import pool_precision


def test_bf16_pool_error_stays_bounded(tmp_path):
    out = tmp_path / "precision.jsonl"
    pool_precision.main(["--steps", "256", "--batch", "2", "--heads", "2", "--head-dim", "32",
                         "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == [s for s in pool_precision.REPORT_AT if s <= 256]
    for r in records:
        assert r["fp32_pool_state"] < 1e-5, r
        assert 0 < r["bf16_pool_state"] < 5e-3, r  # bf16 keeps 8 bits: 2^-9 = 2e-3 a rounding
        assert r["bf16_pool_o"] < 5e-3 and r["fp32_pool_o"] < 3e-3, r  # o itself is bf16
