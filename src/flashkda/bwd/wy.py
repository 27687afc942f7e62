"""Backward of the UT transform's element-wise tail, one Triton pass per (chunk, head).

With ``M = (I + Diag(beta) Akk)^-1`` and ``[w, u] = M Diag(beta) [kg, v]``, the cotangents ``dw = -dv_new h^T`` and
``dv_new`` pull back through ``y_u = M^T dv_new`` and ``y_w = M^T dw = -y_u h^T`` (so ``dw`` is never formed), and
``dl = -(y_w w^T + y_u u^T) = -y_u v_new^T`` below the diagonal, because ``v_new = u - w h``. The batched products
``y_u``, ``y_wn = y_u h^T`` and ``P = y_u v_new^T`` stay in torch; this kernel reads them once and writes

* ``dv = beta * y_u`` and ``dkg = -beta * y_wn``,
* ``dbeta = rowsum(y_u * v) - rowsum(y_wn * kg) - rowsum(P * Akk)`` (``Akk`` is zero on and above the diagonal),
* ``ddec = rowsum(h * dhe)`` over ``V``, the gradient of the chunk decay ``exp(G_C)`` (torch made a ``[K, V]``
  temporary of it per chunk, the largest tensors of the backward),

replacing about a dozen element-wise and reduction launches. ``dAkk = beta * dl = -beta * P`` is not formed either:
`flashkda.bwd.gated_dots.chunk_kda_gated_dots_bwd` takes ``P`` with the row scale ``-beta``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_kda_bwd_ut"]


@triton.jit
def chunk_kda_bwd_kernel_ut(
    y_u,
    y_wn,
    p,
    kg,
    v,
    akk,
    beta,
    h,
    dhe,
    dv,
    dkg,
    dbeta,
    ddec,
    C: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BD: tl.constexpr,
    BV: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, C)
    o_d = tl.arange(0, BD)
    # [C]
    b_beta = tl.load(beta + i_b * C + o_c).to(tl.float32)
    # [C, C]
    p_a = i_b * C * C + o_c[:, None] * C + o_c[None, :]
    b_pa = tl.load(p + p_a).to(tl.float32) * tl.load(akk + p_a).to(tl.float32)
    b_db = -tl.sum(tl.where(o_c[:, None] > o_c[None, :], b_pa, 0.0), axis=1)
    for i_k in range(0, K, BD):
        # [C, BD]
        p_k = i_b * C * K + o_c[:, None] * K + (i_k + o_d)[None, :]
        b_y = tl.load(y_wn + p_k).to(tl.float32)
        b_db -= tl.sum(b_y * tl.load(kg + p_k).to(tl.float32), axis=1)
        tl.store(dkg + p_k, (-b_beta[:, None] * b_y).to(dkg.dtype.element_ty))
    for i_v in range(0, V, BD):
        # V need not be a multiple of BD (any V the state passes take)
        p_v = i_b * C * V + o_c[:, None] * V + (i_v + o_d)[None, :]
        m_v = (o_c[:, None] >= 0) & (i_v + o_d < V)[None, :]
        b_y = tl.load(y_u + p_v, mask=m_v, other=0.0).to(tl.float32)
        b_db += tl.sum(b_y * tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32), axis=1)
        tl.store(dv + p_v, (b_beta[:, None] * b_y).to(dv.dtype.element_ty), mask=m_v)
    tl.store(dbeta + i_b * C + o_c, b_db.to(dbeta.dtype.element_ty))
    o_v = tl.arange(0, BV)
    for i_k in range(0, K, BD):
        # [BD, BV] rows of the state and its gradient
        p_h = i_b * K * V + (i_k + o_d)[:, None] * V + o_v[None, :]
        m_h = (o_d[:, None] >= 0) & (o_v[None, :] < V)
        b_hd = tl.load(h + p_h, mask=m_h, other=0.0).to(tl.float32) * tl.load(dhe + p_h, mask=m_h, other=0.0).to(
            tl.float32)
        tl.store(ddec + i_b * K + i_k + o_d, tl.sum(b_hd, axis=1).to(ddec.dtype.element_ty))


def chunk_kda_bwd_ut(
    y_u: torch.Tensor,
    y_wn: torch.Tensor,
    p: torch.Tensor,
    kg: torch.Tensor,
    v: torch.Tensor,
    akk: torch.Tensor,
    beta: torch.Tensor,
    h: torch.Tensor,
    dhe: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dv, dkg, dbeta, ddec)`` from the UT-transform products and the states (see the module docstring).

    Args:
        y_u: ``[..., C, V]`` ``M^T dv_new``.
        y_wn: ``[..., C, K]`` ``y_u h^T`` (minus ``M^T dw``).
        p: ``[..., C, C]`` ``y_u v_new^T``.
        kg: ``[..., C, K]`` ``k * exp(G)``.
        v: ``[..., C, V]`` values.
        akk: ``[..., C, C]`` strictly lower ``Akk`` (entries on and above the diagonal ignored).
        beta: ``[..., C]`` write strengths.
        h: ``[..., K, V]`` state at each chunk start.
        dhe: ``[..., K, V]`` gradient of the state at each chunk end.

    Returns:
        ``dv [..., C, V]``, ``dkg [..., C, K]``, ``dbeta [..., C]``, ``ddec [..., K]``; dtype of ``y_u``.
    """
    *lead, C, V = y_u.shape
    K = kg.shape[-1]
    ops = [x.contiguous() for x in (y_u, y_wn, p, kg, v, akk, beta, h, dhe)]
    assert ops[1].shape[-2:] == (C, K) and ops[2].shape[-2:] == (C, C) and ops[6].shape[-1] == C, "shape mismatch"
    assert ops[7].shape[-2:] == (K, V) and ops[8].shape == ops[7].shape, "h, dhe: [..., K, V]"
    BD = min(32, K)
    assert K % BD == 0 and C == triton.next_power_of_2(C), f"unsupported C={C}, K={K}"
    dv, dkg = torch.empty_like(ops[0]), torch.empty_like(ops[1])
    dbeta = ops[6].new_empty(ops[6].shape, dtype=ops[0].dtype)
    ddec = ops[7].new_empty(ops[7].shape[:-1], dtype=ops[0].dtype)
    nb = ops[0].numel() // (C * V)
    chunk_kda_bwd_kernel_ut[(nb,)](
        *ops, dv, dkg, dbeta, ddec, C=C, K=K, V=V, BD=BD, BV=triton.next_power_of_2(V), num_warps=4
    )
    return dv, dkg, dbeta, ddec
