"""Every TileLang kernel lowers and compiles for sm_90a with nvcc; no GPU needed.

Each test builds into a fresh TileLang disk cache, so nvcc really runs (a warm
cache would answer from disk). About 5-13 s per kernel on a 2-core machine:
~95 s for all 12 WY variants, ~35 s for the 4 not marked slow.
"""

from __future__ import annotations

import shutil

import pytest

tilelang = pytest.importorskip("tilelang")

if shutil.which("nvcc") is None:
    pytest.skip("nvcc not on PATH", allow_module_level=True)

from csrc_tl import compile as tlc  # noqa: E402
from csrc_tl import wy_fwd  # noqa: E402


@pytest.fixture(scope="module")
def cold_cache(tmp_path_factory):
    """Point TileLang at an empty disk cache and forget in-memory kernels."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TILELANG_CACHE_DIR", str(tmp_path_factory.mktemp("tilelang-cache")))
    tlc.clear_cache()
    yield
    tlc.clear_cache()
    mp.undo()


def _id(cfg):
    return f"C{cfg['C']}-K{cfg['K']}-V{cfg['V']}-{cfg['dtype']}"


# Every chunk size, head dim and dtype appears at least once in the fast set;
# the other variants (~60 s more on 2 cores) run unless "-m 'not slow'".
_FAST = {(16, 64, "float16"), (32, 128, "bfloat16"), (64, 128, "bfloat16"), (64, 64, "float16")}


def _wy_params():
    for cfg in wy_fwd.variants():
        fast = (cfg["C"], cfg["K"], cfg["dtype"]) in _FAST
        yield pytest.param(cfg, id=_id(cfg), marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("cfg", list(_wy_params()))
def test_wy_fwd_compiles(cold_cache, cfg):
    kernel = tlc.build(wy_fwd.wy_fwd_kernel, **cfg)
    src = kernel.get_kernel_source()
    assert "wy_fwd_kernel" in src
    # no TMA descriptors: they would be re-encoded on the host every launch
    assert "CUtensorMap" not in src
    if cfg["C"] == 64:
        assert "wgmma" in src  # one warpgroup, M = 64: Hopper tensor cores
    else:
        assert "mma_sync" in src
    # B, T, H are symbolic: one build serves every batch, length and head count
    from tvm import tirx

    params = kernel.params
    assert len(params) == 7
    assert all(isinstance(d, tirx.Var) for p in params for d in p.shape[:3])
    # a second build of the same config is the same object (in-memory cache)
    assert tlc.build(wy_fwd.wy_fwd_kernel, **cfg) is kernel


def test_build_rejects_symbolic_config():
    class FakeSymInt:
        pass

    with pytest.raises(TypeError, match="only plain"):
        tlc.cache_key(wy_fwd.wy_fwd_kernel, dict(C=FakeSymInt(), K=64, V=64, dtype="bfloat16"))
    with pytest.raises(TypeError):  # unknown config names fail loudly too
        tlc.cache_key(wy_fwd.wy_fwd_kernel, dict(C=64, K=64, V=64, dtype="bfloat16", bogus=1))


def test_cache_key_fills_defaults():
    a = tlc.cache_key(wy_fwd.wy_fwd_kernel, dict(C=64, K=64, V=64, dtype="bfloat16"))
    b = tlc.cache_key(wy_fwd.wy_fwd_kernel, dict(C=64, K=64, V=64, dtype="bfloat16", threads=None))
    assert a == b


def test_bad_config_raises():
    with pytest.raises(ValueError, match="chunk size"):
        wy_fwd.wy_fwd_kernel(C=48, K=64, V=64, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        wy_fwd.wy_fwd_kernel(C=64, K=64, V=64, dtype="int32")
