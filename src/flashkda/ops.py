"""Small Triton device functions shared by the FlashKDA kernels: gate activations, L2 norm, beta map."""

import triton
import triton.language as tl

from flashkda.rounding import INTERPRET

#: Above this, softplus(x) == x in fp32 (the same threshold torch and fla use).
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
#: Added under the square root of the L2 norm, as in fla's ``l2norm_fwd``.
L2NORM_EPS = tl.constexpr(1e-6)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def fast_exp(x):
    """e^x of an fp32 tile as one ``ex2.approx.ftz`` (a MUFU.EX2 and the scale by log2 e) on the GPU.

    ``tl.exp`` lowers to the same approximation plus a denormal-range fix-up around it (a compare and two multiplies);
    results below 2^-126 flush to zero instead, which no KDA quantity can tell from the exact value. The
    interpreter runs ``tl.exp``.
    """
    if INTERPRET:
        return tl.exp(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2E], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def fast_rcp(x):
    """1 / x of an fp32 tile as one ``rcp.approx.ftz`` (max. 1 ulp) instead of the IEEE division sequence."""
    if INTERPRET:
        return 1.0 / x
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def fast_rsqrt(x):
    """1 / sqrt(x) of an fp32 tile as one ``rsqrt.approx.ftz`` (relative error below 2^-22)."""
    if INTERPRET:
        return 1.0 / tl.sqrt(x)
    return tl.inline_asm_elementwise("rsqrt.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def fast_sigmoid(x):
    """1 / (1 + e^-x) from `fast_exp` and `fast_rcp` (0 and 1 in the limits: rcp(inf) = 0)."""
    return fast_rcp(1.0 + fast_exp(-x))


@triton.jit
def log1p(z):
    """Accurate log(1 + z) for z >= 0 (Goldberg's trick): plain log(1 + z) loses all digits below z ~ 1e-7."""
    u = 1.0 + z
    d = tl.where(u == 1.0, 1.0, u - 1.0)  # no 0/0 in the discarded branch
    return tl.where(u == 1.0, z, tl.log(u) * (z / d))


@triton.jit
def softplus(x):
    """log(1 + e^x) to full fp32 relative precision; gates like softplus(-12) ~ 6e-6 matter for long memory."""
    return tl.where(x > SOFTPLUS_THRESHOLD, x, tl.maximum(x, 0.0) + log1p(tl.exp(-tl.abs(x))))


@triton.jit
def kda_gate(b_g, b_bias, b_A, lower_bound, HAS_A: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """Log-space decay from the raw gate input ``b_g`` (bias already broadcast in ``b_bias``)."""
    b_x = b_g + b_bias
    if USE_LOWER_BOUND:
        if HAS_A:
            b_x = tl.exp(b_A) * b_x
        return lower_bound * fast_sigmoid(b_x)
    else:
        return -tl.exp(b_A) * softplus(b_x)


@triton.jit
def l2norm_rows(b_x):
    """Normalise each row of a ``[R, D]`` fp32 block (padded columns must be zero)."""
    return b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + L2NORM_EPS)[:, None]


@triton.jit
def beta_map(b_beta, APPLY_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr):
    if APPLY_SIGMOID:
        b_beta = fast_sigmoid(b_beta)
        if ALLOW_NEG_EIGVAL:
            b_beta = b_beta * 2.0
    return b_beta
