"""B3 of the v2 backward in feature-major form: the kernel of `local_grad_kernel` with every per-chunk tile held
as ``[K or V, C]`` (features down, tokens across) instead of ``[C, K or V]``.

The algebra and the bf16 rounding points are those of `local_grad_kernel` (and ``emulate._local_grads``), each
product written as its transpose: ``kd S0`` becomes ``S0^T kd^T``, ``U dS^T`` becomes ``dS U^T``, and so on. The
products with the ``[128, 128]`` state or state gradient then have M = 128 rows and N = C columns, the shape of
Hopper's warpgroup MMA (M = 64 per warpgroup), where the token-major kernel's have M = C = 16 or 32 (mma.sync
tiles, the state as a B operand staged through shared memory every chunk). K1 backwards (`_k1_grads_fm`) follows
the same layout: its ``[C, C] x [C, 128]`` products become ``[128, C] x [C, C]``, sums over features run down
axis 0 and the gate's cumsums across axis 1.

Only the launch layout differs from `local_grad_kernel`: same arguments, grid, outputs and partial sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashkda.bwd.v2.local_grad_ops import HALF, LN2, LOG2E, _bf, _chain_dl, _chunk_tokens, _dot, _gate_scalars, _op
from flashkda.rounding import cast_for_store


@triton.jit
def _k1_grads_fm(q, k, g, p_qk, p_hk, m_kc, a, a2, b_dt, scale, lower_bound,
                 b_dL, b_dMf, b_dkd, b_dqd, b_dkr, b_dglast, b_db, b_kd, b_qd, b_kr, b_gl, b_b,
                 C: tl.constexpr):
    """`local_grad_ops._k1_grads` on feature-major tiles: the raw ``q, k, g`` loaded ``[K, C]`` at ``p_qk`` /
    ``p_hk`` (columns masked by ``m_kc`` [1, C]), ``dkd, dqd, dkr`` and the workspace's ``kd, qd, kr`` ``[K, C]``;
    ``dL, dMf`` ``[C, C]`` and ``db`` [C] as there. Returns ``(dq, dk, dgate)`` ``[K, C]`` fp32, ``db`` [C] and the
    chunk's ``A_log`` / ``dt_bias`` partials [K]."""
    o_c = tl.arange(0, C)
    b_q = tl.load(q + p_qk, mask=m_kc, other=0.0).to(tl.float32)  # [K, C]
    b_k = tl.load(k + p_qk, mask=m_kc, other=0.0).to(tl.float32)
    b_rq = tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)  # [C]
    b_rk = tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_qn = b_q * b_rq[None, :]
    b_kn = b_k * b_rk[None, :]
    b_g = tl.load(g + p_hk, mask=m_kc, other=0.0).to(tl.float32) + b_dt[:, None]
    b_x = b_g * a  # [K, C]
    b_sig = 1.0 / (1.0 + tl.exp(-b_x))
    b_gl2 = lower_bound * LOG2E / (1.0 + tl.exp2(-(b_g * a2) * LOG2E))
    b_gl2 = tl.where(m_kc, b_gl2, 0.0)
    b_G = tl.cumsum(b_gl2, 1)  # [K, C] log2 units
    b_Glast = tl.sum(b_gl2, 1)  # [K]
    b_e = tl.exp2(b_G)
    b_er = tl.exp2(b_Glast[:, None] - b_G)
    if C > HALF:  # K1's factors by 16-token halves: half B relative to r = G[15], the cross factor on half A
        in_b = (o_c >= HALF)[None, :]  # [1, C]
        b_r = tl.sum(tl.where(o_c[None, :] == HALF - 1, b_G, 0.0), 1)  # [K]
        b_ref = tl.where(in_b, b_r[:, None], 0.0)
        b_eh = tl.exp2(b_G - b_ref)
        b_eih = tl.exp2(b_ref - b_G)
        b_ear = tl.where(in_b, 0.0, tl.exp2(b_r[:, None] - b_G))
        b_kiar = _bf(b_kn * b_ear)
    else:
        b_eh = b_e
        b_eih = tl.exp2(-b_G)
    b_kdh = _bf(b_kn * b_eh)
    b_kih = _bf(b_kn * b_eih)
    b_qdh = _bf(b_qn * b_eh * scale)

    # -- L = strict(diag(beta) kd ki^T) and Mqk backwards, each [C, 128] product as its [128, C] transpose
    b_dLf = b_dL * b_b[:, None]
    if C > HALF:
        same = (o_c[:, None] // HALF) == (o_c[None, :] // HALF)
        off = (o_c[:, None] // HALF) > (o_c[None, :] // HALF)
        b_P = (tl.where(same, _dot(tl.trans(b_kdh), b_kih), 0.0)
               + tl.where(off, _dot(tl.trans(b_kdh), b_kiar), 0.0))
        b_Ls = _bf(tl.where(same, b_dLf, 0.0))
        b_Lo = _bf(tl.where(off, b_dLf, 0.0))
        b_Ms = _bf(tl.where(same, b_dMf, 0.0))
        b_Mo = _bf(tl.where(off, b_dMf, 0.0))
        b_dkdh = _dot(b_kih, tl.trans(b_Ls)) + _dot(b_kiar, tl.trans(b_Lo))  # [K, C]
        b_dkih = _dot(b_kdh, b_Ls) + _dot(b_qdh, b_Ms)
        b_dkiar = _dot(b_kdh, b_Lo) + _dot(b_qdh, b_Mo)
        b_dqdh = _dot(b_kih, tl.trans(b_Ms)) + _dot(b_kiar, tl.trans(b_Mo))
    else:
        b_P = _dot(tl.trans(b_kdh), b_kih)  # [C, C]
        b_dLb = _bf(b_dLf)
        b_dM = _bf(b_dMf)
        b_dkdh = _dot(b_kih, tl.trans(b_dLb))  # [K, C]
        b_dkih = _dot(b_kdh, b_dLb) + _dot(b_qdh, b_dM)
        b_dqdh = _dot(b_kih, tl.trans(b_dM))
    b_db += tl.sum(b_dL * b_P, 1)

    # -- the gate: dG per token from the bf16 factors, reverse cumsum across the tokens, the chunk-total term
    b_kdf = b_kd.to(tl.float32)
    b_qdf = b_qd.to(tl.float32)
    b_krf = b_kr.to(tl.float32)
    b_dGh = LN2 * (b_dkdh * b_kdh.to(tl.float32) + b_dqdh * b_qdh.to(tl.float32)
                   - b_dkih * b_kih.to(tl.float32))
    b_dG = b_dGh + LN2 * (b_dkd * b_kdf + b_dqd * b_qdf - b_dkr * b_krf)
    if C > HALF:  # the cross factor's own term, and r = G[15] that half B's factors and the cross one depend on
        b_dGar = LN2 * b_dkiar * b_kiar.to(tl.float32)
        b_adj = tl.sum(b_dGar, 1) - tl.sum(tl.where(in_b, b_dGh, 0.0), 1)  # [K]
        b_dG += tl.where(o_c[None, :] == HALF - 1, b_adj[:, None], 0.0) - b_dGar
    b_dGlast = LN2 * (tl.sum(b_dkr * b_krf, 1) + b_dglast * b_gl)  # [K]
    b_dgl = tl.cumsum(b_dG, 1, reverse=True) + b_dGlast[:, None]
    b_dx = b_dgl * (lower_bound * LOG2E) * b_sig * (1.0 - b_sig)
    b_dgate = b_dx * a
    alog_part = tl.sum(tl.where(m_kc, b_dx * b_x, 0.0), 1)
    dt_part = tl.sum(tl.where(m_kc, b_dgate, 0.0), 1)

    # -- the normed q, k, then the L2 norms backwards
    b_dkn = b_dkdh * b_eh + b_dkih * b_eih + b_dkd * b_e + b_dkr * b_er
    if C > HALF:
        b_dkn += b_dkiar * b_ear
    b_dqn = (b_dqdh * b_eh + b_dqd * b_e) * scale
    b_dq = (b_dqn - b_qn * tl.sum(b_dqn * b_qn, 0)[None, :]) * b_rq[None, :]
    b_dk = (b_dkn - b_kn * tl.sum(b_dkn * b_kn, 0)[None, :]) * b_rk[None, :]
    return b_dq, b_dk, b_dgate, b_db, alog_part, dt_part


@triton.jit
def kda_bwd_v2_local_fm_kernel(
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
    a, a2, b_dt = _gate_scalars(A_log, dt_bias, i_h, K, HAS_ALOG, HAS_DT)

    o_kv = o_k[:, None] * V + o_v[None, :]  # [K, V]
    b_S = tl.load(ckpt + (i_s.to(tl.int64) * HV + i_h) * K * V + o_kv).to(tl.float32)  # [K, V] entering
    acc_alog = tl.zeros([K], dtype=tl.float32)
    acc_dt = tl.zeros([K], dtype=tl.float32)
    for j in range(n_chunks):
        i_c = first + j
        o_t, m_c = _chunk_tokens(chunk_index, i_c, o_c)  # [C] token rows, valid tokens
        m_kc = m_c[None, :]
        p_hk = (o_t[None, :] * HV + i_h) * K + o_k[:, None]  # [K, C] token-major memory at the value head
        p_hv = (o_t[None, :] * HV + i_h) * V + o_v[:, None]  # [V, C]
        p_qk = (o_t[None, :] * HQ + i_hq) * K + o_k[:, None]  # [K, C] at the q/k head
        p_cc = (i_c.to(tl.int64) * HV + i_h) * C * C + o_c[:, None] * C + o_c[None, :]  # [C, C]

        # -- workspace, values, output gradient, state gradient leaving the chunk
        b_kd = _op(tl.load(kd + p_hk, mask=m_kc, other=0.0))  # [K, C]
        b_qd = _op(tl.load(qd + p_hk, mask=m_kc, other=0.0))
        b_kr = _op(tl.load(kr + p_hk, mask=m_kc, other=0.0))
        b_inv = _op(tl.load(inv + p_cc))  # [C, C], rows past the chunk's end zero
        b_mqk = _op(tl.load(mqk + p_cc))
        b_gl = tl.load(glast + (i_c.to(tl.int64) * HV + i_h) * K + o_k)  # [K] fp32, 2^Glast
        b_b = tl.load(bsig + o_t * HV + i_h, mask=m_c, other=0.0)  # [C] fp32 sigmoid(beta)
        b_v = tl.load(v + p_hv, mask=m_kc, other=0.0).to(tl.float32)  # [V, C]
        b_do = _op(tl.load(do + p_hv, mask=m_kc, other=0.0))  # [V, C]
        b_dS = _op(tl.load(ds + (i_c.to(tl.int64) * HV + i_h) * K * V + o_kv))  # [K, V]
        b_S0 = _bf(b_S)

        # -- K2's step again: W, U; then their gradients (the chunk's output and state terms), all [V or K, C]
        b_vu = b_v - _dot(tl.trans(b_S0), b_kd)  # [V, C]
        b_W = _bf(b_vu * b_b[None, :])
        b_U = _bf(_dot(b_W, tl.trans(b_inv)))  # [V, C]
        b_dU = _bf(_dot(b_do, b_mqk) + _dot(tl.trans(b_dS), b_kr))
        b_dW = _dot(b_dU, b_inv)  # [V, C] fp32
        b_dv = b_dW * b_b[None, :]
        b_db = tl.sum(b_dW * b_vu, 0)  # [C]
        b_du = _bf(-b_b[None, :] * b_dW)
        b_dL = _chain_dl(_bf(_dot(tl.trans(b_dU), b_W)), b_inv, strict)  # [C, C]
        b_dMf = tl.where(causal, _dot(tl.trans(b_do), b_U), 0.0)  # [C, C]
        b_dkr = _dot(b_dS, b_U)  # [K, C]
        b_dqd = _dot(b_S0, b_do)
        b_dkd = _dot(b_S0, b_du)
        b_dglast = tl.sum(b_S * b_dS.to(tl.float32), 1)  # [K]
        b_S = b_S * b_gl[:, None] + _dot(b_kr, tl.trans(b_U))  # the state entering the next chunk

        # -- K1 again from the raw inputs, backwards
        b_dq, b_dk, b_dgate, b_db, alog_part, dt_part = _k1_grads_fm(
            q, k, g, p_qk, p_hk, m_kc, a, a2, b_dt, scale, lower_bound,
            b_dL, b_dMf, b_dkd, b_dqd, b_dkr, b_dglast, b_db, b_kd, b_qd, b_kr, b_gl, b_b, C)
        acc_alog += alog_part
        acc_dt += dt_part

        tl.store(dq + p_hk, cast_for_store(b_dq, dq.dtype.element_ty), mask=m_kc)
        tl.store(dk + p_hk, cast_for_store(b_dk, dk.dtype.element_ty), mask=m_kc)
        tl.store(dv + p_hv, cast_for_store(b_dv, dv.dtype.element_ty), mask=m_kc)
        tl.store(dg + p_hk, cast_for_store(b_dgate, dg.dtype.element_ty), mask=m_kc)
        tl.store(dbeta + o_t * HV + i_h, cast_for_store(b_db * b_b * (1.0 - b_b), dbeta.dtype.element_ty), mask=m_c)

    o_part = (i_s.to(tl.int64) * HV + i_h) * K + o_k
    tl.store(part_alog + o_part, acc_alog)
    tl.store(part_dt + o_part, acc_dt)
