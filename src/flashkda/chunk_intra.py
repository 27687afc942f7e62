"""Intra-chunk stage: one program per (chunk, value head) does all the work that needs no recurrent state.

Fused in one pass over the chunk (``BT = 64`` tokens as four ``BC = 16`` sub-chunks): gate activation and the
in-chunk cumulative sum ``Γ``, q/k L2 norm, beta sigmoid, the strictly-lower ``L = β ⊙ (k kᵀ ⊙ e^{Γ_i-Γ_j})``
and causal ``Aqk = (q kᵀ ⊙ e^{Γ_i-Γ_j})``, the block solve ``(I + L)⁻¹`` and the WY factors
``w = (I + L)⁻¹ (β k e^Γ)``, ``u = (I + L)⁻¹ (β v)``. Outputs for the state stage: ``w``, ``u``,
``qg = scale q e^Γ``, ``kg = k e^{Γ_C - Γ}``, ``Aqk`` (lower triangle only) and ``Γ_C`` per chunk.

Numerics: every ``e^{Γ_i - Γ_j}`` with ``i`` and ``j`` in different sub-chunks is factored through the cumulative
gate at the end of ``j``'s sub-chunk, so both factors are ``<= 1`` (no overflow for any gate ``<= 0``). Inside a
sub-chunk the bounded gate (``safe_gate``, ``g >= -5``) factors through the sub-chunk start (``<= e^80``, inside
fp32 range) and uses tensor cores; any other gate is computed pair by pair, exactly.

Traffic per (chunk, head), bf16 in/out with K = V = 128: reads q, k, v, g (64 KiB) and writes w, u, qg, kg, Aqk
(74 KiB); the stage is bound by HBM bandwidth when enough (chunk, head) programs run.
"""

import torch
import triton
import triton.language as tl

from flashkda.ops import beta_map, kda_gate, l2norm_rows

#: Tokens per chunk and per sub-chunk; the kernel is written out for exactly four sub-chunks.
CHUNK_SIZE = 64
SUB_CHUNK = 16


