"""B3 of the v2 backward as a Triton kernel: the chunk-local gradients, 16- or 32-token chunks, K = V = 128.

One program per (checkpoint segment, value head). It loads the segment's checkpoint (the state entering its first
chunk), walks the segment's chunks forward recomputing the state (K2's step) and per chunk turns the state entering
it, the state gradient leaving it (B2's ``ds``), the workspace and ``v, do`` into ``dv, dbeta`` and the gradients
of the raw ``q, k, g`` (K1 backwards), with the algebra and roundings of ``emulate._local_grads``: every product
from bf16 operands with fp32 accumulation, its result rounded to bf16 where it is another product's operand, the
chain ``(I + L)^-1`` gradient ``INV^T (dU W^T) INV^T`` with its second product in fp32 as the emulation; the gate
gradient takes the bf16 factors that entered the products. At 32-token chunks K1's factors are rebuilt by
16-token halves as ``fwd.v2.emulate32`` builds them (half B relative to ``r = G[15]``, the cross block through
``k_A 2^(r - G_A)``), and the dependence on ``r`` adds its terms to token 15, as ``emulate._local_grads``.

Outputs per token: ``dq, dk`` at the value head (fp32 for GVA, summed over value heads after; else in q's dtype),
``dv, dg, dbeta`` in the inputs' dtypes, and per program fp32 partial sums over the segment's tokens of ``dx * x``
(``A_log``) and of ``dg`` (``dt_bias``), ``[NSEG, HV, K]`` each, reduced after.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashkda.rounding import INTERPRET, cast_for_store, round_bf16

LOG2E = tl.constexpr(1.4426950408889634)  # 1/ln(2)
LN2 = tl.constexpr(0.6931471805599453)
#: Tokens per half of a 32-token chunk (K1 builds its factors by halves there).
HALF = tl.constexpr(16)


@triton.jit
def _bf(b_x):
    """fp32 -> a bf16 product operand, rounded to nearest (held in fp32 on the interpreter, whose bf16 conversion
    truncates and whose bf16 products are wrong)."""
    return round_bf16(b_x, INTERPRET)


@triton.jit
def _op(b_x):
    """A tile loaded from bf16 memory as a product operand (fp32 on the interpreter: bf16 values are exact there)."""
    if INTERPRET:
        b_y = b_x.to(tl.float32)
    else:
        b_y = b_x.to(tl.bfloat16)
    return b_y


@triton.jit
def _dot(b_a, b_b):
    """``a @ b`` of bf16 operands with fp32 accumulation (exact fp32 products of the fp32-held operands on the
    interpreter)."""
    if INTERPRET:
        b_c = tl.dot(b_a, b_b, input_precision="ieee")
    else:
        b_c = tl.dot(b_a, b_b)
    return b_c


@triton.jit
def kda_bwd_v2_local_kernel(
    q, k, v, g, do, A_log, dt_bias,
    kd, qd, kr, inv, mqk, glast, bsig,
    ckpt, ds, chunk_index, segments,
    dq, dk, dv, dg, dbeta, part_alog, part_dt,
    scale, lower_bound,
    HQ: tl.constexpr, HV: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    HAS_ALOG: tl.constexpr, HAS_DT: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_hq = i_h // (HV // HQ)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    strict = o_c[:, None] > o_c[None, :]  # [C, C]
    causal = o_c[:, None] >= o_c[None, :]
    first = tl.load(segments + i_s * 2)
    n_chunks = tl.load(segments + i_s * 2 + 1)

    if HAS_ALOG:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        a2 = tl.exp2(tl.load(A_log + i_h).to(tl.float32) * LOG2E)
    else:
        a = 1.0
        a2 = 1.0
    if HAS_DT:
        b_dt = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)  # [K]
    else:
        b_dt = tl.zeros([K], dtype=tl.float32)

    o_kv = o_k[:, None] * V + o_v[None, :]  # [K, V]
    b_S = tl.load(ckpt + (i_s.to(tl.int64) * HV + i_h) * K * V + o_kv).to(tl.float32)  # [K, V] entering
    acc_alog = tl.zeros([K], dtype=tl.float32)
    acc_dt = tl.zeros([K], dtype=tl.float32)
    for j in range(n_chunks):
        i_c = first + j
        row0 = tl.load(chunk_index + i_c * 3 + 1)
        n_valid = tl.load(chunk_index + i_c * 3 + 2)
        m_c = o_c < n_valid  # [C]
        o_t = (row0 + o_c).to(tl.int64)  # [C] token rows
        m_ck = m_c[:, None]
        p_hk = (o_t[:, None] * HV + i_h) * K + o_k[None, :]  # [C, K] token-major at the value head
        p_hv = (o_t[:, None] * HV + i_h) * V + o_v[None, :]  # [C, V]
        p_qk = (o_t[:, None] * HQ + i_hq) * K + o_k[None, :]  # [C, K] at the q/k head
        p_cc = (i_c.to(tl.int64) * HV + i_h) * C * C + o_c[:, None] * C + o_c[None, :]  # [C, C]

        # -- workspace, values, output gradient, state gradient leaving the chunk
        b_kd = _op(tl.load(kd + p_hk, mask=m_ck, other=0.0))  # [C, K]
        b_qd = _op(tl.load(qd + p_hk, mask=m_ck, other=0.0))
        b_kr = _op(tl.load(kr + p_hk, mask=m_ck, other=0.0))
        b_inv = _op(tl.load(inv + p_cc))  # [C, C], rows past the chunk's end zero
        b_mqk = _op(tl.load(mqk + p_cc))
        b_gl = tl.load(glast + (i_c.to(tl.int64) * HV + i_h) * K + o_k)  # [K] fp32, 2^Glast
        b_b = tl.load(bsig + o_t * HV + i_h, mask=m_c, other=0.0)  # [C] fp32 sigmoid(beta)
        b_v = tl.load(v + p_hv, mask=m_ck, other=0.0).to(tl.float32)  # [C, V]
        b_do = _op(tl.load(do + p_hv, mask=m_ck, other=0.0))  # [C, V]
        b_dS = _op(tl.load(ds + (i_c.to(tl.int64) * HV + i_h) * K * V + o_kv))  # [K, V]
        b_S0 = _bf(b_S)

        # -- K2's step again: W, U; then their gradients (the chunk's output and state terms)
        b_vu = b_v - _dot(b_kd, b_S0)  # [C, V]
        b_W = _bf(b_vu * b_b[:, None])
        b_U = _bf(_dot(b_inv, b_W))  # [C, V]
        b_dU = _bf(_dot(tl.trans(b_mqk), b_do) + _dot(b_kr, b_dS))
        b_dW = _dot(tl.trans(b_inv), b_dU)  # [C, V] fp32
        b_dv = b_dW * b_b[:, None]
        b_db = tl.sum(b_dW * b_vu, 1)  # [C]
        b_du = _bf(-b_b[:, None] * b_dW)
        b_X = _bf(_dot(b_dU, tl.trans(b_W)))  # [C, C]
        b_Y = _dot(tl.trans(b_inv), b_X)
        b_dL = -tl.dot(b_Y, tl.trans(b_inv.to(tl.float32)), input_precision="ieee")
        b_dL = tl.where(strict, b_dL, 0.0)
        b_dMf = tl.where(causal, _dot(b_do, tl.trans(b_U)), 0.0)  # [C, C]
        b_dkr = _dot(b_U, tl.trans(b_dS))  # [C, K]
        b_dqd = _dot(b_do, tl.trans(b_S0))
        b_dkd = _dot(b_du, tl.trans(b_S0))
        b_dglast = tl.sum(b_S * b_dS.to(tl.float32), 1)  # [K]
        b_S = b_S * b_gl[:, None] + _dot(tl.trans(b_kr), b_U)  # the state entering the next chunk

        # -- K1 again from the raw inputs: L2 norms, bounded gate, in-chunk cumsum, the factors
        b_q = tl.load(q + p_qk, mask=m_ck, other=0.0).to(tl.float32)  # [C, K]
        b_k = tl.load(k + p_qk, mask=m_ck, other=0.0).to(tl.float32)
        b_rq = tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)  # [C]
        b_rk = tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)
        b_qn = b_q * b_rq[:, None]
        b_kn = b_k * b_rk[:, None]
        b_g = tl.load(g + p_hk, mask=m_ck, other=0.0).to(tl.float32) + b_dt[None, :]
        b_x = b_g * a  # [C, K]
        b_sig = 1.0 / (1.0 + tl.exp(-b_x))
        b_gl2 = lower_bound * LOG2E / (1.0 + tl.exp2(-(b_g * a2) * LOG2E))
        b_gl2 = tl.where(m_ck, b_gl2, 0.0)
        b_G = tl.cumsum(b_gl2, 0)  # [C, K] log2 units
        b_Glast = tl.sum(b_gl2, 0)  # [K]
        b_e = tl.exp2(b_G)
        b_er = tl.exp2(b_Glast[None, :] - b_G)
        if C > HALF:  # K1's factors by 16-token halves: half B relative to r = G[15], the cross factor on half A
            in_b = (o_c >= HALF)[:, None]  # [C, 1]
            b_r = tl.sum(tl.where(o_c[:, None] == HALF - 1, b_G, 0.0), 0)  # [K]
            b_ref = tl.where(in_b, b_r[None, :], 0.0)
            b_eh = tl.exp2(b_G - b_ref)
            b_eih = tl.exp2(b_ref - b_G)
            b_ear = tl.where(in_b, 0.0, tl.exp2(b_r[None, :] - b_G))
            b_kiar = _bf(b_kn * b_ear)
        else:
            b_eh = b_e
            b_eih = tl.exp2(-b_G)
        b_kdh = _bf(b_kn * b_eh)
        b_kih = _bf(b_kn * b_eih)
        b_qdh = _bf(b_qn * b_eh * scale)

        # -- L = strict(diag(beta) kd ki^T) and Mqk backwards (by half blocks at C = 32: diagonal, cross)
        b_dLf = b_dL * b_b[:, None]
        if C > HALF:
            same = (o_c[:, None] // HALF) == (o_c[None, :] // HALF)
            off = (o_c[:, None] // HALF) > (o_c[None, :] // HALF)
            b_P = tl.where(same, _dot(b_kdh, tl.trans(b_kih)), 0.0) + tl.where(off, _dot(b_kdh, tl.trans(b_kiar)), 0.0)
            b_Ls = _bf(tl.where(same, b_dLf, 0.0))
            b_Lo = _bf(tl.where(off, b_dLf, 0.0))
            b_Ms = _bf(tl.where(same, b_dMf, 0.0))
            b_Mo = _bf(tl.where(off, b_dMf, 0.0))
            b_dkdh = _dot(b_Ls, b_kih) + _dot(b_Lo, b_kiar)  # [C, K]
            b_dkih = _dot(tl.trans(b_Ls), b_kdh) + _dot(tl.trans(b_Ms), b_qdh)
            b_dkiar = _dot(tl.trans(b_Lo), b_kdh) + _dot(tl.trans(b_Mo), b_qdh)
            b_dqdh = _dot(b_Ms, b_kih) + _dot(b_Mo, b_kiar)
        else:
            b_P = _dot(b_kdh, tl.trans(b_kih))  # [C, C]
            b_dLb = _bf(b_dLf)
            b_dM = _bf(b_dMf)
            b_dkdh = _dot(b_dLb, b_kih)  # [C, K]
            b_dkih = _dot(tl.trans(b_dLb), b_kdh) + _dot(tl.trans(b_dM), b_qdh)
            b_dqdh = _dot(b_dM, b_kih)
        b_db += tl.sum(b_dL * b_P, 1)

        # -- the gate: dG per token from the bf16 factors, reverse cumsum, the chunk-total term
        b_kdf = b_kd.to(tl.float32)
        b_qdf = b_qd.to(tl.float32)
        b_krf = b_kr.to(tl.float32)
        b_dGh = LN2 * (b_dkdh * b_kdh.to(tl.float32) + b_dqdh * b_qdh.to(tl.float32)
                       - b_dkih * b_kih.to(tl.float32))
        b_dG = b_dGh + LN2 * (b_dkd * b_kdf + b_dqd * b_qdf - b_dkr * b_krf)
        if C > HALF:  # the cross factor's own term, and r = G[15] that half B's factors and the cross one depend on
            b_dGar = LN2 * b_dkiar * b_kiar.to(tl.float32)
            b_adj = tl.sum(b_dGar, 0) - tl.sum(tl.where(in_b, b_dGh, 0.0), 0)  # [K]
            b_dG += tl.where(o_c[:, None] == HALF - 1, b_adj[None, :], 0.0) - b_dGar
        b_dGlast = LN2 * (tl.sum(b_dkr * b_krf, 0) + b_dglast * b_gl)  # [K]
        b_dgl = tl.cumsum(b_dG, 0, reverse=True) + b_dGlast[None, :]
        b_dx = b_dgl * (lower_bound * LOG2E) * b_sig * (1.0 - b_sig)
        b_dgate = b_dx * a
        acc_alog += tl.sum(tl.where(m_ck, b_dx * b_x, 0.0), 0)
        acc_dt += tl.sum(tl.where(m_ck, b_dgate, 0.0), 0)

        # -- the normed q, k, then the L2 norms backwards
        b_dkn = b_dkdh * b_eh + b_dkih * b_eih + b_dkd * b_e + b_dkr * b_er
        if C > HALF:
            b_dkn += b_dkiar * b_ear
        b_dqn = (b_dqdh * b_eh + b_dqd * b_e) * scale
        b_dq = (b_dqn - b_qn * tl.sum(b_dqn * b_qn, 1)[:, None]) * b_rq[:, None]
        b_dk = (b_dkn - b_kn * tl.sum(b_dkn * b_kn, 1)[:, None]) * b_rk[:, None]

        tl.store(dq + p_hk, cast_for_store(b_dq, dq.dtype.element_ty), mask=m_ck)
        tl.store(dk + p_hk, cast_for_store(b_dk, dk.dtype.element_ty), mask=m_ck)
        tl.store(dv + p_hv, cast_for_store(b_dv, dv.dtype.element_ty), mask=m_ck)
        tl.store(dg + p_hk, cast_for_store(b_dgate, dg.dtype.element_ty), mask=m_ck)
        tl.store(dbeta + o_t * HV + i_h, cast_for_store(b_db * b_b * (1.0 - b_b), dbeta.dtype.element_ty), mask=m_c)

    o_part = (i_s.to(tl.int64) * HV + i_h) * K + o_k
    tl.store(part_alog + o_part, acc_alog)
    tl.store(part_dt + o_part, acc_dt)
