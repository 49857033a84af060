"""dsa_attention against the dense masked fp64 reference (torch_dplr.dsa.testing): o, lse, the
indexer loss and every gradient (dq, dkv, dq_idx, dk_idx, dw), per input dtype, over packed
layouts with empty and 1-token sequences, a padding tail, topk beyond the visible keys and head
counts that are not powers of two."""
import pytest
import torch

from torch_dplr.dsa.testing import GRAD_NAMES, TOLERANCES, parity_errors

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = {  # name: (T, cu_seqlens, topk)
    "one_sequence": (29, None, 8),
    "packed": (40, [0, 7, 7, 8, 30], 6),       # an empty and a 1-token sequence, 10 padding tokens
    "topk_beyond_visible": (23, [0, 5, 23], 64),
}


def assert_within(errors, dtype):
    tol = TOLERANCES[dtype]
    for name in ("o", "lse", "loss"):
        assert errors[name] <= tol[name], (name, errors[name])
    for name in GRAD_NAMES:
        assert errors["d" + name] <= tol["grad"], ("d" + name, errors["d" + name])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_parity(dtype, layout):
    T, cu, topk = LAYOUTS[layout]
    errors = parity_errors(T, H=3, H_idx=2, topk=topk, cu_seqlens=cu, dtype=dtype)
    assert_within(errors, dtype)
    if dtype == torch.float64:
        assert errors["indices"] == 0  # the selection is the dense rule's


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_parity_sum_reduction_odd_heads(dtype):
    errors = parity_errors(33, H=5, D_qk=20, d_v=12, H_idx=3, D_idx=12, topk=7,
                           cu_seqlens=[0, 1, 2, 33], dtype=dtype, reduction="sum", coeff=1.3)
    assert_within(errors, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_parity_larger(dtype):
    """Rows of up to 160 selected keys over several query blocks of every op: with bf16
    inputs o stays at one bf16 rounding (fp32 accumulation; bf16 sums over 160 terms would
    miss the bar) and lse and the loss at fp32 round-off."""
    errors = parity_errors(288, H=6, D_qk=40, d_v=32, H_idx=4, D_idx=16, topk=160,
                           cu_seqlens=[0, 200, 201, 288], dtype=dtype, seed=3)
    assert_within(errors, dtype)
    if dtype == torch.float64:
        assert errors["indices"] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_parity_deepseek_dims(dtype):
    """DeepSeek-V3.2's absorbed MLA sizes: D_qk = 576 (512 latent + 64 rope), D_v = 512."""
    errors = parity_errors(48, H=2, D_qk=576, d_v=512, H_idx=2, D_idx=32, topk=20,
                           cu_seqlens=[0, 30, 48], dtype=dtype, seed=5)
    assert_within(errors, dtype)
    if dtype == torch.float64:
        assert errors["indices"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_parity_on_cuda(dtype):
    """On a GPU, at dims without a TileLang variant (D_qk 40), the ops run their PyTorch
    kernels: the same bars."""
    errors = parity_errors(288, H=6, D_qk=40, d_v=32, H_idx=4, D_idx=16, topk=160,
                           cu_seqlens=[0, 200, 201, 288], dtype=dtype, seed=3, device="cuda")
    assert_within(errors, dtype)
    if dtype == torch.float64:
        assert errors["indices"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_parity_on_cuda_with_the_tilelang_kernels(dtype, monkeypatch):
    """At D_qk = d_v = 64 the sparse MLA forward and backward run their TileLang kernels on an
    sm_90 GPU (tests/test_tl_dsa_sparse_mla*.py check that they do); the layer's o, lse, loss
    and every gradient keep the same bars."""
    from torch_dplr.dsa.ops import sparse_mla
    monkeypatch.delenv(sparse_mla.BWD_KERNEL_SWITCH, raising=False)  # on by default
    errors = parity_errors(288, H=6, D_qk=64, d_v=64, H_idx=4, D_idx=16, topk=160,
                           cu_seqlens=[0, 200, 201, 288], dtype=dtype, seed=3, device="cuda")
    assert_within(errors, dtype)
