"""``(I + L)^-1`` for the strictly lower-triangular ``L = Diag(beta) Akk`` of every chunk: the UT transform's matrix.

``torch.linalg.solve_triangular`` on tens of thousands of 64x64 systems runs cuBLAS' batched triangular solve,
which does not use tensor cores and is called twice per training step (forward recompute and the transposed solve
in the backward). Here one program per chunk forms the inverse once; the applications ``M [beta k exp(G), beta v]``
and ``M^T dX`` then are plain batched matrix products. With ``beta`` given, the kernel also scales the rows of ``L``
itself and writes ``M Diag(beta)``, so no ``[.., C, K]`` operand is rescaled in torch.

For ``C = 64`` the inverse is blocked by 16 (`unit_lower_inverse_kernel_blocked`): each diagonal block is inverted in
product form, ``(I + L_ii)^-1 = (I - L_ii)(I + L_ii^2)(I + L_ii^4)(I + L_ii^8)`` (``L_ii^16 = 0``), and the blocks
below the diagonal by block forward substitution, ``M_ij = -M_ii sum_{j <= k < i} L_ik M_kj``: 40 exact fp32
``[16, 16]`` products and no serial row loop. The row loop it replaces (``M_i = e_i - sum_{j<i} L_ij M_j``, 63 steps
with two cross-thread reductions over a ``[64, 64]`` tile each) took 1.13 ms at B1-T8192-H64 on an H200 (01:41 UTC
round, benchmarks/kda/NOTES.md); other chunk sizes still use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["unit_lower_inverse", "ut_inverse"]

BLOCK = 16


@triton.jit
def unit_lower_inverse_kernel(l, beta, m, mb, C: tl.constexpr, HAS_BETA: tl.constexpr):
    i_b = tl.program_id(0)
    base = i_b.to(tl.int64) * C * C
    o_c = tl.arange(0, C)
    # [C, C]
    b_l = tl.load(l + base + o_c[:, None] * C + o_c[None, :]).to(tl.float32)
    if HAS_BETA:
        # [C]
        b_beta = tl.load(beta + i_b.to(tl.int64) * C + o_c).to(tl.float32)
        b_l = b_l * b_beta[:, None]
    b_l = tl.where(o_c[:, None] > o_c[None, :], b_l, 0.0)
    b_m = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    for i in range(1, C):
        # row i of L, then M_i = e_i - sum_j L_ij M_j (rows j >= i of M do not contribute: L_ij = 0 there)
        b_li = tl.sum(tl.where(o_c[:, None] == i, b_l, 0.0), axis=0)
        b_mi = tl.sum(b_li[:, None] * b_m, axis=0)
        b_m = tl.where(o_c[:, None] == i, b_m - b_mi[None, :], b_m)
    tl.store(m + base + o_c[:, None] * C + o_c[None, :], b_m.to(m.dtype.element_ty))
    if HAS_BETA:
        tl.store(mb + base + o_c[:, None] * C + o_c[None, :], (b_m * b_beta[None, :]).to(mb.dtype.element_ty))


@triton.jit
def _load_l(l, beta, base, base_b, i_r, i_c, C: tl.constexpr, BC: tl.constexpr, HAS_BETA: tl.constexpr):
    """Block (i_r, i_c) of ``L = Diag(beta) l`` as a ``[BC, BC]`` fp32 tile (strictly lower part on the diagonal)."""
    o_i = tl.arange(0, BC)
    # [BC, BC]
    b_l = tl.load(l + base + (i_r * BC + o_i)[:, None] * C + (i_c * BC + o_i)[None, :]).to(tl.float32)
    if HAS_BETA:
        b_l = b_l * tl.load(beta + base_b + i_r * BC + o_i).to(tl.float32)[:, None]
    if i_r == i_c:
        b_l = tl.where(o_i[:, None] > o_i[None, :], b_l, 0.0)
    return b_l


@triton.jit
def _diag_inverse(b_l, BC: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[BC, BC]`` tile (``BC = 16``) in product form, exact fp32 products."""
    o_i = tl.arange(0, BC)
    b_eye = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    b_l2 = tl.dot(b_l, b_l, input_precision="ieee")
    b_l4 = tl.dot(b_l2, b_l2, input_precision="ieee")
    b_l8 = tl.dot(b_l4, b_l4, input_precision="ieee")
    b_m = tl.dot(b_eye - b_l, b_eye + b_l2, input_precision="ieee")
    b_m = tl.dot(b_m, b_eye + b_l4, input_precision="ieee")
    return tl.dot(b_m, b_eye + b_l8, input_precision="ieee")


