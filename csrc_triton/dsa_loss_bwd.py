"""The backward of the DSA indexer's KL loss (``dsa::indexer_loss_bwd``), one row per program.

    dscores[t, j] = factor · (softmax_j(scores[t, valid]) - p[t, j])   on valid slots (index >= 0)
                    0                                                  on slots of -1

``factor = dloss · coeff / denominator`` is one fp32 number the op forms on the device (the
denominator of a ``"mean"`` loss counts the rows with a valid slot, a reduction over every row
that a program of one row cannot make).  A row is read in blocks of ``BLOCK`` slots three
times, the passes of the PyTorch kernel's softmax (maximum, sum, gradient); nothing but
``dscores`` is written, so the backward allocates its output and nothing of size T·k beside it.

HBM traffic per slot: scores (2 or 4 B) and indices (4 B) read three times (the row's later
passes mostly hit L2), the target (4 B) once, ``dscores`` (the scores' dtype) written once.

Non-finite scores as in the PyTorch kernel: -inf on a valid slot gives it softmax 0; a row whose
valid scores are all -inf has softmax 0 everywhere (``dscores = -factor · p``); an +inf score
gives its slot NaN and every other slot of the row softmax 0; a NaN score makes its row NaN.
"""
import triton
import triton.language as tl

#: Slots a program reads per step (a row of k slots takes ceil(k / BLOCK) steps per pass).
MAX_BLOCK = 1024
# the smallest normal fp32: the PyTorch kernel's floor under a row's sum of exponentials
TINY = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _valid_scores(scores, indices, base, cols, k):
    """(index >= 0, the slot's score in fp32, -inf off the row or on an empty slot)."""
    inside = cols < k
    valid = tl.load(indices + base + cols, mask=inside, other=-1) >= 0
    x = tl.load(scores + base + cols, mask=valid, other=float("-inf")).to(tl.float32)
    return valid, x


@triton.jit
def kl_loss_bwd_kernel(scores, target, indices, factor, dscores, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * k
    lanes = tl.arange(0, BLOCK)
    # pass 1: the row's maximum valid score, 0 when it is not finite (as the PyTorch kernel:
    # an +inf score then makes every other slot's softmax 0 and its own NaN)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for j0 in range(0, k, BLOCK):
        _valid, x = _valid_scores(scores, indices, base, j0 + lanes, k)
        top = tl.maximum(top, x)
    top = tl.max(top, axis=0)
    top = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
    # pass 2: the sum of exponentials (a NaN score makes it NaN)
    total = tl.zeros([BLOCK], tl.float32)
    for j0 in range(0, k, BLOCK):
        _valid, x = _valid_scores(scores, indices, base, j0 + lanes, k)
        total += tl.exp(x - top)
    # a NaN total must reach every slot of the row, not be floored
    inv_total = 1.0 / tl.maximum(tl.sum(total, axis=0), TINY,
                                 propagate_nan=tl.PropagateNan.ALL)
    # pass 3: the gradient
    f = tl.load(factor)
    for j0 in range(0, k, BLOCK):
        cols = j0 + lanes
        valid, x = _valid_scores(scores, indices, base, cols, k)
        p = tl.load(target + base + cols, mask=valid, other=0.0)
        grad = tl.where(valid, (tl.exp(x - top) * inv_total - p) * f, 0.0)
        tl.store(dscores + base + cols, grad.to(dscores.dtype.element_ty), mask=cols < k)


def block_for(k: int) -> int:
    """Slots per step: ``k`` rounded up to a power of two, at most :data:`MAX_BLOCK`."""
    return min(triton.next_power_of_2(max(k, 16)), MAX_BLOCK)


def launch(scores, target, indices, factor, dscores):
    """``dscores [T, k]`` from contiguous ``scores`` (fp32 / bf16 / fp16), fp32 ``target``,
    int32 ``indices`` and the one-element fp32 ``factor``."""
    T, k = scores.shape
    if T == 0 or k == 0:
        return
    kl_loss_bwd_kernel[(T,)](scores, target, indices, factor, dscores, k, BLOCK=block_for(k),
                             num_warps=4)
