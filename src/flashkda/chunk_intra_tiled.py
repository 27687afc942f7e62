"""Opt-in small-tile intra-chunk stage: the work of ``chunk_intra`` as two kernels with far smaller programs.

The default intra kernel (``chunk_intra.chunk_kda_fwd_kernel_intra``) runs one 4-warp program per (chunk, value head)
at 255 registers and 2 CTAs per SM. This path splits the same math (same outputs, same numerics rules) in two:

1. ``chunk_kda_fwd_kernel_intra_sub``, grid (chunks x 4 sub-chunks, value heads): one program per 16-row sub-chunk
   ``i``. Over ``[BT, BK]`` slices of K it activates the gate of the whole chunk (its sub-chunk sums are needed by
   every row), writes ``qg``, ``kg``, ``Γ_C`` and the w right-hand side ``k e^Γ`` of its 16 rows, and accumulates the
   ``[16, 64]`` row block of ``Aqk`` and ``Akk`` as one ``[16, BK] x [BK, 64]`` product each per slice. It stores
   the row block of ``Aqk`` (causal part) and of ``Ab``: ``Diag(β) Akk`` left of the diagonal block and the
   diagonal block's inverse ``(I + L_ii)⁻¹`` (product form) in its place.
2. ``chunk_kda_fwd_kernel_solve_wu``, grid (chunks, value heads): assembles ``(I + L)⁻¹ = (I + N)⁻¹ D̃`` from
   ``Ab`` (``D̃`` its diagonal blocks, ``N = D̃ E`` over its off-diagonal blocks, ``(I + N)⁻¹ = I - N + N² - N³``),
   then ``w`` and ``u`` as ``[64, 64] x [64, BS]`` products, exactly as ``chunk_kda_fwd_kernel_wu``.

Numerics: every pair exponent ``e^{Γ_r - Γ_c}`` with ``c`` left of sub-chunk ``i`` is split at the start of ``i``
(row factor ``e^{Γ_r - Γ_{start}}``, column factor a sum of sub-chunk-local gate sums), both ``<= 1``. The diagonal
block uses the bounded-gate factorisation through the sub-chunk start (``safe_gate``) or exact pair-by-pair
exponents, as the default kernel does.

Bytes per (chunk, head) beyond the default kernel (bf16 in, K = V = 128): ``Ab`` written and read (2 x 16 KiB fp32)
and the w right-hand side's round trip through HBM instead of L2 (2 x 16 KiB); the gate and k of the whole chunk
are read by each of the four sub-chunk programs (the three repeats mostly from L2).
"""

import torch
import triton
import triton.language as tl

from flashkda.chunk_intra import (
    _inv_unit_lower,
    _per_row,
    _put_tile,
    _sub_sums,
    _tile,
    _wu_from_inverse,
    activate_gate,
    chunk_span,
    inv_norms,
)
from flashkda.ops import beta_map

#: Launch configurations (kernel 1: K slice width, warps, register cap; kernel 2: w/u slice width, warps). The first
#: entries are what a forced call without ``config`` uses; on a GPU the autotuner picks among all of them. Offline
#: (sm_90, Triton 3.9, bf16, bounded gate; benchmarks/kda/resource_report.py --tiled): kernel 1 at 16/4/128 takes
#: 128 registers with 4 B of spills, 4 CTAs (16 warps) per SM; uncapped 168 registers, 0 B, 3 CTAs; 32-wide slices
#: need 255 registers (2 CTAs) at 4 warps and spill 668 B at 2. Kernel 2: 32/4 254 registers, 0 B, 2 CTAs.
SUB_CONFIGS = [(16, 4, 128), (16, 4, None), (32, 4, None)]
SOLVE_CONFIGS = [(32, 4), (64, 4), (64, 8)]


@triton.jit
def _take_block(b_x, i_s, BC: tl.constexpr):
    """``[BC, BC]``: the column block ``i_s`` of a ``[BC, 4 * BC]`` row block."""
    o_a = tl.arange(0, 4)[None, :, None]
    return tl.sum(tl.where(o_a == i_s, tl.reshape(b_x, [BC, 4, BC]), 0.0), 1)


@triton.jit
def _place_block(b_x, i_s, BC: tl.constexpr):
    """``[BC, 4 * BC]``: ``b_x`` (``[BC, BC]``) in column block ``i_s``, zero elsewhere."""
    o_a = tl.arange(0, 4)[None, :, None]
    return tl.reshape(tl.where(o_a == i_s, tl.broadcast_to(b_x[:, None, :], [BC, 4, BC]), 0.0), [BC, 4 * BC])