@triton.jit
def _store_m(m, mb, b_m, beta, base, base_b, i_r, i_c, C: tl.constexpr, BC: tl.constexpr, HAS_BETA: tl.constexpr):
    o_i = tl.arange(0, BC)
    p = base + (i_r * BC + o_i)[:, None] * C + (i_c * BC + o_i)[None, :]
    tl.store(m + p, b_m.to(m.dtype.element_ty))
    if HAS_BETA:
        b_beta = tl.load(beta + base_b + i_c * BC + o_i).to(tl.float32)
        tl.store(mb + p, (b_m * b_beta[None, :]).to(mb.dtype.element_ty))


@triton.jit
def unit_lower_inverse_kernel_blocked(l, beta, m, mb, C: tl.constexpr, BC: tl.constexpr, HAS_BETA: tl.constexpr):
    tl.static_assert(C == 4 * BC, "the blocked inverse is written out for four diagonal blocks")
    i_b = tl.program_id(0)
    base = i_b.to(tl.int64) * C * C
    base_b = i_b.to(tl.int64) * C
    # [BC, BC] inverses of the diagonal blocks
    b_m00 = _diag_inverse(_load_l(l, beta, base, base_b, 0, 0, C, BC, HAS_BETA), BC)
    b_m11 = _diag_inverse(_load_l(l, beta, base, base_b, 1, 1, C, BC, HAS_BETA), BC)
    b_m22 = _diag_inverse(_load_l(l, beta, base, base_b, 2, 2, C, BC, HAS_BETA), BC)
    b_m33 = _diag_inverse(_load_l(l, beta, base, base_b, 3, 3, C, BC, HAS_BETA), BC)
    # first sub-diagonal: M_{i+1,i} = -M_{i+1,i+1} L_{i+1,i} M_ii
    b_l10 = _load_l(l, beta, base, base_b, 1, 0, C, BC, HAS_BETA)
    b_l21 = _load_l(l, beta, base, base_b, 2, 1, C, BC, HAS_BETA)
    b_l32 = _load_l(l, beta, base, base_b, 3, 2, C, BC, HAS_BETA)
    b_m10 = -tl.dot(b_m11, tl.dot(b_l10, b_m00, input_precision="ieee"), input_precision="ieee")
    b_m21 = -tl.dot(b_m22, tl.dot(b_l21, b_m11, input_precision="ieee"), input_precision="ieee")
    b_m32 = -tl.dot(b_m33, tl.dot(b_l32, b_m22, input_precision="ieee"), input_precision="ieee")
    # second and third: M_ij = -M_ii sum_{j <= k < i} L_ik M_kj
    b_s = tl.dot(_load_l(l, beta, base, base_b, 2, 0, C, BC, HAS_BETA), b_m00, input_precision="ieee")
    b_m20 = -tl.dot(b_m22, b_s + tl.dot(b_l21, b_m10, input_precision="ieee"), input_precision="ieee")
    b_s = tl.dot(_load_l(l, beta, base, base_b, 3, 1, C, BC, HAS_BETA), b_m11, input_precision="ieee")
    b_m31 = -tl.dot(b_m33, b_s + tl.dot(b_l32, b_m21, input_precision="ieee"), input_precision="ieee")
    b_s = tl.dot(_load_l(l, beta, base, base_b, 3, 0, C, BC, HAS_BETA), b_m00, input_precision="ieee")
    b_s += tl.dot(_load_l(l, beta, base, base_b, 3, 1, C, BC, HAS_BETA), b_m10, input_precision="ieee")
    b_m30 = -tl.dot(b_m33, b_s + tl.dot(b_l32, b_m20, input_precision="ieee"), input_precision="ieee")

    _store_m(m, mb, b_m00, beta, base, base_b, 0, 0, C, BC, HAS_BETA)
    _store_m(m, mb, b_m10, beta, base, base_b, 1, 0, C, BC, HAS_BETA)
    _store_m(m, mb, b_m11, beta, base, base_b, 1, 1, C, BC, HAS_BETA)
    _store_m(m, mb, b_m20, beta, base, base_b, 2, 0, C, BC, HAS_BETA)
    _store_m(m, mb, b_m21, beta, base, base_b, 2, 1, C, BC, HAS_BETA)
    _store_m(m, mb, b_m22, beta, base, base_b, 2, 2, C, BC, HAS_BETA)
    _store_m(m, mb, b_m30, beta, base, base_b, 3, 0, C, BC, HAS_BETA)
    _store_m(m, mb, b_m31, beta, base, base_b, 3, 1, C, BC, HAS_BETA)
    _store_m(m, mb, b_m32, beta, base, base_b, 3, 2, C, BC, HAS_BETA)
    _store_m(m, mb, b_m33, beta, base, base_b, 3, 3, C, BC, HAS_BETA)
    # blocks above the diagonal are zero
    b_zero = tl.zeros([BC, BC], dtype=tl.float32)
    for i_r in tl.static_range(0, 3):
        for i_c in tl.static_range(i_r + 1, 4):
            _store_m(m, mb, b_zero, beta, base, base_b, i_r, i_c, C, BC, HAS_BETA)