@triton.jit
def _gate_block(g, dt_bias_row, b_A, lower_bound, t0, a, eos, i_hv, HV: tl.constexpr, K: tl.constexpr,
                BC: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr, HAS_A: tl.constexpr,
                USE_LOWER_BOUND: tl.constexpr):
    o_t = t0 + a * BC + tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m = (o_t < eos)[:, None] & (o_k < K)[None, :]
    # [BC, BK]
    b_g = tl.load(g + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if USE_GATE:
        b_g = kda_gate(b_g, dt_bias_row[None, :], b_A, lower_bound, HAS_A, USE_LOWER_BOUND)
    # Padded rows must not decay the state, whatever the activation of 0 is.
    return tl.where(m, b_g, 0.0)


@triton.jit
def _row_block(q, k, v, g, beta, w, u, qg, kg, dt_bias_row, b_A, lower_bound, scale, t0, a, eos, i_h, i_hv,
               b_c, b_s, b_tail, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_GATE: tl.constexpr,
               HAS_A: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr,
               BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr, SAFE_GATE: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """Loads sub-chunk ``a``, stores its qg/kg and the WY right-hand sides, returns its row operands."""
    o_i = tl.arange(0, BC)
    o_t = t0 + a * BC + o_i
    m_t = o_t < eos
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    # [BC, BK]
    b_q = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    if USE_L2NORM:
        b_q = l2norm_rows(b_q)
        b_k = l2norm_rows(b_k)
    b_q = b_q * scale
    b_g = _gate_block(g, dt_bias_row, b_A, lower_bound, t0, a, eos, i_hv, HV, K, BC, BK, USE_GATE, HAS_A,
                      USE_LOWER_BOUND)
    # [BC, BK] cumulative gate from the sub-chunk start. Exponents are always formed from these local sums and
    # from sums of whole sub-chunks, never as differences of chunk-level cumulative sums, which lose ~1e-5 of
    # relative precision in fp32 once a few large gates have pushed the running sum into the hundreds.
    b_G = tl.cumsum(b_g, 0)
    # [BC]
    b_b = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.where(m_t, beta_map(b_b, BETA_SIGMOID, ALLOW_NEG_EIGVAL), 0.0)
    # [BC, BV]
    b_v = tl.load(v + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)

    p_k = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    b_eG = tl.exp(b_c[None, :] + b_G)
    tl.store(qg + p_k, (b_q * b_eG).to(qg.dtype.element_ty), mask=m_tk)
    tl.store(kg + p_k, (b_k * tl.exp(b_tail[None, :] - b_G)).to(kg.dtype.element_ty), mask=m_tk)
    # Right-hand sides of the WY solve; pass 2 of the kernel overwrites them with w and u.
    tl.store(w + p_k, (b_k * b_eG * b_b[:, None]).to(w.dtype.element_ty), mask=m_tk)
    tl.store(u + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], (b_v * b_b[:, None]).to(u.dtype.element_ty),
             mask=m_tv)

    # Row operands relative to the sub-chunk start (factors <= 1).
    b_eGr = tl.exp(b_G)
    b_qr = b_q * b_eGr
    b_kr = b_k * b_eGr
    # Column operand for later sub-chunks, relative to this sub-chunk's end (factors <= 1).
    b_kcol = b_k * tl.exp(b_s[None, :] - b_G)

    m_lower = o_i[:, None] >= o_i[None, :]
    m_strict = o_i[:, None] > o_i[None, :]
    if SAFE_GATE:
        # Bounded gate: e^{-G} <= e^{16 * 5} stays in fp32/bf16 range, so one tensor-core product suffices.
        b_kc = b_k * tl.exp(-b_G)
        b_Aqk = tl.dot(b_qr, tl.trans(b_kc), input_precision=DOT_PREC)
        b_Akk = tl.dot(b_kr, tl.trans(b_kc), input_precision=DOT_PREC)
    else:
        b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
        b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(BC):
            m_j = o_i == j
            b_kj = tl.sum(tl.where(m_j[:, None], b_k, 0.0), 0)
            b_gj = tl.sum(tl.where(m_j[:, None], b_G, 0.0), 0)
            # [BC, BK] exact e^{Γ_i - Γ_j} for i >= j, zero above
            b_d = tl.exp(tl.where((o_i >= j)[:, None], b_G - b_gj[None, :], float("-inf")))
            b_kd = b_kj[None, :] * b_d
            b_Aqk += tl.where(m_j[None, :], tl.sum(b_q * b_kd, 1)[:, None], 0.0)
            b_Akk += tl.where(m_j[None, :], tl.sum(b_k * b_kd, 1)[:, None], 0.0)
    b_Aqk = tl.where(m_lower, b_Aqk, 0.0)
    b_L = tl.where(m_strict, b_Akk, 0.0) * b_b[:, None]
    return b_qr, b_kr, b_kcol, b_b, b_Aqk, b_L, o_t, m_t


@triton.jit
def _off_diag(b_qr, b_kr, b_b, b_gap, b_kcol, DOT_PREC: tl.constexpr):
    """Aqk and L between row sub-chunk a and an earlier column sub-chunk b (b_gap: gate sum strictly between)."""
    b_s = tl.exp(b_gap)[None, :]
    b_Aqk = tl.dot(b_qr * b_s, tl.trans(b_kcol), input_precision=DOT_PREC)
    b_L = tl.dot(b_kr * b_s, tl.trans(b_kcol), input_precision=DOT_PREC) * b_b[:, None]
    return b_Aqk, b_L


@triton.jit
def _store_A(Aqk, b_A, o_t, m_t, i_hv, b, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    o_c = b * BC + tl.arange(0, BC)
    tl.store(Aqk + (o_t[:, None] * HV + i_hv) * BT + o_c[None, :], b_A.to(Aqk.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _inv_unit_lower(b_L, BC: tl.constexpr):
    """(I + L)⁻¹ of a strictly lower ``[BC, BC]`` block, row by row (x_i = e_i - Σ_j L_ij x_j)."""
    o_i = tl.arange(0, BC)
    b_X = tl.zeros([BC, BC], dtype=tl.float32)
    for i in range(BC):
        m_i = o_i == i
        b_li = tl.sum(tl.where(m_i[:, None], b_L, 0.0), 0)
        b_xi = tl.where(m_i, 1.0, 0.0) - tl.sum(b_li[:, None] * b_X, 0)
        b_X = tl.where(m_i[:, None], b_xi[None, :], b_X)
    return b_X


@triton.jit
def _wy_rows(w, u, t0, a, eos, i_hv, b_T0, b_T1, b_T2, b_T3, NB: tl.constexpr, HV: tl.constexpr,
             K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             DOT_PREC: tl.constexpr):
    """w_a = Σ_{b<=a} T_ab rhs_b for the NB = a + 1 blocks of row sub-chunk a, written over rhs_a."""
    o_i = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    b_w = tl.zeros([BC, BK], dtype=tl.float32)
    b_u = tl.zeros([BC, BV], dtype=tl.float32)
    for b in tl.static_range(NB):
        if b == 0:
            b_T = b_T0
        elif b == 1:
            b_T = b_T1
        elif b == 2:
            b_T = b_T2
        else:
            b_T = b_T3
        o_t = t0 + b * BC + o_i
        m_t = o_t < eos
        b_rk = tl.load(w + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :],
                       other=0.0).to(tl.float32)
        b_rv = tl.load(u + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :],
                       other=0.0).to(tl.float32)
        b_w += tl.dot(b_T, b_rk, input_precision=DOT_PREC)
        b_u += tl.dot(b_T, b_rv, input_precision=DOT_PREC)
    tl.debug_barrier()
    o_t = t0 + a * BC + o_i
    m_t = o_t < eos
    tl.store(w + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], b_w.to(w.dtype.element_ty),
             mask=m_t[:, None] & (o_k < K)[None, :])
    tl.store(u + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_u.to(u.dtype.element_ty),
             mask=m_t[:, None] & (o_v < V)[None, :])


@triton.jit(do_not_specialize=["T", "lower_bound", "scale"])
def chunk_kda_fwd_kernel_intra(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, chunk_map,
    w, u, qg, kg, Aqk, gC,
    scale, lower_bound, T, NTS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
    SAFE_GATE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tl.static_assert(BT == 4 * BC, "the kernel is written out for four sub-chunks")
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_n = tl.load(chunk_map + i_c)
        if i_n < 0:
            return
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_j = i_c - tl.load(chunk_offsets + i_n)
    else:
        i_n = i_c // NTS
        i_j = i_c % NTS
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    t0 = bos + i_j.to(tl.int64) * BT

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if HAS_BIAS:
        b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    else:
        b_bias = tl.zeros([BK], dtype=tl.float32)
    if HAS_A:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
    else:
        b_A = 0.0

    # Gate sums of the four sub-chunks; boundaries and gaps are built from these (see _row_block).
    b_s0 = tl.sum(_gate_block(g, b_bias, b_A, lower_bound, t0, 0, eos, i_hv, HV, K, BC, BK, USE_GATE, HAS_A,
                              USE_LOWER_BOUND), 0)
    b_s1 = tl.sum(_gate_block(g, b_bias, b_A, lower_bound, t0, 1, eos, i_hv, HV, K, BC, BK, USE_GATE, HAS_A,
                              USE_LOWER_BOUND), 0)
    b_s2 = tl.sum(_gate_block(g, b_bias, b_A, lower_bound, t0, 2, eos, i_hv, HV, K, BC, BK, USE_GATE, HAS_A,
                              USE_LOWER_BOUND), 0)
    b_s3 = tl.sum(_gate_block(g, b_bias, b_A, lower_bound, t0, 3, eos, i_hv, HV, K, BC, BK, USE_GATE, HAS_A,
                              USE_LOWER_BOUND), 0)
    b_zero = tl.zeros([BK], dtype=tl.float32)
    tl.store(gC + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, b_s0 + b_s1 + b_s2 + b_s3, mask=m_k)

    # Pass 1: sub-chunk by sub-chunk, diagonal and off-diagonal blocks of Aqk (stored) and L (kept).
    b_qr0, b_kr0, b_kc0, b_b0, b_A00, b_L00, o_t0, m_t0 = _row_block(
        q, k, v, g, beta, w, u, qg, kg, b_bias, b_A, lower_bound, scale, t0, 0, eos, i_h, i_hv, b_zero, b_s0, b_s0 + b_s1 + b_s2 + b_s3,
        H, HV, K, V, BC, BK, BV, USE_GATE, HAS_A, USE_LOWER_BOUND, USE_L2NORM, BETA_SIGMOID, ALLOW_NEG_EIGVAL,
        SAFE_GATE, DOT_PREC)
    _store_A(Aqk, b_A00, o_t0, m_t0, i_hv, 0, HV, BT, BC)

    b_qr1, b_kr1, b_kc1, b_b1, b_A11, b_L11, o_t1, m_t1 = _row_block(
        q, k, v, g, beta, w, u, qg, kg, b_bias, b_A, lower_bound, scale, t0, 1, eos, i_h, i_hv, b_s0, b_s1, b_s1 + b_s2 + b_s3,
        H, HV, K, V, BC, BK, BV, USE_GATE, HAS_A, USE_LOWER_BOUND, USE_L2NORM, BETA_SIGMOID, ALLOW_NEG_EIGVAL,
        SAFE_GATE, DOT_PREC)
    b_A10, b_L10 = _off_diag(b_qr1, b_kr1, b_b1, b_zero, b_kc0, DOT_PREC)
    _store_A(Aqk, b_A10, o_t1, m_t1, i_hv, 0, HV, BT, BC)
    _store_A(Aqk, b_A11, o_t1, m_t1, i_hv, 1, HV, BT, BC)

    b_qr2, b_kr2, b_kc2, b_b2, b_A22, b_L22, o_t2, m_t2 = _row_block(
        q, k, v, g, beta, w, u, qg, kg, b_bias, b_A, lower_bound, scale, t0, 2, eos, i_h, i_hv, b_s0 + b_s1, b_s2, b_s2 + b_s3,
        H, HV, K, V, BC, BK, BV, USE_GATE, HAS_A, USE_LOWER_BOUND, USE_L2NORM, BETA_SIGMOID, ALLOW_NEG_EIGVAL,
        SAFE_GATE, DOT_PREC)
    b_A20, b_L20 = _off_diag(b_qr2, b_kr2, b_b2, b_s1, b_kc0, DOT_PREC)
    b_A21, b_L21 = _off_diag(b_qr2, b_kr2, b_b2, b_zero, b_kc1, DOT_PREC)
    _store_A(Aqk, b_A20, o_t2, m_t2, i_hv, 0, HV, BT, BC)
    _store_A(Aqk, b_A21, o_t2, m_t2, i_hv, 1, HV, BT, BC)
    _store_A(Aqk, b_A22, o_t2, m_t2, i_hv, 2, HV, BT, BC)

    b_qr3, b_kr3, b_kc3, b_b3, b_A33, b_L33, o_t3, m_t3 = _row_block(
        q, k, v, g, beta, w, u, qg, kg, b_bias, b_A, lower_bound, scale, t0, 3, eos, i_h, i_hv, b_s0 + b_s1 + b_s2, b_s3, b_s3,
        H, HV, K, V, BC, BK, BV, USE_GATE, HAS_A, USE_LOWER_BOUND, USE_L2NORM, BETA_SIGMOID, ALLOW_NEG_EIGVAL,
        SAFE_GATE, DOT_PREC)
    b_A30, b_L30 = _off_diag(b_qr3, b_kr3, b_b3, b_s1 + b_s2, b_kc0, DOT_PREC)
    b_A31, b_L31 = _off_diag(b_qr3, b_kr3, b_b3, b_s2, b_kc1, DOT_PREC)
    b_A32, b_L32 = _off_diag(b_qr3, b_kr3, b_b3, b_zero, b_kc2, DOT_PREC)
    _store_A(Aqk, b_A30, o_t3, m_t3, i_hv, 0, HV, BT, BC)
    _store_A(Aqk, b_A31, o_t3, m_t3, i_hv, 1, HV, BT, BC)
    _store_A(Aqk, b_A32, o_t3, m_t3, i_hv, 2, HV, BT, BC)
    _store_A(Aqk, b_A33, o_t3, m_t3, i_hv, 3, HV, BT, BC)

    # Block solve of (I + L)⁻¹: T_aa = (I + L_aa)⁻¹, T_ab = -T_aa Σ_{b<=c<a} L_ac T_cb.
    b_T00 = _inv_unit_lower(b_L00, BC)
    b_T11 = _inv_unit_lower(b_L11, BC)
    b_T22 = _inv_unit_lower(b_L22, BC)
    b_T33 = _inv_unit_lower(b_L33, BC)
    b_T10 = -tl.dot(b_T11, tl.dot(b_L10, b_T00, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_T21 = -tl.dot(b_T22, tl.dot(b_L21, b_T11, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_T20 = -tl.dot(b_T22, tl.dot(b_L20, b_T00, input_precision=DOT_PREC)
                    + tl.dot(b_L21, b_T10, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_T32 = -tl.dot(b_T33, tl.dot(b_L32, b_T22, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_T31 = -tl.dot(b_T33, tl.dot(b_L31, b_T11, input_precision=DOT_PREC)
                    + tl.dot(b_L32, b_T21, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_T30 = -tl.dot(b_T33, tl.dot(b_L30, b_T00, input_precision=DOT_PREC)
                    + tl.dot(b_L31, b_T10, input_precision=DOT_PREC)
                    + tl.dot(b_L32, b_T20, input_precision=DOT_PREC), input_precision=DOT_PREC)

    # Pass 2: w and u, last sub-chunk first so each right-hand side is read before it is overwritten.
    tl.debug_barrier()
    _wy_rows(w, u, t0, 3, eos, i_hv, b_T30, b_T31, b_T32, b_T33, 4, HV, K, V, BC, BK, BV, DOT_PREC)
    _wy_rows(w, u, t0, 2, eos, i_hv, b_T20, b_T21, b_T22, b_T22, 3, HV, K, V, BC, BK, BV, DOT_PREC)
    _wy_rows(w, u, t0, 1, eos, i_hv, b_T10, b_T11, b_T11, b_T11, 2, HV, K, V, BC, BK, BV, DOT_PREC)
    _wy_rows(w, u, t0, 0, eos, i_hv, b_T00, b_T00, b_T00, b_T00, 1, HV, K, V, BC, BK, BV, DOT_PREC)


def chunk_kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_gate_in_kernel,
                        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                        index, work_dtype, dot_prec, num_warps=8):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT, BC = CHUNK_SIZE, SUB_CHUNK
    # qg, u and Aqk stay fp32: in bf16 each adds ~1.3e-3 RMS error to o (measured against fp64; qg up to 3e-3
    # when a large initial state dominates o), and the bf16 output rounding alone is ~3e-3 of the 5e-3 budget.
    # w and kg in work_dtype (bf16 for bf16 input) add less than 0.3e-3 together.
    w = torch.empty(B, T, HV, K, dtype=work_dtype, device=q.device)
    kg = torch.empty_like(w)
    qg = torch.empty(B, T, HV, K, dtype=torch.float32, device=q.device)
    u = torch.empty(B, T, HV, V, dtype=torch.float32, device=q.device)
    Aqk = torch.empty(B, T, HV, BT, dtype=torch.float32, device=q.device)
    gC = torch.empty(index.num_chunks, HV, K, dtype=torch.float32, device=q.device)
    if index.num_chunks > 0:
        # 8 warps: with 4 the compiled kernel spills ~2 KB a thread (255 registers, sm_90, K = V = 128).
        chunk_kda_fwd_kernel_intra[(index.num_chunks, HV)](
            q, k, v, g, beta, A_log, dt_bias, index.cu_seqlens, index.chunk_offsets, index.chunk_map,
            w, u, qg, kg, Aqk, gC,
            scale, 0.0 if lower_bound is None else float(lower_bound), T, index.chunks_per_seq,
            H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=max(16, triton.next_power_of_2(K)), BV=max(16, triton.next_power_of_2(V)),
            USE_GATE=use_gate_in_kernel, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None,
            USE_LOWER_BOUND=lower_bound is not None, USE_L2NORM=use_qk_l2norm_in_kernel,
            BETA_SIGMOID=use_beta_sigmoid_in_kernel, ALLOW_NEG_EIGVAL=allow_neg_eigval,
            SAFE_GATE=safe_gate, IS_VARLEN=index.is_varlen, DOT_PREC=dot_prec,
            num_warps=num_warps,
        )
    return w, u, qg, kg, Aqk, gC
