"""bf16 rounding that means the same on a GPU and in Triton's CPU interpreter.

The GPU converts fp32 to bf16 by rounding to nearest (ties to even); Triton's interpreter truncates (checked on
Triton 3.9: identical to clearing the low 16 bits), which doubles the error of every bf16 rounding the CPU suite
sees. Kernels that round call these helpers instead of ``.to(tl.bfloat16)`` where it matters for accuracy tests.
"""

import os

import triton
import triton.language as tl

#: True when kernels run in Triton's interpreter (set before triton is imported, as tests/conftest.py does).
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def round_bf16(b_x, EMULATE: tl.constexpr):
    """fp32 ``x`` rounded to bf16 (to nearest, ties to even). With ``EMULATE`` (the interpreter) the rounding is done
    on the bits and the result kept in fp32 (bf16 values are exact in fp32), since the interpreter's bf16 products
    are not reliable either."""
    if EMULATE:
        bits = b_x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        b_y = bits.to(tl.float32, bitcast=True)
    else:
        b_y = b_x.to(tl.bfloat16)
    return b_y


@triton.jit
def cast_for_store(b_x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` for a store, rounded to nearest for bf16 in the interpreter as on a GPU."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            b_x = round_bf16(b_x.to(tl.float32), True)
    return b_x.to(DTYPE)
