"""B3 of the v2 backward as one Triton kernel: the chunk-local gradients from the checkpoints and B2's state
gradients, 16- or 32-token chunks, K = V = 128.

One program per (checkpoint segment, value head). It loads the segment's checkpoint (the state entering its first
chunk), walks the segment's chunks forward recomputing the state (K2's step) and per chunk turns the state entering
it, the state gradient leaving it (B2's ``ds``), the workspace and ``v, do`` into ``dv, dbeta`` and the gradients
of the raw ``q, k, g`` (K1 backwards, `local_grad_ops._k1_grads`), with the algebra and roundings of
``emulate._local_grads``: every product from bf16 operands with fp32 accumulation, its result rounded to bf16 where
it is another product's operand, the chain ``(I + L)^-1`` gradient ``INV^T (dU W^T) INV^T`` with its second product
in fp32 as the emulation; the gate gradient takes the bf16 factors that entered the products. At 32-token chunks
K1's factors are rebuilt by 16-token halves as ``fwd.v2.emulate32`` builds them (half B relative to ``r = G[15]``,
the cross block through ``k_A 2^(r - G_A)``), and the dependence on ``r`` adds its terms to token 15, as
``emulate._local_grads``.

Outputs per token: ``dq, dk`` at the value head (fp32 for GVA, summed over value heads after; else in q's dtype),
``dv, dg, dbeta`` in the inputs' dtypes, and per program fp32 partial sums over the segment's tokens of ``dx * x``
(``A_log``) and of ``dg`` (``dt_bias``), ``[NSEG, HV, K]`` each, reduced after.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashkda.bwd.v2.local_grad_ops import _bf, _chain_dl, _chunk_tokens, _dot, _gate_scalars, _k1_grads, _op
from flashkda.rounding import cast_for_store


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
    a, a2, b_dt = _gate_scalars(A_log, dt_bias, i_h, K, HAS_ALOG, HAS_DT)

    o_kv = o_k[:, None] * V + o_v[None, :]  # [K, V]
    b_S = tl.load(ckpt + (i_s.to(tl.int64) * HV + i_h) * K * V + o_kv).to(tl.float32)  # [K, V] entering
    acc_alog = tl.zeros([K], dtype=tl.float32)
    acc_dt = tl.zeros([K], dtype=tl.float32)
    for j in range(n_chunks):
        i_c = first + j
        o_t, m_c = _chunk_tokens(chunk_index, i_c, o_c)  # [C] token rows, valid tokens
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
        b_dL = _chain_dl(_bf(_dot(b_dU, tl.trans(b_W))), b_inv, strict)  # [C, C]
        b_dMf = tl.where(causal, _dot(b_do, tl.trans(b_U)), 0.0)  # [C, C]
        b_dkr = _dot(b_U, tl.trans(b_dS))  # [C, K]
        b_dqd = _dot(b_do, tl.trans(b_S0))
        b_dkd = _dot(b_du, tl.trans(b_S0))
        b_dglast = tl.sum(b_S * b_dS.to(tl.float32), 1)  # [K]
        b_S = b_S * b_gl[:, None] + _dot(tl.trans(b_kr), b_U)  # the state entering the next chunk

        # -- K1 again from the raw inputs, backwards
        b_dq, b_dk, b_dgate, b_db, alog_part, dt_part = _k1_grads(
            q, k, g, p_qk, p_hk, m_ck, a, a2, b_dt, scale, lower_bound,
            b_dL, b_dMf, b_dkd, b_dqd, b_dkr, b_dglast, b_db, b_kd, b_qd, b_kr, b_gl, b_b, C)
        acc_alog += alog_part
        acc_dt += dt_part

        tl.store(dq + p_hk, cast_for_store(b_dq, dq.dtype.element_ty), mask=m_ck)
        tl.store(dk + p_hk, cast_for_store(b_dk, dk.dtype.element_ty), mask=m_ck)
        tl.store(dv + p_hv, cast_for_store(b_dv, dv.dtype.element_ty), mask=m_ck)
        tl.store(dg + p_hk, cast_for_store(b_dgate, dg.dtype.element_ty), mask=m_ck)
        tl.store(dbeta + o_t * HV + i_h, cast_for_store(b_db * b_b * (1.0 - b_b), dbeta.dtype.element_ty), mask=m_c)

    o_part = (i_s.to(tl.int64) * HV + i_h) * K + o_k
    tl.store(part_alog + o_part, acc_alog)
    tl.store(part_dt + o_part, acc_dt)
