"""Intra-chunk stage: one program per (chunk, value head) does all the work that needs no recurrent state.

Fused in one pass over the chunk (``BT = 64`` tokens as four ``BC = 16`` sub-chunks): gate activation and the
in-chunk cumulative sum ``Γ``, q/k L2 norm, beta sigmoid, the strictly-lower ``L = β ⊙ (k kᵀ ⊙ e^{Γ_i-Γ_j})``
and causal ``Aqk = (q kᵀ ⊙ e^{Γ_i-Γ_j})``, the block solve ``(I + L)⁻¹`` and the WY factors
``w = (I + L)⁻¹ (β k e^Γ)``, ``u = (I + L)⁻¹ (β v)``. Outputs for the state stage: ``w``, ``u``,
``qg = scale q e^Γ``, ``kg = k e^{Γ_C - Γ}``, ``Aqk`` (lower triangle only) and ``Γ_C`` per chunk.

Shape of the work: the chunk is handled as whole ``[BT, 16]`` slices of K (then of V), so one slice of q/k/g is
live at a time; ``Aqk`` and ``Akk`` accumulate over the slices as one ``[BT, BT]`` tile for the off-diagonal
sub-chunk blocks (Hopper wgmma, M = 64) and a ``[4, BC, BC]`` batch for the diagonal blocks. The solve uses no
serial row loop: the diagonal inverses by the product form ``(I - L)(I + L²)(I + L⁴)(I + L⁸)`` (batched), the
off-diagonal coupling ``N = (I + D)⁻¹ E`` by ``(I + N)⁻¹ = I - N + N² - N³`` (N is nilpotent over four blocks).

Numerics: every ``e^{Γ_i - Γ_j}`` with ``i`` and ``j`` in different sub-chunks is split at a sub-chunk boundary
between them, so both factors are ``<= 1`` (no overflow for any gate ``<= 0``). Inside a sub-chunk the bounded
gate (``safe_gate``, ``g >= -5``) factors through the sub-chunk start (``<= e^80``, inside fp32 range) and uses
tensor cores; any other gate is computed pair by pair, exactly.

Traffic per (chunk, head), bf16 in/out with K = V = 128: reads q, k, v, g (64 KiB) and writes w, u, qg, kg, Aqk
(74 KiB); the stage is bound by HBM bandwidth when enough (chunk, head) programs run. q and k are read twice
(L2 norms first) and the w right-hand side makes one round trip, mostly from L2.
"""

import torch
import triton
import triton.language as tl

from flashkda.ops import L2NORM_EPS, beta_map, fast_exp, fast_rsqrt, kda_gate
from flashkda.rounding import cast_for_store

#: Tokens per chunk and per sub-chunk; the kernel is written out for exactly four sub-chunks.
CHUNK_SIZE = 64
SUB_CHUNK = 16
#: Width of the K slices of pass 1 (one slice of q/k/g live at a time next to the [64, 64] accumulators) and the
#: default width of the K/V slices of pass 2 (w and u, after the accumulators are dead).
SLICE = 16


@triton.jit
def _raw_tile(x, t0, eos, i_x, o_c, NX: tl.constexpr, C: tl.constexpr, BT: tl.constexpr):
    """Loads the chunk's ``[BT, len(o_c)]`` tile of a ``[.., T, NX, C]`` tensor in its own dtype (zero past
    ``eos`` and past ``C``)."""
    # 64-bit scalar base, 32-bit tile offsets: int64 offset tensors would cost two registers an element.
    o_t = tl.arange(0, BT)
    m = (o_t < eos - t0)[:, None] & (o_c < C)[None, :]
    return tl.load(x + (t0 * NX + i_x) * C + o_t[:, None] * (NX * C) + o_c[None, :], mask=m, other=0.0)


@triton.jit
def _tile(x, t0, eos, i_x, o_c, NX: tl.constexpr, C: tl.constexpr, BT: tl.constexpr):
    """``_raw_tile`` as fp32."""
    return _raw_tile(x, t0, eos, i_x, o_c, NX, C, BT).to(tl.float32)


