"""benchmarks.layers' locator of a non-finite output (CPU: a plain module stands in for FLA's
layer)."""
import torch

from benchmarks.layers import first_nonfinite


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))


def test_names_the_first_submodule_that_makes_a_non_finite_output():
    net, x = _net(), torch.randn(2, 4)
    with torch.no_grad():
        net[2].weight[0, 0] = float("inf")
    assert first_nonfinite(net, lambda: net(x)) == "2 (inputs finite: True)"
    assert not net[0]._forward_hooks, "hooks left behind"


def test_a_non_finite_input_is_reported_at_the_first_module():
    net, x = _net(), torch.randn(2, 4)
    x[0, 0] = float("nan")
    assert first_nonfinite(net, lambda: net(x)) == "0 (inputs finite: False)"


def test_finite_run_says_so():
    net = _net()
    assert first_nonfinite(net, lambda: net(torch.randn(2, 4))) == "no submodule (output finite: True)"
