"""Which TileLang kernel a call selects (torch_dplr/ops/kernels.py), checked without a GPU."""
import itertools
import threading
import warnings

import pytest
import torch

pytest.importorskip("tilelang")

from torch_dplr.ops import kernels  # noqa: E402

CONFIGS = list(itertools.product((16, 32, 64), (64, 128), (torch.bfloat16, torch.float16),
                                 ("fp32", "same"), (float("-inf"), -0.6065, -5.0)))


@pytest.mark.parametrize("C,K,dtype,gate,bound", CONFIGS)
def test_every_selected_kernel_is_a_variant_the_ci_compiles(C, K, dtype, gate, bound):
    gate_dtype = torch.float32 if gate == "fp32" else dtype
    chosen = kernels.pipeline(C, K, K, dtype, gate_dtype, bound)
    stages = ("intra_fwd", "intra_bwd", "wy_fwd", "wy_bwd", "state_fwd", "state_bwd")
    split = ("state_bwd_dh", "state_bwd_grads")  # the small-grid state backward
    # the fused no-grad forward: C = 64, K = 64, centred scheme (RWKV-7's bound, not -5)
    fused = ("fused_fwd",) if (C, K, bound) == (64, 64, -0.6065) else ()
    # a faster intra scheme brings the exact one along, for the chunks past its range: the
    # centred forward at C 16 and 32 for any gates, at C 64 where RWKV-7's bound licenses it;
    # the bounded backward at C 16 and 32 in bf16 for any gates, and where C |bound| log2e / 2
    # fits the operand dtype (bf16: 100, fp16: 8)
    exact = ()
    if C in (16, 32) or bound == -0.6065:
        exact += ("intra_fwd_exact",)
    if dtype == torch.bfloat16 and (C in (16, 32) or bound == -0.6065) or (
            C == 16 and bound == -0.6065):
        exact += ("intra_bwd_exact",)
    assert sorted(chosen) == sorted(stages + split + fused + exact)
    assert (chosen["intra_fwd"][1]["scheme"] == "centred") == ("intra_fwd_exact" in exact)
    assert chosen["intra_bwd"][1]["bounded"] == ("intra_bwd_exact" in exact)
    exact_form = {"intra_fwd": {"scheme": "tiled"}, "intra_bwd": {"bounded": False}}
    for name in exact:  # the same kernel in its exact scheme and redo form
        op = name.removesuffix("_exact")
        factory, config = chosen[op]
        assert chosen[name] == (factory, {**config, **exact_form[op], "redo": True})
    for op, (factory, config) in chosen.items():
        module = __import__(factory.__module__, fromlist=["variants"])
        assert config in list(module.variants()), (op, config)


def test_a_kernel_that_cannot_be_built_falls_back_with_one_warning(monkeypatch):
    class NoCompiler:
        def in_memory(self, factory, **config):
            return False

        def on_disk(self, factory, **config):
            return False

        def build_all(self, *args, **kwargs):
            raise RuntimeError("nvcc not found")

        def build(self, *args, **kwargs):
            raise RuntimeError("nvcc not found")

    monkeypatch.setattr(kernels, "_csrc_tl", lambda: NoCompiler())
    monkeypatch.setattr(kernels, "_kernels", {})
    monkeypatch.setattr(kernels, "_ready", set())
    with pytest.warns(RuntimeWarning, match="nvcc not found"):
        assert kernels.kernel_for("state_fwd", 64, 64, 64, torch.bfloat16) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the answer is remembered: no second warning
        assert kernels.kernel_for("state_fwd", 64, 64, 64, torch.bfloat16) is None


class _Recorder:
    """Stands in for csrc_tl: records each parallel build (kernel names) and what is on disk;
    kernels of the factories in ``failing`` fail to build."""

    def __init__(self, failing=()):
        self.compiled, self.disk, self.failing = [], set(), set(failing)

    def in_memory(self, factory, **config):
        return False

    def on_disk(self, factory, **config):
        return (factory.__name__, tuple(sorted(config.items()))) in self.disk

    def build_all(self, items, **kwargs):
        self.compiled.append(sorted(f.__name__.replace("_kernel", "") for f, _ in items))
        self.disk.update((f.__name__, tuple(sorted(c.items()))) for f, c in items
                            if f.__name__ not in self.failing)
        if any(f.__name__ in self.failing for f, _ in items):
            raise RuntimeError("1 kernel failed to build")

    def build(self, factory, **config):
        if factory.__name__ in self.failing:
            raise RuntimeError("ptxas error")
        return factory.__name__


