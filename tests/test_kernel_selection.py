"""Which TileLang kernel a call selects (torch_dplr/ops/kernels.py), checked without a GPU."""
import itertools
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
    assert sorted(chosen) == sorted(("intra_fwd", "intra_bwd", "wy_fwd", "wy_bwd", "state_fwd",
                                     "state_bwd"))
    for op, (factory, config) in chosen.items():
        module = __import__(factory.__module__, fromlist=["variants"])
        assert config in list(module.variants()), (op, config)


def test_a_kernel_that_cannot_be_built_falls_back_with_one_warning(monkeypatch):
    class NoCompiler:
        def in_memory(self, factory, **config):
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


def test_forbid_pytorch_stages_replaces_and_restores():
    from torch_dplr.ops import wy
    from torch_dplr.testing import forbid_pytorch_stages

    original = wy.chunk_wy_fwd_reference
    with forbid_pytorch_stages():
        with pytest.raises(AssertionError, match="TileLang kernel was not used"):
            wy.chunk_wy_fwd_reference()
    assert wy.chunk_wy_fwd_reference is original
