"""TileLang kernel variants lower and compile for sm_90a with nvcc; no GPU needed.

A module's variants are its ``variants()``: every configuration the dispatch can build (chunk
size x head dim x dtype x gate scheme / gate dtype ...). Each module compiles into a fresh
TileLang disk cache, so nvcc really runs, with one process per CPU core (the same path as a
first call on a GPU machine: ``csrc_tl.build_all``); then every compiled kernel is loaded from
that cache and its source checked. About 10-20 s of CPU per kernel.

By default (the CI) a subset is compiled, :func:`ci_subset`: one variant of each *structure*
(the traced TIR with dtype names and numbers erased, so variants that differ only in a dtype or
a constant share one) and every value of every config axis at least once, picked greedily in
``variants()`` order. ``TORCH_DPLR_COMPILE_ALL=1`` compiles every variant, as
``python -m torch_dplr precompile`` does.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import re
import shutil

import pytest

tilelang = pytest.importorskip("tilelang")

def _find_nvcc():
    # where TileLang looks: PATH, then CUDA_HOME / CUDA_PATH, then the default install
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = shutil.which("nvcc")
    return found or next((p for p in (os.path.join(h, "bin", "nvcc") for h in homes if h)
                          if os.path.exists(p)), None)


if _find_nvcc() is None:
    if os.environ.get("CI"):  # the CI machine has nvcc: losing it must not pass silently
        raise RuntimeError("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): the CI compile test cannot run")
    pytest.skip("nvcc not found", allow_module_level=True)

from csrc_tl import compile as tlc  # noqa: E402

from csrc_tl import KERNEL_MODULES as MODULES  # noqa: E402

COMPILE_ALL = os.environ.get("TORCH_DPLR_COMPILE_ALL", "") not in ("", "0")


@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    """An empty TileLang disk cache (spawned compile workers inherit it) and no kernels in memory."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang-cache"))
    tlc.clear_cache()
    yield
    tlc.clear_cache()


def _factory(name):
    module = importlib.import_module(f"csrc_tl.{name}")
    return module, getattr(module, f"{name}_kernel")


def _structure(factory, config):
    """Digest of the traced TIR with dtype names and numbers erased: variants with the same
    digest differ only in a dtype or a constant (tile sizes, loop bounds, thread counts), not
    in the code the factory emits (a Python branch, an unrolled loop, an extra buffer)."""
    text = re.sub(r"bfloat16|float16|float32", "DT", tlc.trace(factory, **config).script())
    text = text.replace(', "DT"', "")  # the printer leaves out a buffer's dtype when it is fp32
    text = re.sub(r"\b\d+(\.\d+)?\b", "N", text)
    return hashlib.sha1(text.encode()).hexdigest()


@functools.cache
def _variants(name):
    """``(config, structure digest)`` for every variant of the module (tracing: ~0.25 s each)."""
    module, factory = _factory(name)
    return [(config, _structure(factory, config)) for config in module.variants()]


@functools.cache
def ci_subset(name):
    """The variants the CI compiles: greedy cover of every structure and every (axis, value),
    each step taking the first variant (``variants()`` order, small sizes first) that covers
    the most still-missing ones. Deterministic; every structurally distinct kernel still goes
    through lowering and nvcc once, and every chunk size, head dim and dtype at least once."""
    variants = _variants(name)
    needs = [{("structure", digest), *config.items()} for config, digest in variants]
    missing = set().union(*needs)
    chosen = []
    while missing:
        best = max(range(len(needs)), key=lambda i: len(needs[i] & missing))
        chosen.append(best)
        missing -= needs[best]
    return [variants[i][0] for i in sorted(chosen)]


@pytest.mark.parametrize("name", MODULES)
def test_variants_compile(cold_cache, name, capsys):
    from tvm import tirx

    module, factory = _factory(name)
    every = list(module.variants())
    assert len({tlc.cache_key(factory, c) for c in every}) == len(every)  # no duplicates
    configs = every if COMPILE_ALL else ci_subset(name)
    lines = []
    tlc.build_all([(factory, c) for c in configs], progress=lines.append, load=False)
    assert all(tlc.on_disk(factory, **c) for c in configs)
    done = [line for line in lines if line.startswith("[")]
    assert len(done) == len(configs) and not any("FAILED" in line for line in done), lines
    for config in configs:  # every kernel loads from the cache the workers filled
        kernel = tlc.build(factory, **config)
        src = kernel.get_kernel_source()
        assert "__global__" in src
        # no TMA descriptors: they would be re-encoded on the host every launch
        assert "CUtensorMap" not in src, config
        # T (and the batch / head / slot counts) are symbolic: one build serves every length
        # (TileLang may rename the dynamic T to T_1 when it parses the kernel)
        names = {str(d) for p in kernel.params for d in p.shape if isinstance(d, tirx.Var)}
        assert any(n == "T" or n.startswith("T_") for n in names), (config, names)