def _record_builds(monkeypatch, failing=()):
    recorder = _Recorder(failing)
    monkeypatch.setattr(kernels, "_csrc_tl", lambda: recorder)
    for name in ("_kernels", "_group_locks"):
        monkeypatch.setattr(kernels, name, {})
    for name in ("_ready", "_background_started"):
        monkeypatch.setattr(kernels, name, set())
    monkeypatch.setattr(kernels, "_background", [])
    monkeypatch.setattr(kernels, "_seconds_getting_kernels", [0.0])  # waits here are not kernels
    return recorder.compiled


RWKV = (64, 64, 64, torch.bfloat16, torch.float32, -0.6065)
# the six stage kernels and, under RWKV-7's bound, the exact intra kernels
STAGES = sorted(["intra_fwd", "intra_bwd", "wy_fwd", "wy_bwd", "state_fwd", "state_bwd",
                 "intra_fwd", "intra_bwd"])
SPLIT = ["state_bwd_split", "state_bwd_split"]


def test_first_use_compiles_the_stage_kernels_then_the_split_in_the_background(monkeypatch):
    """A training call's first op compiles the six stage kernels at once (not the no-grad fused
    forward, not the small-grid state backward, whose two kernels then compile in a background
    thread), so a later small grid compiles nothing; a WY / state op whose kernel is compiled
    on disk compiles nothing (not its default gate configuration's intra kernels); the fused
    forward compiles alone."""
    compiled = _record_builds(monkeypatch)
    assert kernels.kernel_for("intra_fwd", *RWKV) == "intra_fwd_kernel"
    kernels.wait_for_background_compiles()
    assert compiled == [STAGES, SPLIT]
    # the WY op names the default gates (fp32, no bound): its kernel is on disk already
    assert kernels.kernel_for("wy_fwd", 64, 64, 64, torch.bfloat16) == "wy_fwd_kernel"
    kernels.wait_for_background_compiles()
    assert len(compiled) == 2
    assert kernels.kernel_for("fused_fwd", *RWKV) == "fused_fwd_kernel"
    assert compiled[2:] == [["fused_fwd"]]
    # the small-grid state backward (default gates: on disk since the intra op's call) loads
    # without compiling
    split = "state_bwd_split_kernel"
    assert kernels.kernel_for("state_bwd_dh", 64, 64, 64, torch.bfloat16) == split
    assert kernels.kernel_for("state_bwd_grads", 64, 64, 64, torch.bfloat16) == split
    assert len(compiled) == 3


def test_a_small_grid_during_the_background_compile_waits_for_it(monkeypatch):
    """The split kernels asked for while the background thread compiles them (under the
    default gates, as the state op asks): the op waits for that compile, never starts its own."""
    compiled = _record_builds(monkeypatch)
    release = threading.Event()
    build_all = kernels._csrc_tl().build_all

    def slow_split(items, **kw):
        if any("split" in f.__name__ for f, _ in items):
            assert release.wait(10)
        build_all(items, **kw)

    monkeypatch.setattr(kernels._csrc_tl(), "build_all", slow_split)
    assert kernels.kernel_for("intra_fwd", *RWKV) == "intra_fwd_kernel"
    asker = threading.Thread(target=kernels.kernel_for, args=("state_bwd_dh", 64, 64, 64, torch.bfloat16))
    asker.start()
    asker.join(0.2)
    assert asker.is_alive()  # waiting for the background group
    release.set()
    asker.join(10)
    kernels.wait_for_background_compiles()
    assert compiled == [STAGES, SPLIT]
    assert kernels.kernel_for("state_bwd_dh", 64, 64, 64, torch.bfloat16) == "state_bwd_split_kernel"


def test_an_op_that_does_not_see_the_gates_compiles_no_gate_kernels(monkeypatch):
    """A state op first (a cache without its kernels): it asks under the default gates, so it
    must not compile that configuration's intra kernels, only the gate-independent ones."""
    compiled = _record_builds(monkeypatch)
    assert kernels.kernel_for("state_bwd_dh", 64, 64, 64, torch.bfloat16) == "state_bwd_split_kernel"
    assert kernels.kernel_for("state_bwd", 64, 64, 64, torch.bfloat16) == "state_bwd_kernel"
    kernels.wait_for_background_compiles()
    assert compiled == [SPLIT, sorted(["wy_fwd", "wy_bwd", "state_fwd", "state_bwd"])]


