"""Helpers shared by the Triton kernel modules."""
import os

import triton
import triton.language as tl

# Triton's interpreter (CPU, numpy) multiplies bf16 tiles wrongly; under it, products run in
# fp32 (exact for bf16 operands), on the GPU on the tensor cores in the operands' dtype.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def dot(x, y, acc):
    """``acc + x @ y`` (fp32 accumulator ``acc``)."""
    if INTERPRET:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc)
    else:
        return tl.dot(x, y, acc)


@triton.jit
def dot_fp32(x, y, acc):
    """``acc + x @ y`` with fp32 operands multiplied in full fp32 (CUDA cores, not tf32): for
    the small products whose rounding would compound."""
    return tl.dot(x, y, acc, input_precision="ieee")


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype`` to nearest even, as the GPU's conversion does (the
    interpreter truncates to bf16: there the rounding is done on the bits first)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)
