"""The Triton helpers of B3's kernels (`local_split_kernel`): bf16
operand rounding that means the same on the GPU and in the interpreter, the ``(I + L)^-1`` chain's gradient, and
K1 backwards for one chunk (rebuild K1's factors from the raw ``q, k, g``, then the ``L``/``Mqk`` products, the gate
with its reverse cumsum and the L2 norms backwards), with the algebra and roundings of ``emulate._local_grads``.
`benchmarks/kda/v2_compile_local.py` loads them by path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashkda.rounding import INTERPRET, PREC_HILO, operand_split, round_bf16

LOG2E = tl.constexpr(1.4426950408889634)  # 1/ln(2)
LN2 = tl.constexpr(0.6931471805599453)
#: Tokens per half of a 32-token chunk (K1 builds its factors by halves there).
HALF = tl.constexpr(16)
#: `operand_split`'s precision where a product takes an operand as two bf16 parts (value and remainder).
HILO = tl.constexpr(PREC_HILO)


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
def _chunk_tokens(chunk_index, i_c, o_c):
    """Chunk ``i_c``'s token rows ``[C]`` int64 (``o_c`` = ``arange(C)`` from its first row) and the mask of its
    valid tokens ``[C]`` (`flashkda.fwd.v2.workspace` ``chunk_index``)."""
    row0 = tl.load(chunk_index + i_c * 3 + 1)
    n_valid = tl.load(chunk_index + i_c * 3 + 2)
    m_c = o_c < n_valid
    return (row0 + o_c).to(tl.int64), m_c


@triton.jit
def _gate_scalars(A_log, dt_bias, i_h, K: tl.constexpr, HAS_ALOG: tl.constexpr, HAS_DT: tl.constexpr):
    """``(exp(A_log), the same through exp2, dt_bias [K])`` of value head ``i_h`` (1, 1, 0 when absent)."""
    if HAS_ALOG:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        a2 = tl.exp2(tl.load(A_log + i_h).to(tl.float32) * LOG2E)
    else:
        a = 1.0
        a2 = 1.0
    if HAS_DT:
        b_dt = tl.load(dt_bias + i_h * K + tl.arange(0, K)).to(tl.float32)  # [K]
    else:
        b_dt = tl.zeros([K], dtype=tl.float32)
    return a, a2, b_dt


@triton.jit
def _chain_dl(b_X, b_inv, strict):
    """The gradient of strict ``L`` through ``(I + L)^-1``: ``-INV^T X INV^T`` from ``X = bf16(dU W^T)`` [C, C], its
    second product in fp32 as the emulation."""
    b_Y = _dot(tl.trans(b_inv), b_X)
    b_dL = -tl.dot(b_Y, tl.trans(b_inv.to(tl.float32)), input_precision="ieee")
    return tl.where(strict, b_dL, 0.0)


@triton.jit
def _k1_grads(q, k, g, p_qk, p_hk, m_ck, a, a2, b_dt, scale, lower_bound,
              b_dL, b_dMf, b_dkd, b_dqd, b_dkr, b_dglast, b_db, b_kd, b_qd, b_kr, b_gl, b_b,
              C: tl.constexpr):
    """K1 backwards for one chunk at one value head.

    Args: the raw ``q, k`` (at ``p_qk``) and ``g`` (at ``p_hk``), rows masked by ``m_ck`` [C, 1]; the gate's
    ``exp(A_log)`` twice and ``dt_bias`` [K]; the gradients reaching K1's outputs: strict ``dL`` and causal ``dMf``
    [C, C] fp32 (``beta`` not yet applied to ``dL``; ``dMf`` enters its products as two bf16 operands, value and
    remainder), ``dkd, dqd, dkr`` [C, K] fp32, ``dglast`` [K] (of the state
    decay ``2^Glast``), ``db`` [C] (``beta``'s from ``W``); the workspace's ``kd, qd, kr`` [C, K] operands,
    ``2^Glast`` [K] and ``sigmoid(beta)`` [C].

    Returns: ``(dq, dk, dgate)`` [C, K] fp32 (rows past the chunk's end not meaningful), ``db`` [C] with the ``L``
    term, and this chunk's ``sum dx * x`` and ``sum dgate`` [K] (``A_log`` and ``dt_bias`` partials).
    """
    o_c = tl.arange(0, C)
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
        b_Ms, b_Msr = operand_split(tl.where(same, b_dMf, 0.0), HILO, INTERPRET)
        b_Mo, b_Mor = operand_split(tl.where(off, b_dMf, 0.0), HILO, INTERPRET)
        b_dkdh = _dot(b_Ls, b_kih) + _dot(b_Lo, b_kiar)  # [C, K]
        b_dkih = _dot(tl.trans(b_Ls), b_kdh) + _dot(tl.trans(b_Ms), b_qdh) + _dot(tl.trans(b_Msr), b_qdh)
        b_dkiar = _dot(tl.trans(b_Lo), b_kdh) + _dot(tl.trans(b_Mo), b_qdh) + _dot(tl.trans(b_Mor), b_qdh)
        b_dqdh = _dot(b_Ms, b_kih) + _dot(b_Msr, b_kih) + _dot(b_Mo, b_kiar) + _dot(b_Mor, b_kiar)
    else:
        b_P = _dot(b_kdh, tl.trans(b_kih))  # [C, C]
        b_dLb = _bf(b_dLf)
        b_dM, b_dMr = operand_split(b_dMf, HILO, INTERPRET)
        b_dkdh = _dot(b_dLb, b_kih)  # [C, K]
        b_dkih = _dot(tl.trans(b_dLb), b_kdh) + _dot(tl.trans(b_dM), b_qdh) + _dot(tl.trans(b_dMr), b_qdh)
        b_dqdh = _dot(b_dM, b_kih) + _dot(b_dMr, b_kih)
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
    alog_part = tl.sum(tl.where(m_ck, b_dx * b_x, 0.0), 0)
    dt_part = tl.sum(tl.where(m_ck, b_dgate, 0.0), 0)

    # -- the normed q, k, then the L2 norms backwards
    b_dkn = b_dkdh * b_eh + b_dkih * b_eih + b_dkd * b_e + b_dkr * b_er
    if C > HALF:
        b_dkn += b_dkiar * b_ear
    b_dqn = (b_dqdh * b_eh + b_dqd * b_e) * scale
    b_dq = (b_dqn - b_qn * tl.sum(b_dqn * b_qn, 1)[:, None]) * b_rq[:, None]
    b_dk = (b_dkn - b_kn * tl.sum(b_dkn * b_kn, 1)[:, None]) * b_rk[:, None]
    return b_dq, b_dk, b_dgate, b_db, alog_part, dt_part
