"""Fixtures for the torch.compile tests (helpers and the device / head-size knobs live in
``_support``)."""
import pytest
import torch

from ._support import GraphRecorder, device_unavailable


@pytest.fixture(autouse=True)
def test_device_present():
    """TORCH_DPLR_TEST_DEVICE=cuda without a GPU skips every test here (and only here)."""
    reason = device_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts and ends with empty Dynamo caches, so frame counts are its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def recorder():
    """A graph-recording backend over AOT autograd (no Inductor codegen: fast, exact)."""
    return GraphRecorder()


@pytest.fixture
def inductor_recorder():
    """The same recording, but the graphs are then compiled by Inductor."""
    return GraphRecorder(inductor=True)


@pytest.fixture
def split_pass(monkeypatch):
    """The public chunked calls compose ``dplr::chunk_fwd`` / ``chunk_bwd`` (the two-op training
    pass, ``TORCH_DPLR_TRAINING_PASS=split``) for the whole test: when traced, run and
    recomputed."""
    from torch_dplr.ops.dataflow import TRAINING_PASS_VAR

    monkeypatch.setenv(TRAINING_PASS_VAR, "split")
