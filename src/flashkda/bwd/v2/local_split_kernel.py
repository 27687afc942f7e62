"""B3 of the v2 backward in two Triton kernels (16- or 32-token chunks, K = V = 64 or 128), with the algebra and
roundings of ``emulate._local_grads``.

**B3a** (`kda_bwd_v2_local_state_kernel`), sequential: one program per (checkpoint segment, value head, block of
``BV`` value columns). It walks the segment's chunks recomputing the state ``[K, BV]`` (K2's step) and per chunk
writes ``dv`` and the chunk's fp32 partials over its value columns of every contraction over V that K1 backwards
needs: ``X = dU W^T`` and ``dMf = do U^T`` ``[C, C]`` (``U`` as two bf16 operands, value and remainder),
``dkd = du S^T``, ``dqd = do S^T``, ``dkr = U dS^T``
``[C, K]``, ``dglast = rowsum(S * dS)`` ``[K]`` and ``db = rowsum(dW * vu)`` ``[C]``, to scratch indexed
``[NV, NTS, HV, ...]`` (``NV = V / BV``). The launcher runs the pair over groups of segments, so that the
scratch holds ``NTS`` chunks (a group's) at a time: ``bounds[grp]`` is the group's first chunk, ``segment0`` its
first segment.

**B3b** (`kda_bwd_v2_local_chunk_kernel`), chunk-parallel: one program per (chunk, value head); on a Hopper GPU at
16-token chunks the Gluon kernel of `local_k1_gluon` takes its place (same arguments), this one serves chunk 32 and
the interpreter. It sums the ``NV``
partials in fp32 (then rounds ``X`` to bf16 where the emulation does, so the bf16 rounding points are the
same; only the fp32 summation order over V differs), runs the ``(I + L)^-1`` chain to ``dL`` and K1 backwards
(`local_grad_ops._k1_grads`), and writes ``dq, dk, dg, dbeta`` and the chunk's ``A_log`` / ``dt_bias`` partials
``[NT, HV, K]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashkda.bwd.v2.local_grad_ops import (
    HILO,
    _bf,
    _chain_dl,
    _chunk_tokens,
    _dot,
    _gate_scalars,
    _k1_grads,
    _op,
)
from flashkda.rounding import INTERPRET, cast_for_store, operand_split


@triton.jit(do_not_specialize=["grp", "segment0"])
def kda_bwd_v2_local_state_kernel(
    v, do, kd, kr, inv, mqk, glast, bsig,
    ckpt, ds, chunk_index, segments,
    dv, part_ck, part_cc, part_k, part_c, bounds, grp, segment0, NTS,
    HV: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
):
    NV: tl.constexpr = V // BV
    i_s = segment0 + tl.program_id(0) // NV
    i_v = tl.program_id(0) % NV
    i_h = tl.program_id(1)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    first = tl.load(segments + i_s * 2)
    n_chunks = tl.load(segments + i_s * 2 + 1)
    c0 = tl.load(bounds + grp)  # the group's first chunk: scratch row 0

    o_kv = o_k[:, None] * V + o_v[None, :]  # [K, BV]
    b_S = tl.load(ckpt + (i_s.to(tl.int64) * HV + i_h) * K * V + o_kv).to(tl.float32)  # [K, BV] entering
    for j in range(n_chunks):
        i_c = first + j
        o_t, m_c = _chunk_tokens(chunk_index, i_c, o_c)  # [C] token rows, valid tokens
        m_ck = m_c[:, None]
        i_ch = i_c.to(tl.int64) * HV + i_h  # (chunk, head) row of the workspace and ds
        i_p = (i_v * NTS + i_c - c0).to(tl.int64) * HV + i_h  # (V block, chunk, head) row of the partials
        p_hk = (o_t[:, None] * HV + i_h) * K + o_k[None, :]  # [C, K] token-major at the value head
        p_hv = (o_t[:, None] * HV + i_h) * V + o_v[None, :]  # [C, BV]
        o_cc = o_c[:, None] * C + o_c[None, :]  # [C, C]
        o_ck = o_c[:, None] * K + o_k[None, :]  # [C, K]

        # -- ordered so that few tiles are live at once: the old state's last use first, then the new state
        b_dSf = tl.load(ds + i_ch * K * V + o_kv).to(tl.float32)  # [K, BV]
        tl.store(part_k + i_p * K + o_k, tl.sum(b_S * b_dSf, 1))  # dglast
        b_S0 = _bf(b_S)
        b_b = tl.load(bsig + o_t * HV + i_h, mask=m_c, other=0.0)  # [C] fp32 sigmoid(beta)
        b_v = tl.load(v + p_hv, mask=m_ck, other=0.0).to(tl.float32)  # [C, BV]
        b_kd = _op(tl.load(kd + p_hk, mask=m_ck, other=0.0))  # [C, K]
        b_vu = b_v - _dot(b_kd, b_S0)  # [C, BV]: K2's step again
        b_W = _bf(b_vu * b_b[:, None])
        b_inv = _op(tl.load(inv + i_ch * C * C + o_cc))  # [C, C], rows past the chunk's end zero
        b_U, b_Ur = operand_split(_dot(b_inv, b_W), HILO, INTERPRET)  # [C, BV]; dMqk takes both parts
        b_kr = _op(tl.load(kr + p_hk, mask=m_ck, other=0.0))
        b_gl = tl.load(glast + i_ch * K + o_k)  # [K] fp32, 2^Glast
        b_S = b_S * b_gl[:, None] + _dot(tl.trans(b_kr), b_U)  # the state entering the next chunk

        # -- the gradients of W, U; the V contractions as this block's partials
        b_mqk = _op(tl.load(mqk + i_ch * C * C + o_cc))
        b_do = _op(tl.load(do + p_hv, mask=m_ck, other=0.0))  # [C, BV]
        b_dS = _op(tl.load(ds + i_ch * K * V + o_kv))  # [K, BV], again as a product operand
        b_dU = _bf(_dot(tl.trans(b_mqk), b_do) + _dot(b_kr, b_dS))
        b_dW = _dot(tl.trans(b_inv), b_dU)  # [C, BV] fp32
        tl.store(dv + p_hv, cast_for_store(b_dW * b_b[:, None], dv.dtype.element_ty), mask=m_ck)
        tl.store(part_c + i_p * C + o_c, tl.sum(b_dW * b_vu, 1))
        b_du = _bf(-b_b[:, None] * b_dW)
        tl.store(part_cc + i_p * 2 * C * C + o_cc, _dot(b_dU, tl.trans(b_W)))
        tl.store(part_cc + i_p * 2 * C * C + C * C + o_cc, _dot(b_do, tl.trans(b_U)) + _dot(b_do, tl.trans(b_Ur)))
        tl.store(part_ck + i_p * 3 * C * K + 2 * C * K + o_ck, _dot(b_U, tl.trans(b_dS)))  # dkr
        tl.store(part_ck + i_p * 3 * C * K + C * K + o_ck, _dot(b_do, tl.trans(b_S0)))  # dqd
        tl.store(part_ck + i_p * 3 * C * K + o_ck, _dot(b_du, tl.trans(b_S0)))  # dkd


@triton.jit(do_not_specialize=["grp"])
def kda_bwd_v2_local_chunk_kernel(
    q, k, g, A_log, dt_bias,
    kd, qd, kr, inv, glast, bsig, chunk_index,
    part_ck, part_cc, part_k, part_c,
    dq, dk, dg, dbeta, part_alog, part_dt,
    bounds, grp, scale, lower_bound, NT, NTS,
    HQ: tl.constexpr, HV: tl.constexpr, C: tl.constexpr, K: tl.constexpr, NV: tl.constexpr,
    HAS_ALOG: tl.constexpr, HAS_DT: tl.constexpr,
):
    c0 = tl.load(bounds + grp)  # the group's chunks [c0, c1)
    i_j = tl.program_id(0)  # the chunk's scratch row
    in_group = i_j < tl.load(bounds + grp + 1) - c0
    i_c = tl.minimum(c0 + i_j, NT - 1)
    i_h = tl.program_id(1)
    i_hq = i_h // (HV // HQ)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, K)
    strict = o_c[:, None] > o_c[None, :]  # [C, C]
    causal = o_c[:, None] >= o_c[None, :]
    a, a2, b_dt = _gate_scalars(A_log, dt_bias, i_h, K, HAS_ALOG, HAS_DT)

    row0 = tl.load(chunk_index + i_c * 3 + 1)
    n_valid = tl.where(in_group, tl.load(chunk_index + i_c * 3 + 2), 0)
    live = n_valid > 0  # a chunk of the group (every chunk in a group is used)
    m_c = o_c < n_valid  # [C]
    o_t = (row0 + o_c).to(tl.int64)  # [C] token rows
    m_ck = m_c[:, None]
    i_ch = i_c.to(tl.int64) * HV + i_h
    p_hk = (o_t[:, None] * HV + i_h) * K + o_k[None, :]  # [C, K] token-major at the value head
    p_qk = (o_t[:, None] * HQ + i_hq) * K + o_k[None, :]  # [C, K] at the q/k head
    o_cc = o_c[:, None] * C + o_c[None, :]  # [C, C]
    o_ck = o_c[:, None] * K + o_k[None, :]  # [C, K]
    l_k = o_k < tl.where(live, K, 0)  # [K]: all when the chunk is live, else none
    l_c = o_c < tl.where(live, C, 0)  # [C]
    l_cc = o_cc < tl.where(live, C * C, 0)  # [C, C]
    l_ck = o_ck < tl.where(live, C * K, 0)  # [C, K]

    # -- the V blocks' partials, summed in fp32
    b_X = tl.zeros([C, C], dtype=tl.float32)
    b_dMf = tl.zeros([C, C], dtype=tl.float32)
    b_dkd = tl.zeros([C, K], dtype=tl.float32)
    b_dqd = tl.zeros([C, K], dtype=tl.float32)
    b_dkr = tl.zeros([C, K], dtype=tl.float32)
    b_dglast = tl.zeros([K], dtype=tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    for i_v in tl.static_range(NV):
        i_p = (i_v * NTS + i_j).to(tl.int64) * HV + i_h
        b_X += tl.load(part_cc + i_p * 2 * C * C + o_cc, mask=l_cc, other=0.0)
        b_dMf += tl.load(part_cc + i_p * 2 * C * C + C * C + o_cc, mask=l_cc, other=0.0)
        b_dkd += tl.load(part_ck + i_p * 3 * C * K + o_ck, mask=l_ck, other=0.0)
        b_dqd += tl.load(part_ck + i_p * 3 * C * K + C * K + o_ck, mask=l_ck, other=0.0)
        b_dkr += tl.load(part_ck + i_p * 3 * C * K + 2 * C * K + o_ck, mask=l_ck, other=0.0)
        b_dglast += tl.load(part_k + i_p * K + o_k, mask=l_k, other=0.0)
        b_db += tl.load(part_c + i_p * C + o_c, mask=l_c, other=0.0)

    b_kd = _op(tl.load(kd + p_hk, mask=m_ck, other=0.0))  # [C, K]
    b_qd = _op(tl.load(qd + p_hk, mask=m_ck, other=0.0))
    b_kr = _op(tl.load(kr + p_hk, mask=m_ck, other=0.0))
    b_inv = _op(tl.load(inv + i_ch * C * C + o_cc, mask=l_cc, other=0.0))  # [C, C]
    b_gl = tl.load(glast + i_ch * K + o_k, mask=l_k, other=0.0)  # [K] fp32, 2^Glast
    b_b = tl.load(bsig + o_t * HV + i_h, mask=m_c, other=0.0)  # [C] fp32 sigmoid(beta)

    b_dL = _chain_dl(_bf(b_X), b_inv, strict)  # [C, C]
    b_dq, b_dk, b_dgate, b_db, alog_part, dt_part = _k1_grads(
        q, k, g, p_qk, p_hk, m_ck, a, a2, b_dt, scale, lower_bound,
        b_dL, tl.where(causal, b_dMf, 0.0), b_dkd, b_dqd, b_dkr, b_dglast, b_db, b_kd, b_qd, b_kr, b_gl, b_b, C)

    tl.store(dq + p_hk, cast_for_store(b_dq, dq.dtype.element_ty), mask=m_ck)
    tl.store(dk + p_hk, cast_for_store(b_dk, dk.dtype.element_ty), mask=m_ck)
    tl.store(dg + p_hk, cast_for_store(b_dgate, dg.dtype.element_ty), mask=m_ck)
    tl.store(dbeta + o_t * HV + i_h, cast_for_store(b_db * b_b * (1.0 - b_b), dbeta.dtype.element_ty), mask=m_c)
    tl.store(part_alog + i_ch * K + o_k, alog_part, mask=l_k)
    tl.store(part_dt + i_ch * K + o_k, dt_part, mask=l_k)
