"""torch.library.opcheck on every dplr op: schema, autograd registration, fakes, AOT dispatch."""
import pytest
import torch

import torch_dplr  # noqa: F401
from torch_dplr import ops

from op_samples import backward_samples, forward_samples


def _ids(samples):
    return [f"{name}-{i}" for i, (name, _) in enumerate(samples)]


FWD = list(forward_samples())
BWD = list(backward_samples())


def test_every_op_has_samples():
    covered = {name for name, _ in FWD + BWD}
    assert covered == (set(ops.FORWARD_OPS) | set(ops.BACKWARD_OPS) | set(ops.NO_GRAD_OPS)
                       | set(ops.TABLE_OPS))


def test_no_grad_op_refuses_a_backward():
    name, args = next((n, a) for n, a in FWD if n == "chunk_fwd_fused")
    q = args[0].detach().clone().requires_grad_()
    o, _ = torch.ops.dplr.chunk_fwd_fused(q, *args[1:])
    with pytest.raises(RuntimeError, match="no-grad op"):
        o.sum().backward()


@pytest.mark.parametrize("name,args", FWD, ids=_ids(FWD))
def test_forward_op(name, args):
    torch.library.opcheck(getattr(torch.ops.dplr, name).default, args)


@pytest.mark.parametrize("name,args", BWD, ids=_ids(BWD))
def test_backward_op(name, args):
    torch.library.opcheck(getattr(torch.ops.dplr, name).default, args)
