"""Bad input raises ValueError/TypeError naming the argument, before any op runs."""
import pytest
import torch

import torch_dplr
from torch_dplr.testing import make_inputs

NAMES = "q k v a b gk".split()


def _args(B=1, T=20, H=2, K=8, V=8, dtype=torch.float32):
    inp = make_inputs(B, T, H, K, V, dtype=dtype)
    return {n: inp[n] for n in NAMES}, inp["initial_state"]


def _call(args, fn=torch_dplr.chunk_dplr_delta_rule, **kw):
    return fn(*(args[n] for n in NAMES), **kw)


@pytest.fixture(autouse=True)
def no_op_runs(monkeypatch):
    """Validation must fail before any dplr op runs: make every op call an error."""
    def boom(*a, **k):
        raise AssertionError("an op ran before validation rejected the input")
    for name in ("chunk_intra_fwd", "chunk_wy_fwd", "chunk_state_fwd", "chunk_fwd_fused",
                 "recurrent_fwd"):
        monkeypatch.setattr(torch.ops.dplr, name, boom, raising=False)
    yield


@pytest.mark.parametrize("name", NAMES)
def test_wrong_shape(name):
    args, _ = _args()
    args[name] = args[name][:, :10]
    with pytest.raises(ValueError, match=name):
        _call(args)


@pytest.mark.parametrize("name", ["k", "v", "a", "b"])
def test_wrong_dtype(name):
    args, _ = _args()
    args[name] = args[name].double()
    with pytest.raises(TypeError, match=name):
        _call(args)


@pytest.mark.parametrize("name", NAMES)
def test_integer_tensor(name):
    args, _ = _args()
    args[name] = args[name].long()
    with pytest.raises(TypeError, match=name):
        _call(args)


def test_not_a_tensor():
    args, _ = _args()
    args["a"] = args["a"].tolist()
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        _call(args)


def test_wrong_rank():
    args, _ = _args()
    args["q"] = args["q"][0]
    with pytest.raises(ValueError, match="q"):
        _call(args)


def test_wrong_device():
    args, _ = _args()
    args["b"] = args["b"].to("meta")
    with pytest.raises(ValueError, match="b is on meta"):
        _call(args)


def test_gate_dtype_may_differ():
    args, _ = _args(dtype=torch.bfloat16)
    args["gk"] = args["gk"].float()
    # (the op call is monkeypatched away: reaching it means validation accepted the input)
    with pytest.raises(AssertionError, match="an op ran"):
        _call(args)


@pytest.mark.parametrize("cu,err,match", [
    (torch.tensor([0.0, 20.0]), TypeError, "cu_seqlens must be an int32 or int64"),
    ([0, 20], TypeError, "cu_seqlens must be a torch.Tensor"),
    (torch.tensor([1, 20]), ValueError, "cu_seqlens must start at 0"),
    (torch.tensor([0, 12, 8, 20]), ValueError, "cu_seqlens must be non-decreasing"),
    (torch.tensor([0, 12, 19]), ValueError, "cu_seqlens must end at the token count"),
    (torch.tensor([[0, 20]]), ValueError, "cu_seqlens must be 1-D"),
    (torch.tensor([0]), ValueError, "cu_seqlens must be 1-D"),
])
def test_bad_cu_seqlens(cu, err, match):
    args, _ = _args()
    with pytest.raises(err, match=match):
        _call(args, cu_seqlens=cu)


def test_bad_cu_seqlens_cpu_copy_is_what_gets_checked():
    args, _ = _args()
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        _call(args, cu_seqlens=torch.tensor([0, 5, 20]), cu_seqlens_cpu=torch.tensor([0, 25, 20]))
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        _call(args, cu_seqlens=torch.tensor([0, 5, 20]), cu_seqlens_cpu=torch.tensor([0, 20]))


def test_varlen_needs_batch_one():
    args, _ = _args(B=2)
    with pytest.raises(ValueError, match="batch size must be 1"):
        _call(args, cu_seqlens=torch.tensor([0, 20]))


@pytest.mark.parametrize("shape", [(2, 2, 8, 8), (1, 2, 8, 7), (1, 3, 8, 8), (2, 8, 8)])
def test_initial_state_shape(shape):
    args, _ = _args()
    with pytest.raises(ValueError, match="initial_state must have shape"):
        _call(args, initial_state=torch.zeros(shape))


def test_initial_state_shape_varlen():
    args, _ = _args()
    with pytest.raises(ValueError, match="initial_state"):
        _call(args, cu_seqlens=torch.tensor([0, 5, 20]), initial_state=torch.zeros(1, 2, 8, 8))


@pytest.mark.parametrize("chunk_size", [8, 128, 48, 0, "64"])
def test_chunk_size(chunk_size):
    args, _ = _args()
    with pytest.raises(ValueError, match="chunk_size"):
        _call(args, chunk_size=chunk_size)


@pytest.mark.parametrize("bound", [0.0, 0.5, float("nan")])
def test_lower_bound_not_negative(bound):
    args, _ = _args()
    with pytest.raises(ValueError, match="lower_bound"):
        _call(args, lower_bound=bound)


def test_bad_scale():
    args, _ = _args()
    with pytest.raises(TypeError, match="scale"):
        _call(args, scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="scale"):
        _call(args, scale=float("inf"))


def test_unknown_kwargs_and_head_first():
    args, _ = _args()
    with pytest.raises(TypeError, match="unexpected keyword"):
        _call(args, chunksize=64)
    with pytest.raises(ValueError, match="head_first"):
        _call(args, head_first=True)


def test_cp_context_must_come_from_build_context():
    args, _ = _args()
    with pytest.raises(TypeError, match="cp_context"):
        _call(args, cp_context=object())


def test_rwkv7_names_its_own_arguments():
    args, _ = _args()
    r, w, k, v, a, b = args["q"], args["gk"][:, :5], args["k"], args["v"], args["a"], args["b"]
    with pytest.raises(ValueError, match="^w must"):
        torch_dplr.chunk_rwkv7(r, w, k, v, a, b)
    with pytest.raises(TypeError, match="r must be a torch.Tensor"):
        torch_dplr.chunk_rwkv7(None, args["gk"], k, v, a, b)


def test_recurrent_validates_too():
    args, _ = _args()
    args["v"] = args["v"][:, :, :1, :]
    with pytest.raises(ValueError, match="v must have shape"):
        _call(args, fn=torch_dplr.fused_recurrent_dplr_delta_rule)
