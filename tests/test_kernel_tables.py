"""The chunk tables the GPU kernels read (torch_dplr/ops/varlen.py), checked on the CPU."""
import pytest
import torch

from torch_dplr.ops.varlen import (as_one_sequence_list, kernel_tables, packed_sizes, packed_tables,
                                   tables_for, varlen_chunk_tables)


@pytest.mark.parametrize("B,T,C", [(3, 100, 64), (1, 5, 16), (2, 128, 32), (4, 1, 64), (2, 64, 64)])
def test_rect_tables_are_the_varlen_tables_of_the_flattened_batch(B, T, C):
    rect = kernel_tables(torch.empty(0, dtype=torch.int64), B, T, C, "cpu")
    cu = torch.arange(B + 1) * T
    slots = B * -(-T // C)  # the rect per-chunk layout [B, ceil(T/C)] flattened
    start, length, offsets = varlen_chunk_tables(cu, B * T, C, slots)
    assert torch.equal(rect.cu_seqlens, cu.int())
    assert torch.equal(rect.chunk_start, start) and torch.equal(rect.chunk_len, length)
    assert torch.equal(rect.chunk_offsets, offsets)
    assert all(t.dtype == torch.int32 for t in rect)


def test_varlen_tables():
    t = kernel_tables(torch.tensor([0, 5, 70, 200]), 1, 200, 64, "cpu")
    assert t.chunk_start.tolist() == [0, 5, 69, 70, 134, 198]
    assert t.chunk_len.tolist() == [5, 64, 1, 64, 64, 2]
    assert t.chunk_offsets.tolist() == [0, 1, 3, 6]


def test_empty_sequences_and_unused_slots():
    # an empty first sequence owns no slot; the trailing slots of the bound have length 0
    t = kernel_tables(torch.tensor([0, 0, 3, 3]), 1, 3, 16, "cpu")
    assert t.chunk_offsets.tolist() == [0, 0, 1, 1]
    assert t.chunk_len.tolist() == [3, 0, 0]


def test_one_sequence_list_is_a_view():
    x = torch.randn(3, 7, 2, 4)
    y = as_one_sequence_list(x)
    assert y.shape == (1, 21, 2, 4) and y.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("B,T,C,cu", [(3, 100, 64, None), (1, 200, 64, [0, 5, 70, 200]),
                                      (1, 3, 16, [0, 0, 3, 3]), (2, 37, 16, None)])
def test_packed_tables_unpack_to_the_tables(B, T, C, cu):
    """One packed tensor per call (built by the public functions) gives each op the tables it
    would have built itself; without it (a direct op call) the op builds them."""
    cu = torch.empty(0, dtype=torch.int64) if cu is None else torch.tensor(cu)
    packed = packed_tables(cu, B, T, C, "cpu")
    assert packed.dtype == torch.int32 and packed.dim() == 1
    for got, want in zip(tables_for(packed, cu, B, T, C, "cpu"), kernel_tables(cu, B, T, C, "cpu")):
        assert torch.equal(got, want)
        assert got.data_ptr() >= packed.data_ptr()  # views of the packed tensor, no copies
    for got, want in zip(tables_for(None, cu, B, T, C, "cpu"), kernel_tables(cu, B, T, C, "cpu")):
        assert torch.equal(got, want)


def test_packed_tables_of_another_layout_are_refused():
    packed = packed_tables(torch.empty(0, dtype=torch.int64), 2, 100, 64, "cpu")
    with pytest.raises(ValueError, match="tables"):
        tables_for(packed, torch.empty(0, dtype=torch.int64), 2, 100, 32, "cpu")
    with pytest.raises(ValueError, match="tables"):
        tables_for(packed.long(), torch.empty(0, dtype=torch.int64), 2, 100, 64, "cpu")


def test_each_call_gets_tables_of_its_own():
    """Rect tables come from a host copy kept per shape: a call's tensor is a copy of it, so a
    caller writing into one call's tables does not change the next call's; another shape gets
    its own."""
    empty = torch.empty(0, dtype=torch.int64)
    first = packed_tables(empty, 3, 100, 32, "cpu")
    seq = torch.arange(4, dtype=torch.int32)
    start, length, _ = varlen_chunk_tables(seq.long() * 100, 300, 32, 3 * 4)
    assert torch.equal(first, torch.cat([seq * 100, seq * 4, start, length]))
    want = first.clone()
    first.fill_(-1)
    again = packed_tables(empty, 3, 100, 32, "cpu")
    assert torch.equal(again, want) and again.data_ptr() != first.data_ptr()
    other = packed_tables(empty, 2, 100, 32, "cpu")
    assert other.numel() == sum(packed_sizes(empty, 2, 100, 32))
