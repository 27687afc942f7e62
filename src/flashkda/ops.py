"""Small Triton device functions shared by the FlashKDA kernels: gate activations, L2 norm, beta map."""

import triton
import triton.language as tl

#: Above this, softplus(x) == x in fp32 (the same threshold torch and fla use).
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
#: Added under the square root of the L2 norm, as in fla's ``l2norm_fwd``.
L2NORM_EPS = tl.constexpr(1e-6)


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
        return lower_bound * tl.sigmoid(b_x)
    else:
        return -tl.exp(b_A) * softplus(b_x)


@triton.jit
def l2norm_rows(b_x):
    """Normalise each row of a ``[R, D]`` fp32 block (padded columns must be zero)."""
    return b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + L2NORM_EPS)[:, None]


@triton.jit
def beta_map(b_beta, APPLY_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr):
    if APPLY_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
        if ALLOW_NEG_EIGVAL:
            b_beta = b_beta * 2.0
    return b_beta
