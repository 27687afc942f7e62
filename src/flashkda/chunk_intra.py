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

from flashkda.ops import L2NORM_EPS, beta_map, kda_gate

#: Tokens per chunk and per sub-chunk; the kernel is written out for exactly four sub-chunks.
CHUNK_SIZE = 64
SUB_CHUNK = 16
#: Width of the K and V slices the kernel walks (one slice of q/k/g/v live at a time).
SLICE = 32


@triton.jit
def _gate_block(g, b_bias, b_A, lower_bound, t0, a, eos, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr,
                BC: tl.constexpr, USE_GATE: tl.constexpr, HAS_A: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """Log-space gate of sub-chunk ``a`` on the channels ``o_k``: ``[BC, BKC]`` fp32, zero on padded rows."""
    o_t = t0 + a * BC + tl.arange(0, BC)
    m = (o_t < eos)[:, None] & (o_k < K)[None, :]
    # [BC, BKC]
    b_g = tl.load(g + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if USE_GATE:
        b_g = kda_gate(b_g, b_bias[None, :], b_A, lower_bound, HAS_A, USE_LOWER_BOUND)
    # Padded rows must not decay the state, whatever the activation of 0 is.
    return tl.where(m, b_g, 0.0)


@triton.jit
def _rows(x, t0, a, eos, i_x, o_c, NX: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """Loads rows of sub-chunk ``a`` of a ``[.., T, NX, C]`` tensor on the columns ``o_c`` as fp32."""
    o_t = t0 + a * BC + tl.arange(0, BC)
    m = (o_t < eos)[:, None] & (o_c < C)[None, :]
    return tl.load(x + (o_t[:, None] * NX + i_x) * C + o_c[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _put_rows(x, b_x, t0, a, eos, i_x, o_c, NX: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    o_t = t0 + a * BC + tl.arange(0, BC)
    m = (o_t < eos)[:, None] & (o_c < C)[None, :]
    tl.store(x + (o_t[:, None] * NX + i_x) * C + o_c[None, :], b_x.to(x.dtype.element_ty), mask=m)


@triton.jit
def _inv_norm(x, t0, a, eos, i_x, NX: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BKC: tl.constexpr,
              USE_L2NORM: tl.constexpr):
    """``[BC]`` reciprocal row norms ``1 / sqrt(|x|² + eps)`` of sub-chunk ``a`` (ones without the L2 norm)."""
    b_ss = tl.zeros([BC], dtype=tl.float32)
    if USE_L2NORM:
        for i_k in range(0, tl.cdiv(K, BKC)):
            b_x = _rows(x, t0, a, eos, i_x, i_k * BKC + tl.arange(0, BKC), NX, K, BC)
            b_ss += tl.sum(b_x * b_x, 1)
        return 1.0 / tl.sqrt(b_ss + L2NORM_EPS)
    else:
        return b_ss + 1.0


@triton.jit
def _row_slice(q, k, g, w, qg, kg, b_bias, b_A, lower_bound, b_rq, b_rk, b_b, b_c, b_tail, t0, a, eos, i_h,
               i_hv, o_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
               USE_GATE: tl.constexpr, HAS_A: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
               SAFE_GATE: tl.constexpr, DOT_PREC: tl.constexpr):
    """One K slice of sub-chunk ``a``: stores qg, kg and the w right-hand side; returns its row operands and the
    slice's contribution to the diagonal blocks of Aqk and Akk.

    ``b_c``: gate sum of the earlier sub-chunks; ``b_tail``: gate sum from this sub-chunk to the chunk end.
    """
    o_i = tl.arange(0, BC)
    # [BC, BKC]
    b_q = _rows(q, t0, a, eos, i_h, o_k, H, K, BC) * b_rq[:, None]
    b_k = _rows(k, t0, a, eos, i_h, o_k, H, K, BC) * b_rk[:, None]
    b_g = _gate_block(g, b_bias, b_A, lower_bound, t0, a, eos, i_hv, o_k, HV, K, BC, USE_GATE, HAS_A,
                      USE_LOWER_BOUND)
    # Cumulative gate from the sub-chunk start. Exponents are always formed from these local sums and from sums
    # of whole sub-chunks, never as differences of chunk-level cumulative sums, which lose ~1e-5 of relative
    # precision in fp32 once a few large gates have pushed the running sum into the hundreds.
    b_G = tl.cumsum(b_g, 0)
    b_eG = tl.exp(b_c[None, :] + b_G)
    _put_rows(qg, b_q * b_eG, t0, a, eos, i_hv, o_k, HV, K, BC)
    _put_rows(kg, b_k * tl.exp(b_tail[None, :] - b_G), t0, a, eos, i_hv, o_k, HV, K, BC)
    # Right-hand side of the WY solve for w; pass 2 of the kernel overwrites it with w.
    _put_rows(w, b_k * b_eG * b_b[:, None], t0, a, eos, i_hv, o_k, HV, K, BC)
    # Row operands relative to the sub-chunk start (factors <= 1).
    b_eGr = tl.exp(b_G)
    b_qr = b_q * b_eGr
    b_kr = b_k * b_eGr
    # Column operand for later sub-chunks, relative to this sub-chunk's end (factors <= 1).
    b_kcol = b_k * tl.exp(tl.sum(b_g, 0)[None, :] - b_G)
    if SAFE_GATE:
        # Bounded gate: e^{-G} <= e^{16 * 5} stays in fp32 range, so one tensor-core product suffices.
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
            # [BC, BKC] exact e^{Γ_i - Γ_j} for i >= j, zero above
            b_d = tl.exp(tl.where((o_i >= j)[:, None], b_G - b_gj[None, :], float("-inf")))
            b_kd = b_kj[None, :] * b_d
            b_Aqk += tl.where(m_j[None, :], tl.sum(b_q * b_kd, 1)[:, None], 0.0)
            b_Akk += tl.where(m_j[None, :], tl.sum(b_k * b_kd, 1)[:, None], 0.0)
    return b_qr, b_kr, b_kcol, b_Aqk, b_Akk


@triton.jit
def _off_diag(b_qr, b_kr, b_gap, b_kcol, DOT_PREC: tl.constexpr):
    """Aqk and Akk slices between row sub-chunk a and an earlier column sub-chunk b (b_gap: gate sum between)."""
    b_s = tl.exp(b_gap)[None, :]
    b_Aqk = tl.dot(b_qr * b_s, tl.trans(b_kcol), input_precision=DOT_PREC)
    b_Akk = tl.dot(b_kr * b_s, tl.trans(b_kcol), input_precision=DOT_PREC)
    return b_Aqk, b_Akk


@triton.jit
def _store_A(Aqk, b_A, t0, a, b, eos, i_hv, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    o_t = t0 + a * BC + tl.arange(0, BC)
    o_c = b * BC + tl.arange(0, BC)
    tl.store(Aqk + (o_t[:, None] * HV + i_hv) * BT + o_c[None, :], b_A.to(Aqk.dtype.element_ty),
             mask=(o_t < eos)[:, None])


@triton.jit
def _inv_unit_lower(b_L, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + L)⁻¹ of a strictly lower ``[BC, BC]`` block by the product form (I - L)(I + L²)(I + L⁴)(I + L⁸).

    L is nilpotent (L¹⁶ = 0 for BC = 16), so the product is exact in exact arithmetic: six small tensor-core
    products instead of sixteen dependent row steps with a cross-thread reduction each.
    """
    tl.static_assert(BC == 16, "the product form is written out for 16 x 16 blocks")
    o_i = tl.arange(0, BC)
    b_X = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0) - b_L
    b_P = tl.dot(b_L, b_L, input_precision=PREC)
    b_X += tl.dot(b_X, b_P, input_precision=PREC)
    b_P = tl.dot(b_P, b_P, input_precision=PREC)
    b_X += tl.dot(b_X, b_P, input_precision=PREC)
    b_P = tl.dot(b_P, b_P, input_precision=PREC)
    b_X += tl.dot(b_X, b_P, input_precision=PREC)
    return b_X


@triton.jit
def _wy_slice(b_r0, b_r1, b_r2, b_r3, b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33,
              DOT_PREC: tl.constexpr):
    """Row blocks of T r for the block lower-triangular T and the four right-hand-side blocks of one slice."""
    b_x0 = tl.dot(b_T00, b_r0, input_precision=DOT_PREC)
    b_x1 = tl.dot(b_T10, b_r0, input_precision=DOT_PREC) + tl.dot(b_T11, b_r1, input_precision=DOT_PREC)
    b_x2 = (tl.dot(b_T20, b_r0, input_precision=DOT_PREC) + tl.dot(b_T21, b_r1, input_precision=DOT_PREC)
            + tl.dot(b_T22, b_r2, input_precision=DOT_PREC))
    b_x3 = (tl.dot(b_T30, b_r0, input_precision=DOT_PREC) + tl.dot(b_T31, b_r1, input_precision=DOT_PREC)
            + tl.dot(b_T32, b_r2, input_precision=DOT_PREC) + tl.dot(b_T33, b_r3, input_precision=DOT_PREC))
    return b_x0, b_x1, b_x2, b_x3


@triton.jit(do_not_specialize=["T", "lower_bound", "scale"])
def chunk_kda_fwd_kernel_intra(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, chunk_map,
    w, u, qg, kg, Aqk, gC,
    scale, lower_bound, T, NTS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BKC: tl.constexpr, BVC: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
    SAFE_GATE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr,
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
    o_i = tl.arange(0, BC)
    if HAS_A:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
    else:
        b_A = 0.0

    # [BC] per sub-chunk: reciprocal L2 norms of q (with the scale) and k, and the activated beta.
    b_rq0 = _inv_norm(q, t0, 0, eos, i_h, H, K, BC, BKC, USE_L2NORM) * scale
    b_rq1 = _inv_norm(q, t0, 1, eos, i_h, H, K, BC, BKC, USE_L2NORM) * scale
    b_rq2 = _inv_norm(q, t0, 2, eos, i_h, H, K, BC, BKC, USE_L2NORM) * scale
    b_rq3 = _inv_norm(q, t0, 3, eos, i_h, H, K, BC, BKC, USE_L2NORM) * scale
    b_rk0 = _inv_norm(k, t0, 0, eos, i_h, H, K, BC, BKC, USE_L2NORM)
    b_rk1 = _inv_norm(k, t0, 1, eos, i_h, H, K, BC, BKC, USE_L2NORM)
    b_rk2 = _inv_norm(k, t0, 2, eos, i_h, H, K, BC, BKC, USE_L2NORM)
    b_rk3 = _inv_norm(k, t0, 3, eos, i_h, H, K, BC, BKC, USE_L2NORM)
    b_b0 = beta_map(tl.load(beta + (t0 + o_i) * HV + i_hv, mask=t0 + o_i < eos, other=0.0).to(tl.float32),
                    BETA_SIGMOID, ALLOW_NEG_EIGVAL)
    b_b0 = tl.where(t0 + o_i < eos, b_b0, 0.0)
    b_b1 = beta_map(tl.load(beta + (t0 + BC + o_i) * HV + i_hv, mask=t0 + BC + o_i < eos, other=0.0)
                    .to(tl.float32), BETA_SIGMOID, ALLOW_NEG_EIGVAL)
    b_b1 = tl.where(t0 + BC + o_i < eos, b_b1, 0.0)
    b_b2 = beta_map(tl.load(beta + (t0 + 2 * BC + o_i) * HV + i_hv, mask=t0 + 2 * BC + o_i < eos, other=0.0)
                    .to(tl.float32), BETA_SIGMOID, ALLOW_NEG_EIGVAL)
    b_b2 = tl.where(t0 + 2 * BC + o_i < eos, b_b2, 0.0)
    b_b3 = beta_map(tl.load(beta + (t0 + 3 * BC + o_i) * HV + i_hv, mask=t0 + 3 * BC + o_i < eos, other=0.0)
                    .to(tl.float32), BETA_SIGMOID, ALLOW_NEG_EIGVAL)
    b_b3 = tl.where(t0 + 3 * BC + o_i < eos, b_b3, 0.0)

    # Pass 1, K slice by K slice (every exponent is per channel, so the [BC, BC] blocks are sums over slices and
    # only one slice of q/k/g is live at a time): Aqk and Akk blocks accumulate; qg, kg, the w right-hand side
    # and Γ_C are stored slice by slice.
    b_A00 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A10 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A11 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A20 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A22 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A30 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A31 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A32 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A33 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L00 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L10 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L11 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L20 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L22 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L30 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L31 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L32 = tl.zeros([BC, BC], dtype=tl.float32)
    b_L33 = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BKC)):
        o_k = i_k * BKC + tl.arange(0, BKC)
        if HAS_BIAS:
            b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)
        else:
            b_bias = tl.zeros([BKC], dtype=tl.float32)
        # [BKC] gate sums of the four sub-chunks; boundaries and gaps are built from these.
        b_s0 = tl.sum(_gate_block(g, b_bias, b_A, lower_bound, t0, 0, eos, i_hv, o_k, HV, K, BC, USE_GATE, HAS_A,
                                  USE_LOWER_BOUND), 0)
        b_s1 = tl.sum(_gate_block(g, b_bias, b_A, lower_bound, t0, 1, eos, i_hv, o_k, HV, K, BC, USE_GATE, HAS_A,
                                  USE_LOWER_BOUND), 0)
        b_s2 = tl.sum(_gate_block(g, b_bias, b_A, lower_bound, t0, 2, eos, i_hv, o_k, HV, K, BC, USE_GATE, HAS_A,
                                  USE_LOWER_BOUND), 0)
        b_s3 = tl.sum(_gate_block(g, b_bias, b_A, lower_bound, t0, 3, eos, i_hv, o_k, HV, K, BC, USE_GATE, HAS_A,
                                  USE_LOWER_BOUND), 0)
        b_zero = tl.zeros([BKC], dtype=tl.float32)
        tl.store(gC + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, b_s0 + b_s1 + b_s2 + b_s3, mask=o_k < K)

        b_qr, b_kr, b_kc0, b_dq, b_dk = _row_slice(
            q, k, g, w, qg, kg, b_bias, b_A, lower_bound, b_rq0, b_rk0, b_b0, b_zero, b_s0 + b_s1 + b_s2 + b_s3,
            t0, 0, eos, i_h, i_hv, o_k, H, HV, K, BC, USE_GATE, HAS_A, USE_LOWER_BOUND, SAFE_GATE, DOT_PREC)
        b_A00 += b_dq
        b_L00 += b_dk

        b_qr, b_kr, b_kc1, b_dq, b_dk = _row_slice(
            q, k, g, w, qg, kg, b_bias, b_A, lower_bound, b_rq1, b_rk1, b_b1, b_s0, b_s1 + b_s2 + b_s3,
            t0, 1, eos, i_h, i_hv, o_k, H, HV, K, BC, USE_GATE, HAS_A, USE_LOWER_BOUND, SAFE_GATE, DOT_PREC)
        b_A11 += b_dq
        b_L11 += b_dk
        b_dq, b_dk = _off_diag(b_qr, b_kr, b_zero, b_kc0, DOT_PREC)
        b_A10 += b_dq
        b_L10 += b_dk

        b_qr, b_kr, b_kc2, b_dq, b_dk = _row_slice(
            q, k, g, w, qg, kg, b_bias, b_A, lower_bound, b_rq2, b_rk2, b_b2, b_s0 + b_s1, b_s2 + b_s3,
            t0, 2, eos, i_h, i_hv, o_k, H, HV, K, BC, USE_GATE, HAS_A, USE_LOWER_BOUND, SAFE_GATE, DOT_PREC)
        b_A22 += b_dq
        b_L22 += b_dk
        b_dq, b_dk = _off_diag(b_qr, b_kr, b_s1, b_kc0, DOT_PREC)
        b_A20 += b_dq
        b_L20 += b_dk
        b_dq, b_dk = _off_diag(b_qr, b_kr, b_zero, b_kc1, DOT_PREC)
        b_A21 += b_dq
        b_L21 += b_dk

        b_qr, b_kr, b_kc3, b_dq, b_dk = _row_slice(
            q, k, g, w, qg, kg, b_bias, b_A, lower_bound, b_rq3, b_rk3, b_b3, b_s0 + b_s1 + b_s2, b_s3,
            t0, 3, eos, i_h, i_hv, o_k, H, HV, K, BC, USE_GATE, HAS_A, USE_LOWER_BOUND, SAFE_GATE, DOT_PREC)
        b_A33 += b_dq
        b_L33 += b_dk
        b_dq, b_dk = _off_diag(b_qr, b_kr, b_s1 + b_s2, b_kc0, DOT_PREC)
        b_A30 += b_dq
        b_L30 += b_dk
        b_dq, b_dk = _off_diag(b_qr, b_kr, b_s2, b_kc1, DOT_PREC)
        b_A31 += b_dq
        b_L31 += b_dk
        b_dq, b_dk = _off_diag(b_qr, b_kr, b_zero, b_kc2, DOT_PREC)
        b_A32 += b_dq
        b_L32 += b_dk

    m_lower = o_i[:, None] >= o_i[None, :]
    _store_A(Aqk, tl.where(m_lower, b_A00, 0.0), t0, 0, 0, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, b_A10, t0, 1, 0, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, tl.where(m_lower, b_A11, 0.0), t0, 1, 1, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, b_A20, t0, 2, 0, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, b_A21, t0, 2, 1, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, tl.where(m_lower, b_A22, 0.0), t0, 2, 2, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, b_A30, t0, 3, 0, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, b_A31, t0, 3, 1, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, b_A32, t0, 3, 2, eos, i_hv, HV, BT, BC)
    _store_A(Aqk, tl.where(m_lower, b_A33, 0.0), t0, 3, 3, eos, i_hv, HV, BT, BC)

    # Block solve of (I + L)⁻¹ with L = Diag(β) Akk (strictly lower): T_aa = (I + L_aa)⁻¹,
    # T_ab = -T_aa Σ_{b<=c<a} L_ac T_cb.
    m_strict = o_i[:, None] > o_i[None, :]
    b_T00 = _inv_unit_lower(tl.where(m_strict, b_L00, 0.0) * b_b0[:, None], BC, INV_PREC)
    b_T11 = _inv_unit_lower(tl.where(m_strict, b_L11, 0.0) * b_b1[:, None], BC, INV_PREC)
    b_T22 = _inv_unit_lower(tl.where(m_strict, b_L22, 0.0) * b_b2[:, None], BC, INV_PREC)
    b_T33 = _inv_unit_lower(tl.where(m_strict, b_L33, 0.0) * b_b3[:, None], BC, INV_PREC)
    b_L10 = b_L10 * b_b1[:, None]
    b_L20 = b_L20 * b_b2[:, None]
    b_L21 = b_L21 * b_b2[:, None]
    b_L30 = b_L30 * b_b3[:, None]
    b_L31 = b_L31 * b_b3[:, None]
    b_L32 = b_L32 * b_b3[:, None]
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

    # Pass 2, column slice by column slice: w = T rhs over the stored right-hand sides (every thread must see
    # them: barrier first, and again before a slice is overwritten), u = T (β v) straight from v.
    tl.debug_barrier()
    for i_k in range(0, tl.cdiv(K, BKC)):
        o_k = i_k * BKC + tl.arange(0, BKC)
        b_r0 = _rows(w, t0, 0, eos, i_hv, o_k, HV, K, BC)
        b_r1 = _rows(w, t0, 1, eos, i_hv, o_k, HV, K, BC)
        b_r2 = _rows(w, t0, 2, eos, i_hv, o_k, HV, K, BC)
        b_r3 = _rows(w, t0, 3, eos, i_hv, o_k, HV, K, BC)
        b_w0, b_w1, b_w2, b_w3 = _wy_slice(b_r0, b_r1, b_r2, b_r3, b_T00, b_T10, b_T11, b_T20, b_T21, b_T22,
                                           b_T30, b_T31, b_T32, b_T33, DOT_PREC)
        tl.debug_barrier()
        _put_rows(w, b_w0, t0, 0, eos, i_hv, o_k, HV, K, BC)
        _put_rows(w, b_w1, t0, 1, eos, i_hv, o_k, HV, K, BC)
        _put_rows(w, b_w2, t0, 2, eos, i_hv, o_k, HV, K, BC)
        _put_rows(w, b_w3, t0, 3, eos, i_hv, o_k, HV, K, BC)
    for i_v in range(0, tl.cdiv(V, BVC)):
        o_v = i_v * BVC + tl.arange(0, BVC)
        b_r0 = _rows(v, t0, 0, eos, i_hv, o_v, HV, V, BC) * b_b0[:, None]
        b_r1 = _rows(v, t0, 1, eos, i_hv, o_v, HV, V, BC) * b_b1[:, None]
        b_r2 = _rows(v, t0, 2, eos, i_hv, o_v, HV, V, BC) * b_b2[:, None]
        b_r3 = _rows(v, t0, 3, eos, i_hv, o_v, HV, V, BC) * b_b3[:, None]
        b_u0, b_u1, b_u2, b_u3 = _wy_slice(b_r0, b_r1, b_r2, b_r3, b_T00, b_T10, b_T11, b_T20, b_T21, b_T22,
                                           b_T30, b_T31, b_T32, b_T33, DOT_PREC)
        _put_rows(u, b_u0, t0, 0, eos, i_hv, o_v, HV, V, BC)
        _put_rows(u, b_u1, t0, 1, eos, i_hv, o_v, HV, V, BC)
        _put_rows(u, b_u2, t0, 2, eos, i_hv, o_v, HV, V, BC)
        _put_rows(u, b_u3, t0, 3, eos, i_hv, o_v, HV, V, BC)


def chunk_kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_gate_in_kernel,
                        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                        index, work_dtype, dot_prec, num_warps=4):
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
        # 4 warps and 32-wide K/V slices: see benchmarks/kda/NOTES.md ("Offline resource work") for the sm_90
        # register counts behind this choice.
        chunk_kda_fwd_kernel_intra[(index.num_chunks, HV)](
            q, k, v, g, beta, A_log, dt_bias, index.cu_seqlens, index.chunk_offsets, index.chunk_map,
            w, u, qg, kg, Aqk, gC,
            scale, 0.0 if lower_bound is None else float(lower_bound), T, index.chunks_per_seq,
            H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BKC=SLICE, BVC=SLICE,
            USE_GATE=use_gate_in_kernel, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None,
            USE_LOWER_BOUND=lower_bound is not None, USE_L2NORM=use_qk_l2norm_in_kernel,
            BETA_SIGMOID=use_beta_sigmoid_in_kernel, ALLOW_NEG_EIGVAL=allow_neg_eigval,
            SAFE_GATE=safe_gate, IS_VARLEN=index.is_varlen, DOT_PREC=dot_prec,
            # The diagonal inverses keep fp32 accuracy (they were exact fp32 row steps before): three tf32
            # products per product when the rest of the stage uses tf32.
            INV_PREC="ieee" if dot_prec == "ieee" else "tf32x3",
            num_warps=num_warps,
        )
    return w, u, qg, kg, Aqk, gC