@triton.jit(do_not_specialize=["T", "lower_bound", "scale"])
def chunk_kda_fwd_kernel_intra_sub(
    q, k, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, chunk_map,
    w, qg, kg, Aqk, Ab, gC,
    scale, lower_bound, T, NTS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
    SAFE_GATE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr,
):
    """Kernel 1 of the small-tile path (module docstring): one program per (chunk, sub-chunk, value head), grid
    ``(4 * chunks, value heads)``."""
    tl.static_assert(BT == 4 * BC, "the kernel is written out for four sub-chunks")
    # the four sub-chunks of a chunk are neighbours in launch order, so the chunk's g and k (read by all four) are
    # read from HBM about once and then from L2
    i_c, i_s, i_hv = tl.program_id(0) // 4, tl.program_id(0) % 4, tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_span(i_c, cu_seqlens, chunk_offsets, chunk_map, T, NTS, BT, IS_VARLEN)
    if i_n < 0:
        return
    s0 = t0 + i_s * BC
    if s0 >= eos:
        return
    # [BT] rows of the chunk (columns of the row block), [BC] rows of this sub-chunk
    o_t = tl.arange(0, BT)
    m_t = o_t < eos - t0
    o_blk = o_t // BC
    o_i = tl.arange(0, BC)
    m_i = o_i < eos - s0
    o_r = i_s * BC + o_i
    # [4] sub-chunks, for picking this sub-chunk's rows out of chunk-wide [4, BC] / [4, BC, BK] values
    o_a = tl.arange(0, 4)
    if HAS_A:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
    else:
        b_A = 0.0

    # [BT] reciprocal L2 norms of k over the chunk, [BC] of q (with the scale) over the sub-chunk.
    b_rq, b_rk = inv_norms(q, k, s0, t0, eos, i_h, scale, H, K, BC, BT, BK, USE_L2NORM)
    b_rki = tl.sum(tl.where(o_a[:, None] == i_s, tl.reshape(b_rk, [4, BC]), 0.0), 0)
    b_b = tl.load(beta + s0 * HV + i_hv + o_i * HV, mask=m_i, other=0.0).to(tl.float32)
    b_b = tl.where(m_i, beta_map(b_b, BETA_SIGMOID, ALLOW_NEG_EIGVAL), 0.0)

    # [4, 4] sub-chunk pairs (a, b) for the gate sums; [BC] x [BC] pairs inside the diagonal block.
    o_a2 = o_a[:, None]
    o_b2 = o_a[None, :]
    b_Aq = tl.zeros([BC, BT], dtype=tl.float32)
    b_Ak = tl.zeros([BC, BT], dtype=tl.float32)
    if not SAFE_GATE:
        b_Aq3 = tl.zeros([BC, BC], dtype=tl.float32)
        b_Ak3 = tl.zeros([BC, BC], dtype=tl.float32)
    # columns whose block enters the product: left of the diagonal block, plus the diagonal block for the bounded
    # gate (factored through the sub-chunk start: e^{-G} <= e^{16 * 5})
    if SAFE_GATE:
        m_col = (o_blk <= i_s)[:, None]
    else:
        m_col = (o_blk < i_s)[:, None]
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_g = activate_gate(_tile(g, t0, eos, i_hv, o_k, HV, K, BT), dt_bias, b_A, lower_bound, i_hv, o_k, m_t, K,
                            USE_GATE, HAS_A, HAS_BIAS, USE_LOWER_BOUND)
        # [4, BC, BK] cumulative gate from each sub-chunk's start; [4, BK] sub-chunk sums
        b_g3 = tl.reshape(b_g, [4, BC, BK])
        b_G3 = tl.cumsum(b_g3, 1)
        b_s4 = tl.sum(b_g3, 1)
        if i_s == 0:
            tl.store(gC + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.sum(b_s4, 0), mask=m_k)
        # this sub-chunk's rows: local cumulative gate, own sum, sums before and after it
        b_Gi = tl.sum(tl.where(o_a[:, None, None] == i_s, b_G3, 0.0), 0)
        b_si = tl.sum(tl.where(o_a2 == i_s, b_s4, 0.0), 0)
        b_pre = tl.sum(tl.where(o_a2 < i_s, b_s4, 0.0), 0)
        b_post = tl.sum(tl.where(o_a2 > i_s, b_s4, 0.0), 0)
        b_q = _tile(q, s0, eos, i_h, o_k, H, K, BC) * b_rq[:, None]
        b_ki = _tile(k, s0, eos, i_h, o_k, H, K, BC) * b_rki[:, None]
        b_eG = tl.exp(b_pre[None, :] + b_Gi)
        _put_tile(qg, b_q * b_eG, s0, eos, i_hv, o_k, HV, K, BC)
        _put_tile(kg, b_ki * tl.exp((b_si[None, :] - b_Gi) + b_post[None, :]), s0, eos, i_hv, o_k, HV, K, BC)
        # right-hand side of w (without β: kernel 2 folds β into the inverse)
        _put_tile(w, b_ki * b_eG, s0, eos, i_hv, o_k, HV, K, BC)

        # [BT, BK] column operand: column c of block j < i relative to the start of block i,
        # e^{(s_j - G_c) + Σ_{j<b<i} s_b} <= 1; block i itself relative to its start, e^{-G_c} (bounded gate only).
        b_G = tl.reshape(b_G3, [BT, BK])
        b_ec = _per_row(b_s4 + _sub_sums(b_s4, (o_b2 > o_a2) & (o_b2 < i_s)), BC, BK) - b_G
        b_ec = tl.where((o_blk == i_s)[:, None], -b_G, b_ec)
        b_kc = _tile(k, t0, eos, i_h, o_k, H, K, BT) * b_rk[:, None]
        b_kc = tl.where(m_col, b_kc * tl.exp(tl.where(m_col, b_ec, 0.0)), 0.0)
        b_er = tl.exp(b_Gi)
        b_Aq += tl.dot(b_q * b_er, tl.trans(b_kc), input_precision=DOT_PREC)
        b_Ak += tl.dot(b_ki * b_er, tl.trans(b_kc), input_precision=DOT_PREC)
        if not SAFE_GATE:
            for j in range(BC):
                # [BK] row j of the sub-chunk; [BC, BK] exact e^{Γ_r - Γ_j} for r >= j, zero above
                b_kj = tl.sum(tl.where(o_i[:, None] == j, b_ki, 0.0), 0)
                b_gj = tl.sum(tl.where(o_i[:, None] == j, b_Gi, 0.0), 0)
                b_kd = b_kj[None, :] * tl.exp(tl.where(o_i[:, None] >= j, b_Gi - b_gj[None, :], float("-inf")))
                b_Aq3 += tl.where(o_i[None, :] == j, tl.sum(b_q * b_kd, 1)[:, None], 0.0)
                b_Ak3 += tl.where(o_i[None, :] == j, tl.sum(b_ki * b_kd, 1)[:, None], 0.0)
    if not SAFE_GATE:
        b_Aq += _place_block(b_Aq3, i_s, BC)
        b_Ak += _place_block(b_Ak3, i_s, BC)

    # Aqk: the causal part of the row block (the state stage reads nothing above the diagonal).
    m_c = o_t[None, :] <= o_r[:, None]
    p_A = o_i[:, None] * (HV * BT) + o_t[None, :]
    tl.store(Aqk + (s0 * HV + i_hv) * BT + p_A, b_Aq.to(Aqk.dtype.element_ty), mask=m_i[:, None] & m_c)
    # Ab: L = Diag(β) Akk strictly lower left of the diagonal block, (I + L_ii)⁻¹ in the diagonal block.
    b_L = tl.where(o_t[None, :] < o_r[:, None], b_Ak * b_b[:, None], 0.0)
    b_D = tl.reshape(_inv_unit_lower(tl.reshape(_take_block(b_L, i_s, BC), [1, BC, BC]), BC, INV_PREC), [BC, BC])
    b_L = tl.where((o_blk == i_s)[None, :], _place_block(b_D, i_s, BC), b_L)
    tl.store(Ab + (s0 * HV + i_hv) * BT + p_A, b_L, mask=m_i[:, None])


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_kernel_solve_wu(
    v, beta, w, u, Ab, cu_seqlens, chunk_offsets, chunk_map, T, NTS,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Kernel 2 of the small-tile path: the ``[64, 64]`` inverse from ``Ab``, then w and u (GEMM-shaped)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, t0, eos = chunk_span(i_c, cu_seqlens, chunk_offsets, chunk_map, T, NTS, BT, IS_VARLEN)
    if i_n < 0:
        return
    o_r = tl.arange(0, BT)
    m_r = o_r < eos - t0
    o_blk = o_r // BC
    # Rows past the sequence end load as zero: their rows of the inverse are zero and no valid row reads them.
    b_Ab = tl.load(Ab + (t0 * HV + i_hv) * BT + o_r[:, None] * (HV * BT) + o_r[None, :], mask=m_r[:, None],
                   other=0.0)
    b_Dt = tl.where(o_blk[:, None] == o_blk[None, :], b_Ab, 0.0)
    b_E = tl.where(o_blk[None, :] < o_blk[:, None], b_Ab, 0.0)
    b_N = tl.dot(b_Dt, b_E, input_precision=DOT_PREC)
    b_N2 = tl.dot(b_N, b_N, input_precision=DOT_PREC)
    b_M = (tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0) - b_N + b_N2
           - tl.dot(b_N2, b_N, input_precision=DOT_PREC))
    b_b = tl.load(beta + t0 * HV + i_hv + o_r * HV, mask=m_r, other=0.0).to(tl.float32)
    b_b = tl.where(m_r, beta_map(b_b, BETA_SIGMOID, ALLOW_NEG_EIGVAL), 0.0)
    # (I + L)⁻¹ Diag(β)
    b_T = tl.dot(b_M, b_Dt, input_precision=DOT_PREC) * b_b[None, :]
    _wu_from_inverse(v, w, u, b_T, t0, eos, i_hv, HV, K, V, BT, BS, DOT_PREC)