def test_a_split_kernel_that_fails_leaves_the_stage_kernels_and_the_single_backward(monkeypatch):
    compiled = _record_builds(monkeypatch, failing={"state_bwd_split_kernel"})
    assert kernels.kernel_for("intra_fwd", *RWKV) == "intra_fwd_kernel"
    kernels.wait_for_background_compiles()  # the split fails there, quietly
    assert kernels.kernel_for("state_bwd", 64, 64, 64, torch.bfloat16) == "state_bwd_kernel"
    with pytest.warns(RuntimeWarning, match="the single state backward kernel runs"):
        assert kernels.kernel_for("state_bwd_dh", 64, 64, 64, torch.bfloat16) is None
    # asked again under the default gates: (csrc_tl remembers the failure) no gate kernels
    assert all(not set(names) & {"intra_fwd", "intra_bwd"} for names in compiled[1:])


@pytest.mark.parametrize("B,H,N,split", [(8, 32, None, False), (4, 32, None, False),
                                         (2, 8, None, True), (1, 32, None, True),
                                         (1, 33, None, True), (1, 34, None, False),
                                         (1, 32, 8, False), (1, 32, 2, False), (1, 8, 2, True)])
def test_state_backward_splits_on_grids_smaller_than_the_gpu(monkeypatch, B, H, N, split):
    """chunk_state_bwd runs the split kernels on at most SMs/4 (sequence, head) pairs (132 SMs
    here: up to 33 pairs)."""
    from torch_dplr.ops import state

    monkeypatch.setattr(state, "sm_count", lambda index: 132)
    monkeypatch.setattr(state, "device_index", lambda device: 0)
    v = torch.empty(B, 64, H, 64)
    h = torch.empty(B, 1, H, 64, 64)
    cu = torch.empty(0 if N is None else N + 1, dtype=torch.int32)
    assert state._split_backward_pays(v, h, cu) == split


def test_state_backward_split_is_bounded_by_its_dh_buffer(monkeypatch):
    """The split's fp32 dh buffer (h's shape) stays under SPLIT_DH_BYTES_MAX; a longer sequence
    on a small grid runs the single kernel."""
    from torch_dplr.ops import state

    monkeypatch.setattr(state, "sm_count", lambda index: 132)
    monkeypatch.setattr(state, "device_index", lambda device: 0)
    v, cu = torch.empty(1, 64, 32, 64, device="meta"), torch.empty(0, dtype=torch.int32)
    slots = state.SPLIT_DH_BYTES_MAX // (32 * 64 * 64 * 4)  # h [1, slots, 32, 64, 64] fp32
    assert state._split_backward_pays(v, torch.empty(1, slots, 32, 64, 64, device="meta"), cu)
    assert not state._split_backward_pays(v, torch.empty(1, slots + 1, 32, 64, 64, device="meta"), cu)


def test_forbid_pytorch_stages_replaces_and_restores():
    from torch_dplr.ops import wy
    from torch_dplr.testing import forbid_pytorch_stages

    original = wy.chunk_wy_fwd_reference
    with forbid_pytorch_stages():
        with pytest.raises(AssertionError, match="TileLang kernel was not used"):
            wy.chunk_wy_fwd_reference()
    assert wy.chunk_wy_fwd_reference is original


def test_exact_intra_schemes_selects_the_tiled_kernels_without_a_licence():
    from torch_dplr.testing import exact_intra_schemes
    unbounded = (16, 64, 64, torch.bfloat16, torch.float32, float("-inf"))
    licensed = (*unbounded[:5], -0.6065)
    assert kernels.pipeline(*unbounded)["intra_fwd"][1]["scheme"] == "centred"
    with exact_intra_schemes():
        chosen = kernels.pipeline(*unbounded)
        assert chosen["intra_fwd"][1]["scheme"] == "tiled"
        assert not chosen["intra_bwd"][1]["bounded"]
        assert "intra_fwd_exact" not in chosen and "intra_bwd_exact" not in chosen
        assert kernels.pipeline(*licensed)["intra_fwd"][1]["scheme"] == "centred"
    assert kernels.pipeline(*unbounded)["intra_bwd"][1]["bounded"]
