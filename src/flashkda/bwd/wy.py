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

from flashkda.env import env_flag

__all__ = ["FUSED_WY_PRECISIONS", "chunk_kda_bwd_ut", "chunk_kda_bwd_wy", "fused_wy"]


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


@triton.jit
def chunk_kda_bwd_kernel_wy(
    minv,
    dv_new,
    h,
    v_new,
    do,
    dhe,
    kg,
    v,
    akk,
    beta,
    dv,
    dkg,
    dbeta,
    ddec,
    p,
    daqk,
    dqg,
    dkend,
    C: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GATE_PRODUCTS: tl.constexpr,
):
    # One program per (chunk, head) walks V in BD-wide slices; y_u never leaves registers, y_wn and P (and, with
    # GATE_PRODUCTS, do v_new^T, do h^T and v_new dhe^T) accumulate over the slices. Every right-hand operand is read transposed straight from
    # memory (no register transpose of an fp32 dot operand, see flashkda.bwd.gated_dots).
    i_b = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, K)
    o_d = tl.arange(0, BD)
    # [C, C]: M^T
    b_mt = tl.load(minv + i_b * C * C + o_c[None, :] * C + o_c[:, None]).to(tl.float32)
    # [C]
    b_beta = tl.load(beta + i_b * C + o_c).to(tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    b_p = tl.zeros([C, C], dtype=tl.float32)
    b_ywn = tl.zeros([C, K], dtype=tl.float32)
    if GATE_PRODUCTS:
        b_daqk = tl.zeros([C, C], dtype=tl.float32)
        b_dqg = tl.zeros([C, K], dtype=tl.float32)
        b_dkend = tl.zeros([C, K], dtype=tl.float32)
    b_ddec = tl.zeros([K], dtype=tl.float32)
    for i_v in range(0, V, BD):
        o_v = i_v + o_d
        m_v = o_v < V
        m_cv = (o_c[:, None] >= 0) & m_v[None, :]
        m_vc = m_v[:, None] & (o_c[None, :] >= 0)
        m_vk = m_v[:, None] & (o_k[None, :] >= 0)
        p_cv = i_b * C * V + o_c[:, None] * V + o_v[None, :]
        p_vc = i_b * C * V + o_c[None, :] * V + o_v[:, None]
        p_vk = i_b * K * V + o_k[None, :] * V + o_v[:, None]
        # [C, BD]: y_u = M^T dv_new, then dv = beta y_u and the y_u . v part of dbeta
        b_yu = tl.dot(b_mt, tl.load(dv_new + p_cv, mask=m_cv, other=0.0).to(tl.float32),
                      input_precision=DOT_PRECISION)
        b_db += tl.sum(b_yu * tl.load(v + p_cv, mask=m_cv, other=0.0).to(tl.float32), axis=1)
        tl.store(dv + p_cv, (b_beta[:, None] * b_yu).to(dv.dtype.element_ty), mask=m_cv)
        # [BD, C]: v_new^T; P = y_u v_new^T and do v_new^T
        b_vnt = tl.load(v_new + p_vc, mask=m_vc, other=0.0).to(tl.float32)
        b_p += tl.dot(b_yu, b_vnt, input_precision=DOT_PRECISION)
        # [BD, K]: h^T and dhe^T; y_wn = y_u h^T, rowsum(h * dhe) (and do h^T, v_new dhe^T)
        b_ht = tl.load(h + p_vk, mask=m_vk, other=0.0).to(tl.float32)
        b_dhet = tl.load(dhe + p_vk, mask=m_vk, other=0.0).to(tl.float32)
        b_ywn += tl.dot(b_yu, b_ht, input_precision=DOT_PRECISION)
        b_ddec += tl.sum(b_ht * b_dhet, axis=0)
        if GATE_PRODUCTS:
            b_do = tl.load(do + p_cv, mask=m_cv, other=0.0).to(tl.float32)
            b_daqk += tl.dot(b_do, b_vnt, input_precision=DOT_PRECISION)
            b_dqg += tl.dot(b_do, b_ht, input_precision=DOT_PRECISION)
            b_vn = tl.load(v_new + p_cv, mask=m_cv, other=0.0).to(tl.float32)
            b_dkend += tl.dot(b_vn, b_dhet, input_precision=DOT_PRECISION)
    # [C, K]
    p_ck = i_b * C * K + o_c[:, None] * K + o_k[None, :]
    b_db -= tl.sum(b_ywn * tl.load(kg + p_ck).to(tl.float32), axis=1)
    tl.store(dkg + p_ck, (-b_beta[:, None] * b_ywn).to(dkg.dtype.element_ty))
    if GATE_PRODUCTS:
        tl.store(dqg + p_ck, b_dqg.to(dqg.dtype.element_ty))
        tl.store(dkend + p_ck, b_dkend.to(dkend.dtype.element_ty))
    # [C, C]
    p_cc = i_b * C * C + o_c[:, None] * C + o_c[None, :]
    b_pa = tl.where(o_c[:, None] > o_c[None, :], b_p * tl.load(akk + p_cc).to(tl.float32), 0.0)
    b_db -= tl.sum(b_pa, axis=1)
    tl.store(p + p_cc, b_p.to(p.dtype.element_ty))
    if GATE_PRODUCTS:
        tl.store(daqk + p_cc, b_daqk.to(daqk.dtype.element_ty))
    tl.store(dbeta + i_b * C + o_c, b_db.to(dbeta.dtype.element_ty))
    tl.store(ddec + i_b * K + o_k, b_ddec.to(ddec.dtype.element_ty))


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


def chunk_kda_bwd_wy(
    minv: torch.Tensor,
    dv_new: torch.Tensor,
    h: torch.Tensor,
    v_new: torch.Tensor,
    do: torch.Tensor,
    dhe: torch.Tensor,
    kg: torch.Tensor,
    v: torch.Tensor,
    akk: torch.Tensor,
    beta: torch.Tensor,
    *,
    dot_precision: str,
) -> tuple[torch.Tensor, ...]:
    """The UT-transform pass with its batched products fused in: one Triton program per (chunk, head).

    Computes ``y_u = M^T dv_new``, ``y_wn = y_u h^T``, ``P = y_u v_new^T`` in registers (never written) and the
    products the gate chain needs, ``dqg = do h^T``, ``dkend = v_new dhe^T``, ``do v_new^T``, then the outputs of
    `chunk_kda_bwd_ut`. Replaces six torch batched GEMMs and that kernel's re-reads of their results.

    Args:
        minv: ``[..., C, C]`` ``M = (I + Diag(beta) Akk)^-1``.
        dv_new, v_new, do, v: ``[..., C, V]``.
        h, dhe: ``[..., K, V]`` state at each chunk start and the gradient of the state at its end.
        kg: ``[..., C, K]`` ``k * exp(G)``.
        akk: ``[..., C, C]`` strictly lower ``Akk`` (entries on and above the diagonal ignored).
        beta: ``[..., C]``.
        dot_precision: ``tl.dot`` input precision (``"tf32"`` for bf16/fp16 callers, ``"ieee"`` for fp32).

    Returns:
        ``(dv, dkg, dbeta, ddec, P, do v_new^T, dqg, dkend)``: ``[..., C, V]``, ``[..., C, K]``, ``[..., C]``,
        ``[..., K]``, ``[..., C, C]`` (unmasked), ``[..., C, C]`` (unmasked), ``[..., C, K]``, ``[..., C, K]``;
        dtype of ``dv_new``.
    """
    *lead, C, V = dv_new.shape
    K = kg.shape[-1]
    ops = [x.contiguous() for x in (minv, dv_new, h, v_new, do, dhe, kg, v, akk, beta)]
    assert ops[2].shape[-2:] == (K, V) and ops[5].shape == ops[2].shape, "h, dhe: [..., K, V]"
    assert ops[0].shape[-2:] == (C, C) and ops[8].shape[-2:] == (C, C) and ops[9].shape[-1] == C, "shape mismatch"
    assert V >= 16 and C == triton.next_power_of_2(C) and K == triton.next_power_of_2(K), f"C={C}, K={K}, V={V}"
    dt = ops[1].dtype
    dv, dkg = torch.empty_like(ops[1]), torch.empty_like(ops[6], dtype=dt)
    dqg, dkend = torch.empty_like(dkg), torch.empty_like(dkg)
    p, daqk = torch.empty_like(ops[0], dtype=dt), torch.empty_like(ops[0], dtype=dt)
    dbeta = ops[9].new_empty(ops[9].shape, dtype=dt)
    ddec = ops[2].new_empty(ops[2].shape[:-1], dtype=dt)
    nb = ops[1].numel() // (C * V)
    chunk_kda_bwd_kernel_wy[(nb,)](
        *ops, dv, dkg, dbeta, ddec, p, daqk, dqg, dkend, C=C, K=K, V=V, BD=16, DOT_PRECISION=dot_precision,
        GATE_PRODUCTS=True,
        # offline sm_90 (Triton 3.9, K = V = 128, tf32): 8 warps 254 registers, no spills (BD = 32: 88 B spilled;
        # 4 warps: 1.3-1.8 KB); ieee products (fp32 callers) spill >= 1.2 KB at 8 warps, see `fused_wy`.
        num_warps=8,
        num_stages=1,
    )
    return dv, dkg, dbeta, ddec, p, daqk, dqg, dkend


#: Precisions at which the chain rule takes `chunk_kda_bwd_wy` (otherwise torch GEMMs and `chunk_kda_bwd_ut`):
#: bf16/fp16 callers on a GPU. fp32 callers keep the GEMMs: their exact products spill in the fused kernel.
#: Tests add "ieee" to run the fused kernel in the interpreter. Opt-in (FLASHKDA_BWD_FUSED_WY=1): correct on an H200
#: (fp64 gate, 04:00 UTC) but 2.83 ms at B1-T8192-H64 against ~2.0 ms for the GEMMs + UT pass it replaces
#: (benchmarks/kda/NOTES.md): one program per (chunk, head) at 8 warps is latency-bound.
FUSED_WY_PRECISIONS: tuple[str, ...] = ("tf32",) if env_flag("FLASHKDA_BWD_FUSED_WY", False) else ()


def fused_wy(dot_precision: str, K: int, V: int) -> bool:
    """Whether the chain rule runs `chunk_kda_bwd_wy` for this caller: ``V >= 16`` (the smallest product tile) and
    ``K <= 128`` (three ``[C, K]`` fp32 accumulators; at K = 256 they would spill)."""
    return dot_precision in FUSED_WY_PRECISIONS and V >= 16 and K <= 128
