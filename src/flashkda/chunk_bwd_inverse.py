"""``(I + L)^-1`` for the strictly lower-triangular ``L = Diag(beta) Akk`` of every chunk: the UT transform's matrix.

``torch.linalg.solve_triangular`` on tens of thousands of 64x64 systems runs cuBLAS' batched triangular solve,
which does not use tensor cores and is called twice per training step (forward recompute and the transposed solve
in the backward). Here one program per chunk forms the inverse once by forward substitution in registers
(``M_i = e_i - sum_{j<i} L_ij M_j``, row by row, 64 steps over a ``[64, 64]`` tile); the applications
``M [beta k exp(G), beta v]`` and ``M^T dX`` then are plain batched matrix products. With ``beta`` given, the kernel
also scales the rows of ``L`` itself and writes ``M Diag(beta)``, so no ``[.., C, K]`` operand is rescaled in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["unit_lower_inverse", "ut_inverse"]


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


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """``(I + tril(lower, -1))^-1`` for ``[..., C, C]`` fp32 ``lower`` (entries on and above the diagonal ignored).

    Returns:
        ``[..., C, C]`` unit lower-triangular inverse, same dtype.
    """
    assert lower.is_contiguous() and lower.shape[-1] == lower.shape[-2], "need contiguous square blocks"
    C = lower.shape[-1]
    assert C == triton.next_power_of_2(C), f"chunk size must be a power of two, got {C}"
    out = torch.empty_like(lower)
    unit_lower_inverse_kernel[(lower.numel() // (C * C),)](lower, lower, out, out, C=C, HAS_BETA=False, num_warps=4)
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
    unit_lower_inverse_kernel[(akk.numel() // (C * C),)](akk, beta, m, mb, C=C, HAS_BETA=True, num_warps=4)
    return m, mb