@pytest.mark.parametrize("name", MODULES)
def test_ci_subset_covers_every_axis_value_and_structure(name):
    """No nvcc. A new config axis, or a new value of one, is compiled in CI too; so is every
    structurally distinct variant."""
    variants = _variants(name)
    chosen = ci_subset(name)
    for axis in {axis for config, _ in variants for axis in config}:
        full = {config.get(axis) for config, _ in variants}
        assert full <= {config.get(axis) for config in chosen}, (name, axis)
    by_config = {tuple(sorted(config.items())): digest for config, digest in variants}
    assert {digest for _, digest in variants} == {by_config[tuple(sorted(c.items()))] for c in chosen}


def test_ci_subset_is_a_fraction_of_all():
    """The erasure in ``_structure`` still works (were every variant to look distinct, say
    after a change of TileLang's printer, the CI would compile them all again)."""
    every = sum(len(_variants(name)) for name in MODULES)
    chosen = sum(len(ci_subset(name)) for name in MODULES)
    assert 3 * chosen < every, (chosen, every)


def test_build_all_reports_compile_errors(cold_cache):
    from csrc_tl import wy_fwd

    bad = [(wy_fwd.wy_fwd_kernel, dict(C=48, K=64, V=64, dtype="bfloat16")),
           (wy_fwd.wy_fwd_kernel, dict(C=40, K=64, V=64, dtype="bfloat16"))]
    with pytest.raises(RuntimeError, match="C=48"):
        tlc.build_all(bad, workers=2)


def test_build_rejects_symbolic_config():
    from csrc_tl import wy_fwd

    class FakeSymInt:
        pass

    with pytest.raises(TypeError, match="only plain"):
        tlc.cache_key(wy_fwd.wy_fwd_kernel, dict(C=FakeSymInt(), K=64, V=64, dtype="bfloat16"))
    with pytest.raises(TypeError):  # unknown config names fail loudly too
        tlc.cache_key(wy_fwd.wy_fwd_kernel, dict(C=64, K=64, V=64, dtype="bfloat16", bogus=1))


def test_cache_key_fills_defaults():
    from csrc_tl import wy_fwd

    a = tlc.cache_key(wy_fwd.wy_fwd_kernel, dict(C=64, K=64, V=64, dtype="bfloat16"))
    b = tlc.cache_key(wy_fwd.wy_fwd_kernel, dict(C=64, K=64, V=64, dtype="bfloat16", threads=None))
    assert a == b


@pytest.mark.parametrize("name", MODULES)
def test_bad_config_raises(name):
    module, factory = _factory(name)
    good = next(iter(module.variants()))
    with pytest.raises(ValueError):
        factory(**{**good, "C": 48})
    with pytest.raises(ValueError):
        factory(**{**good, "dtype": "int32"})


def test_a_traced_kernel_is_kept_and_loaded_without_tracing(cold_cache):
    """The TIR of a traced kernel is kept in the disk cache (beside its marker), so the next
    build of it loads the same prim_func instead of running the factory; an unreadable file is
    traced again."""
    from csrc_tl import wy_fwd

    calls = []

    def counting(C, K, V, dtype):
        calls.append(C)
        return wy_fwd.wy_fwd_kernel(C=C, K=K, V=V, dtype=dtype)

    counting.__module__, counting.__qualname__ = wy_fwd.__name__, "counting"
    key = tlc.cache_key(counting, dict(C=16, K=64, V=64, dtype="bfloat16"))
    first = tlc._traced(counting, key)
    again = tlc._traced(counting, key)
    assert len(calls) == 1
    assert again.script(show_meta=True) == first.script(show_meta=True)
    kept = tlc._marker(counting, key) + ".tir.json"
    with open(kept, "w") as f:
        f.write("{not json")
    assert tlc._traced(counting, key).script(show_meta=True) == first.script(show_meta=True)
    assert len(calls) == 2
