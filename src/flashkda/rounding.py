"""bf16 rounding that means the same on a GPU and in Triton's CPU interpreter, and the mixed-precision products
built on it (`operand_split`, `dot_acc`, the ``PREC_*`` operand precisions) that the state passes share.

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


#: Operand precisions of a mixed-precision product ``a @ x`` (`dot_acc`): the left operand is exact in its stored
#: dtype (or rounded to bf16 for ``HILO``/``BF16``); the right one is fp32 and goes in
#: exactly (``IEEE``), as tf32 (``TF32``, 11 significant bits), as the sum of two bf16 products over its hi/lo split
#: (``HILO``, 16 bits) or rounded to bf16 (``BF16``, 8 bits, fla's choice).
PREC_IEEE, PREC_TF32, PREC_HILO, PREC_BF16 = 0, 1, 2, 3


@triton.jit
def operand_split(b_x, PREC: tl.constexpr, EMULATE: tl.constexpr):
    """The fp32 right operand ``x`` as ``(hi, lo)`` for `dot_acc` (``lo`` only meaningful for ``PREC_HILO``);
    bf16 parts are held as fp32 on the interpreter (``round_bf16``), whose bf16 products are not reliable. One return
    statement: Triton refuses returns of different types even in branches a constexpr rules out."""
    if PREC >= 2:
        b_hi = round_bf16(b_x, EMULATE)
        b_lo = round_bf16(b_x - b_hi.to(tl.float32), EMULATE)
    else:
        b_hi, b_lo = b_x, b_x
    return b_hi, b_lo


@triton.jit
def dot_acc(b_a, b_hi, b_lo, b_acc, PREC: tl.constexpr, EMULATE: tl.constexpr, LEFT: tl.constexpr = True):
    """``acc + a @ x`` with fp32 accumulation, ``x`` given as `operand_split`'s ``(hi, lo)``; ``a`` is rounded to bf16
    for ``PREC_HILO``/``PREC_BF16`` (to nearest, on the interpreter too). ``LEFT=False``: ``acc + x @ a`` instead."""
    if PREC == 0:
        b_acc = _mm_side(b_a.to(tl.float32), b_hi, b_acc, "ieee", LEFT)
    elif PREC == 1:
        b_acc = _mm_side(b_a.to(tl.float32), b_hi, b_acc, "tf32", LEFT)
    elif EMULATE:
        b_ab = round_bf16(b_a.to(tl.float32), True)
        if PREC == 2:
            b_acc = _mm_side(b_ab, b_lo, b_acc, "ieee", LEFT)
        b_acc = _mm_side(b_ab, b_hi, b_acc, "ieee", LEFT)
    else:
        if PREC == 2:
            b_acc = _mm_side(b_a.to(tl.bfloat16), b_lo, b_acc, None, LEFT)
        b_acc = _mm_side(b_a.to(tl.bfloat16), b_hi, b_acc, None, LEFT)
    return b_acc


@triton.jit
def _mm_side(b_a, b_x, b_acc, DOT_PREC: tl.constexpr, LEFT: tl.constexpr):
    if LEFT:
        b_acc = tl.dot(b_a, b_x, b_acc, input_precision=DOT_PREC)
    else:
        b_acc = tl.dot(b_x, b_a, b_acc, input_precision=DOT_PREC)
    return b_acc