chunk_kda_fwd_kernel_intra_sub_tuned = triton.autotune(
    configs=[triton.Config({"BK": bk}, num_warps=nw, num_stages=1, maxnreg=cap) for bk, nw, cap in SUB_CONFIGS],
    key=["H", "HV", "K", "IS_VARLEN", "SAFE_GATE", "USE_GATE", "DOT_PREC"],
)(chunk_kda_fwd_kernel_intra_sub)
chunk_kda_fwd_kernel_solve_wu_tuned = triton.autotune(
    configs=[triton.Config({"BS": bs}, num_warps=nw, num_stages=2) for bs, nw in SOLVE_CONFIGS],
    key=["HV", "K", "V", "IS_VARLEN", "DOT_PREC"],
    # w is overwritten in place (right-hand side -> w): every timed configuration must start from the right-hand side
    restore_value=["w"],
)(chunk_kda_fwd_kernel_solve_wu)


def chunk_kda_fwd_intra_tiled(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_gate_in_kernel,
                              use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                              index, outputs, dot_prec, config=None):
    """Runs the small-tile intra stage into preallocated outputs (``chunk_intra.chunk_kda_fwd_intra`` with
    ``tiled=True`` allocates them and calls this).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]``; A_log, dt_bias,
            scale, lower_bound and the flags: as in ``flashkda.chunk_kda``.
        index: ``ChunkIndex`` of the batch (at least one chunk).
        outputs: ``(w, u, qg, kg, Aqk, gC)`` as ``chunk_kda_fwd_intra`` returns them, written here.
        dot_prec: ``"ieee"`` or ``"tf32"``.
        config: ``(BK, warps, maxnreg, BS, warps)`` forced for the two kernels (maxnreg None: no register cap;
            config None: autotuned on a GPU, else the first entries of ``SUB_CONFIGS`` and ``SOLVE_CONFIGS``).
    """
    w, u, qg, kg, Aqk, gC = outputs
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT, BC = 64, 16
    # [B, T, HV, 64] fp32 per row: Diag(β) Akk left of the diagonal block, the diagonal block's inverse in it
    Ab = torch.empty(B, T, HV, BT, dtype=torch.float32, device=q.device)
    common = (index.cu_seqlens, index.chunk_offsets, index.chunk_map)
    args = (q, k, g, beta, A_log, dt_bias, *common, w, qg, kg, Aqk, Ab, gC, scale,
            0.0 if lower_bound is None else float(lower_bound), T, index.chunks_per_seq)
    meta = dict(H=H, HV=HV, K=K, BT=BT, BC=BC, USE_GATE=use_gate_in_kernel, HAS_A=A_log is not None,
                HAS_BIAS=dt_bias is not None, USE_LOWER_BOUND=lower_bound is not None,
                USE_L2NORM=use_qk_l2norm_in_kernel, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
                ALLOW_NEG_EIGVAL=allow_neg_eigval, SAFE_GATE=safe_gate, IS_VARLEN=index.is_varlen,
                DOT_PREC=dot_prec, INV_PREC="ieee" if dot_prec == "ieee" else "tf32x3")
    args2 = (v, beta, w, u, Ab, *common, T, index.chunks_per_seq)
    meta2 = dict(HV=HV, K=K, V=V, BT=BT, BC=BC, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
                 ALLOW_NEG_EIGVAL=allow_neg_eigval, IS_VARLEN=index.is_varlen, DOT_PREC=dot_prec)
    if q.is_cuda and config is None:
        chunk_kda_fwd_kernel_intra_sub_tuned[(4 * index.num_chunks, HV)](*args, **meta)
        chunk_kda_fwd_kernel_solve_wu_tuned[(index.num_chunks, HV)](*args2, **meta2)
        return
    bk, nw1, cap, bs, nw2 = config or (*SUB_CONFIGS[0], *SOLVE_CONFIGS[0])
    chunk_kda_fwd_kernel_intra_sub[(4 * index.num_chunks, HV)](*args, **meta, BK=min(bk, triton.next_power_of_2(K)),
                                                                num_warps=nw1, num_stages=1, maxnreg=cap)
    chunk_kda_fwd_kernel_solve_wu[(index.num_chunks, HV)](*args2, **meta2, BS=min(bs, triton.next_power_of_2(max(K, V))),
                                                          num_warps=nw2, num_stages=2)