@triton.jit
def _put_tile(x, b_x, t0, eos, i_x, o_c, NX: tl.constexpr, C: tl.constexpr, BT: tl.constexpr):
    o_t = tl.arange(0, BT)
    m = (o_t < eos - t0)[:, None] & (o_c < C)[None, :]
    tl.store(x + (t0 * NX + i_x) * C + o_t[:, None] * (NX * C) + o_c[None, :], cast_for_store(b_x, x.dtype.element_ty),
             mask=m)


@triton.jit
def _per_row(b_x4, BC: tl.constexpr, BKC: tl.constexpr):
    """Broadcasts a per-sub-chunk ``[4, BKC]`` value to the ``[4 * BC, BKC]`` rows of the chunk."""
    return tl.reshape(tl.broadcast_to(b_x4[:, None, :], [4, BC, BKC]), [4 * BC, BKC])


@triton.jit
def _sub_sums(b_s4, m):
    """``[4, BKC]``: row ``a`` holds Σ_b m[a, b] s_b over the sub-chunk gate sums ``b_s4`` (``m``: ``[4, 4]``).

    Sums are formed directly, never as differences of running sums, which drift by ~1e-5 relative once large
    gates push them into the hundreds.
    """
    return tl.sum(tl.where(m[:, :, None], b_s4[None, :, :], 0.0), 1)


@triton.jit
def _bdot(b_a, b_b, PREC: tl.constexpr):
    return tl.dot(b_a, b_b, input_precision=PREC)


@triton.jit
def _stack_rows(b_a, b_b, M: tl.constexpr, N: tl.constexpr):
    """``[2M, N]``: the rows of ``b_a`` then those of ``b_b`` (both ``[M, N]``)."""
    return tl.reshape(tl.permute(tl.join(b_a, b_b), (2, 0, 1)), [2 * M, N])


@triton.jit
def _unstack_rows(b_x, M: tl.constexpr, N: tl.constexpr):
    """Inverse of ``_stack_rows``: the two ``[M, N]`` halves of ``[2M, N]``."""
    return tl.split(tl.permute(tl.reshape(b_x, [2, M, N]), (1, 2, 0)))


