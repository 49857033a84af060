"""torch.export of the RWKV-7 block: the dplr ops survive as nodes of the exported program,
which runs at lengths other than the example's."""
import pytest
import torch

from ._support import CHUNK_FWD, CHUNK_SIZE, block_input, make_block, op_counts

CHUNK = CHUNK_SIZE  # the block's chunk size


def export_block(block, T_example, T_min):
    T = torch.export.Dim("T", min=T_min, max=4096)
    return torch.export.export(block, (block_input(T=T_example, requires_grad=False),),
                               dynamic_shapes=({1: T},))


def test_export_rwkv7_block_dynamic_length():
    block = make_block()
    program = export_block(block, T_example=40, T_min=CHUNK + 1)
    assert op_counts(program.graph_module) == {op: 1 for op in CHUNK_FWD}
    for T in (CHUNK + 1, 57, 130):
        x = block_input(T=T, seed=T, requires_grad=False)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x), block(x), rtol=1e-5, atol=1e-6)


# Strict on every device: export traces the fakes, which do not depend on the device.
@pytest.mark.xfail(strict=True, raises=torch._dynamo.exc.UserError,
                   reason="torch_dplr limitation (see test_dynamic): a symbolic T cannot span "
                          "T <= chunk_size and T > chunk_size")
def test_export_rwkv7_block_any_length():
    export_block(make_block(), T_example=40, T_min=2)
