"""``(I + L)^-1`` for the strictly lower-triangular ``L = Diag(beta) Akk`` of every chunk: the UT transform's matrix.

``torch.linalg.solve_triangular`` on tens of thousands of 64x64 systems runs cuBLAS' batched triangular solve,
which does not use tensor cores and is called twice per training step (forward recompute and the transposed solve
in the backward). Here one program per chunk forms the inverse once by forward substitution in registers
(``M_i = e_i - sum_{j<i} L_ij M_j``, row by row, 64 steps over a ``[64, 64]`` tile); the applications
``M [beta k exp(G), beta v]`` and ``M^T dX`` then are plain batched matrix products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["unit_lower_inverse"]


@triton.jit
def unit_lower_inverse_kernel(l, m, C: tl.constexpr):
    i_b = tl.program_id(0)
    base = i_b.to(tl.int64) * C * C
    o_c = tl.arange(0, C)
    # [C, C]
    b_l = tl.load(l + base + o_c[:, None] * C + o_c[None, :]).to(tl.float32)
    b_l = tl.where(o_c[:, None] > o_c[None, :], b_l, 0.0)
    b_m = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    for i in range(1, C):
        # row i of L, then M_i = e_i - sum_j L_ij M_j (rows j >= i of M do not contribute: L_ij = 0 there)
        b_li = tl.sum(tl.where(o_c[:, None] == i, b_l, 0.0), axis=0)
        b_mi = tl.sum(b_li[:, None] * b_m, axis=0)
        b_m = tl.where(o_c[:, None] == i, b_m - b_mi[None, :], b_m)
    tl.store(m + base + o_c[:, None] * C + o_c[None, :], b_m.to(m.dtype.element_ty))


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """``(I + tril(lower, -1))^-1`` for ``[..., C, C]`` fp32 ``lower`` (entries on and above the diagonal ignored).

    Returns:
        ``[..., C, C]`` unit lower-triangular inverse, same dtype.
    """
    assert lower.is_contiguous() and lower.shape[-1] == lower.shape[-2], "need contiguous square blocks"
    C = lower.shape[-1]
    assert C == triton.next_power_of_2(C), f"chunk size must be a power of two, got {C}"
    out = torch.empty_like(lower)
    unit_lower_inverse_kernel[(lower.numel() // (C * C),)](lower, out, C=C, num_warps=4)
    return out
