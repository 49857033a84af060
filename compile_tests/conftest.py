"""Fixtures for the torch.compile tests (helpers live in ``_support``)."""
import pytest
import torch

from ._support import GraphRecorder


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