@triton.jit
def _stack_rows3(b_a, b_b, NB: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    """``[NB, 2M, N]``: per batch entry, the rows of ``b_a`` then those of ``b_b`` (both ``[NB, M, N]``)."""
    return tl.reshape(tl.permute(tl.join(b_a, b_b), (0, 3, 1, 2)), [NB, 2 * M, N])


@triton.jit
def _unstack_rows3(b_x, NB: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    """Inverse of ``_stack_rows3``."""
    return tl.split(tl.permute(tl.reshape(b_x, [NB, 2, M, N]), (0, 2, 3, 1)))


@triton.jit
def _inv_unit_lower(b_L, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + L)⁻¹ of a batch ``[4, BC, BC]`` of strictly lower blocks by (I - L)(I + L²)(I + L⁴)(I + L⁸).

    L is nilpotent (L¹⁶ = 0 for BC = 16), so the product is exact in exact arithmetic: six batched tensor-core
    products instead of sixteen dependent row steps with a cross-thread reduction each.
    """
    tl.static_assert(BC == 16, "the product form is written out for 16 x 16 blocks")
    o_i = tl.arange(0, BC)
    b_X = tl.where((o_i[:, None] == o_i[None, :])[None, :, :], 1.0, 0.0) - b_L
    b_P = _bdot(b_L, b_L, PREC)
    b_X += _bdot(b_X, b_P, PREC)
    b_P = _bdot(b_P, b_P, PREC)
    b_X += _bdot(b_X, b_P, PREC)
    b_P = _bdot(b_P, b_P, PREC)
    b_X += _bdot(b_X, b_P, PREC)
    return b_X


@triton.jit
def _block_diag(b_D, BT: tl.constexpr, BC: tl.constexpr):
    """The ``[BT, BT]`` block-diagonal matrix of a batch ``[4, BC, BC]`` of blocks."""
    o_blk = tl.arange(0, BT) // BC
    # [BT, 4 * BC]: row i of block i // BC repeated for every column block, then kept only on the diagonal
    b_x = tl.reshape(tl.broadcast_to(tl.reshape(b_D, [BT, BC])[:, None, :], [BT, 4, BC]), [BT, BT])
    return tl.where(o_blk[:, None] == o_blk[None, :], b_x, 0.0)


@triton.jit
def inv_norms(q, k, t0_q, t0_k, eos, i_h, scale, H: tl.constexpr, K: tl.constexpr, RQ: tl.constexpr,
              RK: tl.constexpr, BN: tl.constexpr, USE_L2NORM: tl.constexpr):
    """``([RQ], [RK])`` fp32: ``scale / |q_t|`` over the ``RQ`` rows from ``t0_q`` and ``1 / |k_t|`` over the ``RK``
    rows from ``t0_k`` (``scale`` and 1 without the in-kernel L2 norm), read in ``BN``-wide slices."""
    b_sq = tl.zeros([RQ], dtype=tl.float32)
    b_sk = tl.zeros([RK], dtype=tl.float32)
    if USE_L2NORM:
        for i_k in range(0, tl.cdiv(K, BN)):
            o_k = i_k * BN + tl.arange(0, BN)
            b_x = _tile(q, t0_q, eos, i_h, o_k, H, K, RQ)
            b_sq += tl.sum(b_x * b_x, 1)
            b_x = _tile(k, t0_k, eos, i_h, o_k, H, K, RK)
            b_sk += tl.sum(b_x * b_x, 1)
        return scale * fast_rsqrt(b_sq + L2NORM_EPS), fast_rsqrt(b_sk + L2NORM_EPS)
    return b_sq + scale, b_sk + 1.0


@triton.jit
def activate_gate(b_g, dt_bias, b_A, lower_bound, i_hv, o_k, m_r, K: tl.constexpr, USE_GATE: tl.constexpr,
                  HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """The log decay of a ``[R, len(o_k)]`` fp32 gate tile (raw input when ``USE_GATE``, else as given), zero in
    rows past ``m_r`` and columns past ``K``: padded rows must not decay the state, whatever the activation of 0 is."""
    m_k = o_k < K
    if USE_GATE:
        if HAS_BIAS:
            b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        else:
            b_bias = tl.zeros(o_k.shape, dtype=tl.float32)
        b_g = kda_gate(b_g, b_bias[None, :], b_A, lower_bound, HAS_A, USE_LOWER_BOUND)
    return tl.where(m_r[:, None] & m_k[None, :], b_g, 0.0)


@triton.jit
def chunk_span(i_c, cu_seqlens, chunk_offsets, chunk_map, T, NTS, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Global chunk ``i_c``: its sequence ``i_n`` (``-1`` for a surplus varlen grid entry: the caller returns), its
    first token ``t0`` and its sequence's end ``eos`` (int64 token indices)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_map + i_c)
        i_s = tl.maximum(i_n, 0)
        bos = tl.load(cu_seqlens + i_s).to(tl.int64)
        eos = tl.load(cu_seqlens + i_s + 1).to(tl.int64)
        i_j = i_c - tl.load(chunk_offsets + i_s)
    else:
        i_n = i_c // NTS
        i_j = i_c % NTS
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return i_n, bos + i_j.to(tl.int64) * BT, eos


@triton.jit(do_not_specialize=["T", "lower_bound", "scale", "NCL"])
def chunk_kda_fwd_kernel_intra(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, chunk_map,
    w, u, qg, kg, Aqk, gC, AqkC, Akk, Minv,
    scale, lower_bound, T, NTS, NCL,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BKC: tl.constexpr, BS: tl.constexpr, BKN: tl.constexpr, LHS: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
    SAFE_GATE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr,
    MERGE: tl.constexpr, STORE_LOCAL: tl.constexpr,
):
    tl.static_assert(BT == 4 * BC, "the kernel is written out for four sub-chunks")
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_span(i_c, cu_seqlens, chunk_offsets, chunk_map, T, NTS, BT, IS_VARLEN)
    if i_n < 0:
        return
    o_r = tl.arange(0, BT)
    m_r = o_r < eos - t0
    # [BT] sub-chunk of each row
    o_blk = o_r // BC
    if HAS_A:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
    else:
        b_A = 0.0

    # [BT] reciprocal L2 norms of q (with the scale) and k, and the activated beta. Nothing else is live yet, so
    # the norms read BKN-wide slices (fewer dependent trips to memory than the BKC slices of the passes below).
    b_rq, b_rk = inv_norms(q, k, t0, t0, eos, i_h, scale, H, K, BT, BT, BKN, USE_L2NORM)
    b_b = tl.load(beta + t0 * HV + i_hv + o_r * HV, mask=m_r, other=0.0).to(tl.float32)
    b_b = tl.where(m_r, beta_map(b_b, BETA_SIGMOID, ALLOW_NEG_EIGVAL), 0.0)

    # Pass 1, K slice by K slice (every exponent is per channel, so Aqk and Akk are sums over slices and only one
    # [BT, BKC] slice of q/k/g is live at a time). Each e^{Γ_i - Γ_j} is split into two factors <= 1 at a
    # sub-chunk boundary between i and j, one product per row set x column set so that every product accumulates
    # in place: the start of i's sub-chunk for the adjacent pairs (1,0) and (3,2), the chunk middle for (2|3, 0|1).
    # The diagonal blocks are batched [4, BC, BC] products: the bounded gate factors through the sub-chunk start
    # (<= e^80, fp32 range); any other gate is computed pair by pair, exactly.
    # [4, 4] sub-chunk pairs (a, b) for the gate sums
    o_a = tl.arange(0, 4)[:, None]
    o_b = tl.arange(0, 4)[None, :]
    o_i3 = tl.arange(0, BC)[None, :, None]
    o_j3 = tl.arange(0, BC)[None, None, :]
    # [BT, BT] off-diagonal blocks (zero elsewhere); [4, BC, BC] diagonal blocks. MERGE: Aqk and Akk share their
    # column operand, so their row operands are stacked and each pair of products is one product ([2 BT, BT]
    # accumulator; [4, 2 BC, BC] for the bounded-gate diagonal blocks): half the tensor-core round trips per slice.
    if MERGE:
        b_AX = tl.zeros([2 * BT, BT], dtype=tl.float32)
        if SAFE_GATE:
            b_AX3 = tl.zeros([4, 2 * BC, BC], dtype=tl.float32)
    else:
        b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
        b_Akk = tl.zeros([BT, BT], dtype=tl.float32)
    b_Aqk3 = tl.zeros([4, BC, BC], dtype=tl.float32)
    b_Akk3 = tl.zeros([4, BC, BC], dtype=tl.float32)
    # Software pipelining by hand: the next slice's g/q/k loads are issued before this slice's work, so each
    # slice waits on memory once per program instead of once per slice (raw dtype: 4 registers a tile).
    o_k = tl.arange(0, BKC)
    b_gn = _raw_tile(g, t0, eos, i_hv, o_k, HV, K, BT)
    b_qn = _raw_tile(q, t0, eos, i_h, o_k, H, K, BT)
    b_kn = _raw_tile(k, t0, eos, i_h, o_k, H, K, BT)
    for i_k in range(0, tl.cdiv(K, BKC)):
        o_k = i_k * BKC + tl.arange(0, BKC)
        m_k = o_k < K
        # [BT, BKC]
        b_g = b_gn.to(tl.float32)
        b_q = b_qn.to(tl.float32) * b_rq[:, None]
        b_k = b_kn.to(tl.float32) * b_rk[:, None]
        b_gn = _raw_tile(g, t0, eos, i_hv, o_k + BKC, HV, K, BT)
        b_qn = _raw_tile(q, t0, eos, i_h, o_k + BKC, H, K, BT)
        b_kn = _raw_tile(k, t0, eos, i_h, o_k + BKC, H, K, BT)
        b_g = activate_gate(b_g, dt_bias, b_A, lower_bound, i_hv, o_k, m_r, K, USE_GATE, HAS_A, HAS_BIAS,
                            USE_LOWER_BOUND)
        # [4, BC, BKC] -> [BT, BKC] cumulative gate from each sub-chunk's start; [4, BKC] sub-chunk sums.
        b_g3 = tl.reshape(b_g, [4, BC, BKC])
        b_G = tl.reshape(tl.cumsum(b_g3, 1), [BT, BKC])
        b_s4 = tl.sum(b_g3, 1)
        tl.store(gC + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.sum(b_s4, 0), mask=m_k)
        # Γ_i relative to the chunk start (qg, w) and Γ_C - Γ_i (kg), each from sub-chunk sums.
        b_eG = fast_exp(_per_row(_sub_sums(b_s4, o_b < o_a), BC, BKC) + b_G)
        _put_tile(qg, b_q * b_eG, t0, eos, i_hv, o_k, HV, K, BT)
        _put_tile(kg, b_k * fast_exp(_per_row(_sub_sums(b_s4, o_b >= o_a), BC, BKC) - b_G), t0, eos, i_hv, o_k,
                  HV, K, BT)
        # Right-hand side of the WY solve for w; pass 2 overwrites it with w.
        _put_tile(w, b_k * b_eG * b_b[:, None], t0, eos, i_hv, o_k, HV, K, BT)

        # Row operands relative to their sub-chunk's start (factors <= 1).
        b_eGr = fast_exp(b_G)
        b_qr = b_q * b_eGr
        b_kr = b_k * b_eGr
        # Columns relative to the end of their sub-chunk (factors <= 1).
        b_kc = b_k * fast_exp(_per_row(b_s4, BC, BKC) - b_G)
        for a in tl.static_range(1, 4, 2):
            # adjacent pair (a, a - 1)
            m_row = (o_blk == a)[:, None]
            m_col = (o_blk == a - 1)[:, None]
            if MERGE:
                b_AX += tl.dot(_stack_rows(tl.where(m_row, b_qr, 0.0), tl.where(m_row, b_kr, 0.0), BT, BKC),
                               tl.trans(tl.where(m_col, b_kc, 0.0)), input_precision=DOT_PREC)
            else:
                b_Aqk += tl.dot(tl.where(m_row, b_qr, 0.0), tl.trans(tl.where(m_col, b_kc, 0.0)),
                                input_precision=DOT_PREC)
                b_Akk += tl.dot(tl.where(m_row, b_kr, 0.0), tl.trans(tl.where(m_col, b_kc, 0.0)),
                                input_precision=DOT_PREC)
        # Far pairs through the chunk middle: rows of sub-chunk 3 gain e^{s_2}, columns of sub-chunk 0 e^{s_1}.
        m_row = (o_blk >= 2)[:, None]
        m_col = (o_blk < 2)[:, None]
        b_rs = tl.where(m_row, fast_exp(_per_row(_sub_sums(b_s4, (o_b >= 2) & (o_b < o_a)), BC, BKC)), 0.0)
        b_kc = tl.where(m_col, b_kc * fast_exp(_per_row(_sub_sums(b_s4, (o_b > o_a) & (o_b < 2)), BC, BKC)), 0.0)
        if MERGE:
            b_AX += tl.dot(_stack_rows(b_qr * b_rs, b_kr * b_rs, BT, BKC), tl.trans(b_kc), input_precision=DOT_PREC)
        else:
            b_Aqk += tl.dot(b_qr * b_rs, tl.trans(b_kc), input_precision=DOT_PREC)
            b_Akk += tl.dot(b_kr * b_rs, tl.trans(b_kc), input_precision=DOT_PREC)
        # [4, BC, BKC]
        b_q3 = tl.reshape(b_q, [4, BC, BKC])
        b_k3 = tl.reshape(b_k, [4, BC, BKC])
        b_G3 = tl.reshape(b_G, [4, BC, BKC])
        if SAFE_GATE:
            # Bounded gate: e^{-G} <= e^{16 * 5} stays in fp32 range, so one tensor-core product suffices.
            b_kc3 = tl.permute(b_k3 * fast_exp(-b_G3), (0, 2, 1))
            if MERGE:
                b_AX3 += _bdot(_stack_rows3(tl.reshape(b_qr, [4, BC, BKC]), tl.reshape(b_kr, [4, BC, BKC]), 4, BC,
                                            BKC), b_kc3, DOT_PREC)
            else:
                b_Aqk3 += _bdot(tl.reshape(b_qr, [4, BC, BKC]), b_kc3, DOT_PREC)
                b_Akk3 += _bdot(tl.reshape(b_kr, [4, BC, BKC]), b_kc3, DOT_PREC)
        else:
            for j in range(BC):
                # [4, BKC] row j of every sub-chunk
                b_kj = tl.sum(tl.where(o_i3 == j, b_k3, 0.0), 1)
                b_gj = tl.sum(tl.where(o_i3 == j, b_G3, 0.0), 1)
                # [4, BC, BKC] exact e^{Γ_i - Γ_j} for i >= j inside the sub-chunk, zero above
                b_kd = b_kj[:, None, :] * fast_exp(tl.where(o_i3 >= j, b_G3 - b_gj[:, None, :], float("-inf")))
                b_Aqk3 += tl.where(o_j3 == j, tl.sum(b_q3 * b_kd, 2)[:, :, None], 0.0)
                b_Akk3 += tl.where(o_j3 == j, tl.sum(b_k3 * b_kd, 2)[:, :, None], 0.0)

    if MERGE:
        b_Aqk, b_Akk = _unstack_rows(b_AX, BT, BT)
        if SAFE_GATE:
            b_Aqk3, b_Akk3 = _unstack_rows3(b_AX3, 4, BC, BC)
    # Aqk: causal; the off-diagonal lower blocks and the diagonal blocks (the state stage never reads the others).
    p_A = Aqk + (t0 * HV + i_hv) * BT
    tl.store(p_A + o_r[:, None] * (HV * BT) + o_r[None, :], cast_for_store(b_Aqk, Aqk.dtype.element_ty),
             mask=m_r[:, None] & (o_blk[None, :] < o_blk[:, None]))
    o_a3 = tl.arange(0, 4)[:, None, None]
    o_t3 = o_a3 * BC + o_i3
    tl.store(p_A + o_t3 * (HV * BT) + o_a3 * BC + o_j3,
             cast_for_store(tl.where(o_i3 >= o_j3, b_Aqk3, 0.0), Aqk.dtype.element_ty),
             mask=o_t3 < eos - t0)
    if STORE_LOCAL:
        # For the training backward, in its chunked layout per head slice, [HV / LHS, NCL, LHS, BT, BT]: whole tiles,
        # zero above the diagonal and on padding rows. b_Aqk and b_Akk are zero outside the strictly-lower blocks;
        # the off-diagonal and the diagonal-block stores cover disjoint entries. Akk raw (before Diag(β)), for dβ.
        p_l = (((i_hv // LHS) * NCL + i_c).to(tl.int64) * LHS + i_hv % LHS) * BT * BT
        o_rr = o_r[:, None] * BT + o_r[None, :]
        o_dd = o_t3 * BT + o_a3 * BC + o_j3
        m_off = o_blk[None, :] != o_blk[:, None]
        m_d = o_t3 < eos - t0
        tl.store(AqkC + p_l + o_rr, cast_for_store(tl.where(m_r[:, None], b_Aqk, 0.0), AqkC.dtype.element_ty),
                 mask=m_off)
        tl.store(AqkC + p_l + o_dd, cast_for_store(tl.where(m_d & (o_i3 >= o_j3), b_Aqk3, 0.0), AqkC.dtype.element_ty))
        tl.store(Akk + p_l + o_rr, cast_for_store(tl.where(m_r[:, None], b_Akk, 0.0), Akk.dtype.element_ty),
                 mask=m_off)
        tl.store(Akk + p_l + o_dd, cast_for_store(tl.where(m_d & (o_i3 > o_j3), b_Akk3, 0.0), Akk.dtype.element_ty))

    # Solve with L = Diag(β) Akk strictly lower = D + E (D: the diagonal 16 x 16 blocks):
    # (I + L)⁻¹ = (I + N)⁻¹ D̃ with D̃ = (I + D)⁻¹ (batched product form) and N = D̃ E, strictly block-lower
    # over four blocks, so (I + N)⁻¹ = I - N + N² - N³ exactly.
    b_b3 = tl.reshape(b_b, [4, BC])[:, :, None]
    b_D = _inv_unit_lower(tl.where(o_i3 > o_j3, b_Akk3, 0.0) * b_b3, BC, INV_PREC)
    b_N = tl.reshape(_bdot(b_D, tl.reshape(b_Akk * b_b[:, None], [4, BC, BT]), DOT_PREC), [BT, BT])
    b_N2 = tl.dot(b_N, b_N, input_precision=DOT_PREC)
    b_M = (tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0) - b_N + b_N2
           - tl.dot(b_N2, b_N, input_precision=DOT_PREC))
    # [BT, BT] the whole inverse (I + L)⁻¹ = M D̃, formed once, so each slice of w and u below is one product
    # instead of a batched diagonal product plus one (D̃ is rounded to the product precision either way).
    b_T = tl.dot(b_M, _block_diag(b_D, BT, BC), input_precision=DOT_PREC)
    if STORE_LOCAL:
        # (I + L)⁻¹ itself (lower triangular, unit diagonal; zero on padding rows), so the backward needs no solve
        tl.store(Minv + p_l + o_rr, cast_for_store(tl.where(m_r[:, None], b_T, 0.0), Minv.dtype.element_ty))
    # Pass 2, slice by slice: w over the stored right-hand sides (every thread must see them: barrier first, and
    # again before a slice is overwritten), u = T (β v) straight from v. Loads run one slice ahead as in pass 1;
    # a prefetched w slice is consumed before the barrier that precedes its overwrite.
    # The pass-1 accumulators are dead here, so the slices (BS) may be wider than in pass 1.
    tl.debug_barrier()
    o_k = tl.arange(0, BS)
    b_xn = _raw_tile(w, t0, eos, i_hv, o_k, HV, K, BT)
    for i_k in range(0, tl.cdiv(K, BS)):
        o_k = i_k * BS + tl.arange(0, BS)
        b_x = b_xn.to(tl.float32)
        b_xn = _raw_tile(w, t0, eos, i_hv, o_k + BS, HV, K, BT)
        b_x = tl.dot(b_T, b_x, input_precision=DOT_PREC)
        tl.debug_barrier()
        _put_tile(w, b_x, t0, eos, i_hv, o_k, HV, K, BT)
    o_v = tl.arange(0, BS)
    b_xn = _raw_tile(v, t0, eos, i_hv, o_v, HV, V, BT)
    for i_v in range(0, tl.cdiv(V, BS)):
        o_v = i_v * BS + tl.arange(0, BS)
        b_x = b_xn.to(tl.float32) * b_b[:, None]
        b_xn = _raw_tile(v, t0, eos, i_hv, o_v + BS, HV, V, BT)
        b_x = tl.dot(b_T, b_x, input_precision=DOT_PREC)
        _put_tile(u, b_x, t0, eos, i_hv, o_v, HV, V, BT)


#: Launch configurations tried on first use of each shape class on a GPU (pass-2 slice width, warps, stacked Aqk/Akk
#: products, register cap): 4 warps (one warpgroup: the [64, 64] products map onto wgmma); register caps, 8 warps and
#: 32-wide pass-1 slices were slower (docs/flashkda-performance.md). All give the same math (rounding order aside).
INTRA_CONFIGS = [(16, 4, False, None), (64, 4, False, None), (64, 4, True, None)]
chunk_kda_fwd_kernel_intra_tuned = triton.autotune(
    configs=[triton.Config({"BS": bs, "MERGE": merge}, num_warps=nw, num_stages=1, maxnreg=cap)
             for bs, nw, merge, cap in INTRA_CONFIGS],
    key=["H", "HV", "K", "V", "IS_VARLEN", "SAFE_GATE", "USE_GATE", "DOT_PREC", "STORE_LOCAL"],
)(chunk_kda_fwd_kernel_intra)


def chunk_kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_gate_in_kernel,
                        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                        index, work_dtype, dot_prec, num_warps=None, maxnreg=None, solve_slice=None,
                        pass1_slice=None, merge=None,
                        store_local=False, local_heads=None, fp32_u=False):
    """Runs the intra-chunk stage (see the module docstring) on validated, contiguous inputs.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]``; A_log, dt_bias,
            scale, lower_bound and the flags: as in ``flashkda.chunk_kda``.
        index: ``ChunkIndex`` of the batch. work_dtype: dtype of w and kg. dot_prec: ``"ieee"`` or ``"tf32"``.
        num_warps, maxnreg, solve_slice: force one launch configuration of the intra kernel (None: autotuned on
            a GPU).
        pass1_slice: width of the K slices of pass 1 (default ``SLICE``).
        merge: force the stacked Aqk/Akk products on or off (None: autotuned on a GPU, off on the interpreter).
        store_local: also write, for the training backward, ``Aqk`` (zero above the diagonal), the raw
            strictly-lower ``Akk`` and the solved ``(I + Diag(β) Akk)⁻¹`` in the backward's chunked layout, head
            slice by head slice: ``[HV / local_heads, NC, local_heads, 64, 64]`` each (``NC = index.num_chunks``;
            zero rows on padding) in Aqk's dtype, so each slice of the backward reads a contiguous block.
        local_heads: value heads per slice of that layout (a divisor of HV; None: HV).
        fp32_u: store ``u`` in fp32 whatever the intermediates' dtype (the state stage then keeps ``v_new`` in fp32
            too): the training backward that takes the forward's ``v_new`` needs it, since ``v_new = u - w S`` cancels
            and a bf16 ``u`` tripled the fp64-reference error of ``dA_log`` (flashkda.bwd.chunk_bwd).

    Returns:
        ``(w, u, qg, kg, Aqk, gC)``: w, kg ``[B, T, HV, K]`` work dtype; u ``[B, T, HV, V]``, qg
        ``[B, T, HV, K]``, Aqk ``[B, T, HV, 64]`` (lower triangle written) in the work dtype;
        gC ``[NC, HV, K]`` fp32. With ``store_local``, ``(AqkC, Akk, Minv)`` follow (layout above).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT, BC = CHUNK_SIZE, SUB_CHUNK
    # qg, u and Aqk are stored in the work dtype: bf16 halves the bytes of both stages for ~0.5e-3 more RMS error in o
    # each (docs/flashkda-performance.md)
    w = torch.empty(B, T, HV, K, dtype=work_dtype, device=q.device)
    kg = torch.empty_like(w)
    qg = torch.empty(B, T, HV, K, dtype=work_dtype, device=q.device)
    u = torch.empty(B, T, HV, V, dtype=torch.float32 if fp32_u else work_dtype, device=q.device)
    Aqk = torch.empty(B, T, HV, BT, dtype=work_dtype, device=q.device)
    gC = torch.empty(index.num_chunks, HV, K, dtype=torch.float32, device=q.device)
    LHS = local_heads or HV
    if HV % LHS:
        raise ValueError(f"local_heads must divide the {HV} value heads, got {LHS}")
    shape = (HV // LHS, index.num_chunks, LHS, BT, BT)
    local = tuple(torch.empty(shape, dtype=work_dtype, device=q.device) for _ in range(3)) if store_local else ()
    if index.num_chunks == 0:
        return w, u, qg, kg, Aqk, gC, *local
    AqkC, Akk, Minv = local or (None, None, None)
    args = (q, k, v, g, beta, A_log, dt_bias, index.cu_seqlens, index.chunk_offsets, index.chunk_map,
            w, u, qg, kg, Aqk, gC, AqkC, Akk, Minv, scale, 0.0 if lower_bound is None else float(lower_bound), T,
            index.chunks_per_seq, index.num_chunks)
    meta = dict(
        H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BKC=pass1_slice or SLICE, BKN=min(64, triton.next_power_of_2(K)), LHS=LHS,
        USE_GATE=use_gate_in_kernel, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None, USE_L2NORM=use_qk_l2norm_in_kernel,
        BETA_SIGMOID=use_beta_sigmoid_in_kernel, ALLOW_NEG_EIGVAL=allow_neg_eigval,
        SAFE_GATE=safe_gate, IS_VARLEN=index.is_varlen, DOT_PREC=dot_prec,
        # The diagonal inverses keep fp32 accuracy (they were exact fp32 row steps before): three tf32
        # products per product when the rest of the stage uses tf32.
        INV_PREC="ieee" if dot_prec == "ieee" else "tf32x3", STORE_LOCAL=store_local,
    )
    grid = (index.num_chunks, HV)
    if q.is_cuda and num_warps is None and maxnreg is None and solve_slice is None and merge is None:
        chunk_kda_fwd_kernel_intra_tuned[grid](*args, **meta)
    else:
        # Register cap per thread (None: ptxas decides, 255 today).
        chunk_kda_fwd_kernel_intra[grid](*args, **meta, BS=solve_slice or SLICE, MERGE=bool(merge),
                                         num_warps=num_warps or 4, maxnreg=maxnreg)
    return w, u, qg, kg, Aqk, gC, *local