def _launch(lower: torch.Tensor, beta: torch.Tensor | None, m: torch.Tensor, mb: torch.Tensor) -> None:
    C = lower.shape[-1]
    grid = (lower.numel() // (C * C),)
    has_beta = beta is not None
    beta = lower if beta is None else beta
    if C == 4 * BLOCK and BLOCK_INVERSE:
        unit_lower_inverse_kernel_blocked[grid](lower, beta, m, mb, C=C, BC=BLOCK, HAS_BETA=has_beta, num_warps=4)
    else:
        unit_lower_inverse_kernel[grid](lower, beta, m, mb, C=C, HAS_BETA=has_beta, num_warps=4)


#: Use the blocked kernel for C = 64 (0.34 vs 1.13 ms for the row loop at B1-T8192-H64, 04:00 UTC H200 profile).
BLOCK_INVERSE = True


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """``(I + tril(lower, -1))^-1`` for ``[..., C, C]`` fp32 ``lower`` (entries on and above the diagonal ignored).

    Returns:
        ``[..., C, C]`` unit lower-triangular inverse, same dtype.
    """
    assert lower.is_contiguous() and lower.shape[-1] == lower.shape[-2], "need contiguous square blocks"
    C = lower.shape[-1]
    assert C == triton.next_power_of_2(C), f"chunk size must be a power of two, got {C}"
    out = torch.empty_like(lower)
    _launch(lower, None, out, out)
    return out


def ut_inverse(akk: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The UT transform's matrix ``M = (I + Diag(beta) tril(akk, -1))^-1`` and ``M Diag(beta)``.

    Args:
        akk: ``[..., C, C]`` fp32, contiguous (entries on and above the diagonal ignored).
        beta: ``[..., C]`` fp32, contiguous.

    Returns:
        ``(M, M Diag(beta))``, each ``[..., C, C]`` fp32: ``w = (M Diag(beta)) kg`` and ``u = (M Diag(beta)) v``.
    """
    assert akk.is_contiguous() and beta.is_contiguous(), "need contiguous operands"
    C = akk.shape[-1]
    assert akk.shape[-2] == C and beta.shape == akk.shape[:-1], f"akk {tuple(akk.shape)} vs beta {tuple(beta.shape)}"
    assert C == triton.next_power_of_2(C), f"chunk size must be a power of two, got {C}"
    m, mb = torch.empty_like(akk), torch.empty_like(akk)
    _launch(akk, beta, m, mb)
    return m, mb

