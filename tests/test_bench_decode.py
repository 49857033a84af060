"""benchmarks.decode's per-token kernel configurations (``--kernel-configs``): parsed strictly,
and a launch inside ``kernel_config`` runs the configuration asked for, then the default again."""
import pytest
import torch

from benchmarks import decode


def test_kernel_configs_parse():
    assert decode.parse_kernel_configs("16x1,32x4,") == [(16, 1), (32, 4)]
    assert decode.parse_kernel_configs("") == []
    for bad in ("32", "32x", "x4", "32*4"):
        with pytest.raises(ValueError, match="BVxWARPS"):
            decode.parse_kernel_configs(bad)


def test_kernel_config_reaches_the_launch_and_is_undone(monkeypatch):
    recurrent = pytest.importorskip("csrc_triton.recurrent")
    grids = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: grids.append((grid, kwargs["BV"], kwargs["num_warps"]))

    monkeypatch.setattr(recurrent, "recurrent_fwd_kernel", Spy())
    B, T, H, D = 3, 1, 2, 64
    tokens = [torch.zeros(B, T, H, D) for _ in range(6)]
    state = torch.zeros(B, H, D, D)

    def launch():
        recurrent.launch(*tokens, state, None, None, torch.empty_like(tokens[2]),
                         torch.empty_like(state), 1.0, True, False, False)

    default = recurrent.config(D, D)
    with decode.kernel_config(16, 2):
        launch()
    with decode.kernel_config(128, 1):  # wider than V: V
        launch()
    launch()
    assert grids == [((D // 16, H, B), 16, 2), ((1, H, B), D, 1),
                     ((D // default[0], H, B), *default)]
