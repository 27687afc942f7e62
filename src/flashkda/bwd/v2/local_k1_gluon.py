"""B3b of the v2 backward in Gluon: K1 backwards per (16-token chunk, value head) from B3a's fp32 partials.

The Triton B3b of `local_split_kernel` leaves the layouts to the compiler, which keeps the chunk's ``[16, K]``
tiles in mma layouts and converts them for every row sum and cumsum (about 90 barriers per chunk). Here each
thread owns the tokens of one channel (the forward K1's `col_layout`: 8 tokens, two lanes per channel at K = 128;
4 tokens, four lanes at K = 64): the gate's cumsums run in registers plus one (two) shuffles, the sums over tokens
in registers and shuffles, the row sums over channels are one cross-warp reduction. The products go through shared
memory to mma.sync: ``P = kd ki^T`` and ``inv^T X`` ``[16, 16]``, the ``[16, 16] x [16, K]`` products of
``dL`` and ``dMqk`` with ``ki, kd, qd`` (``dMqk`` as two bf16 operands, ``sp`` below: six products); the chain's second product ``(inv^T X) inv^T`` in fp32 on the FMA units
(`L3`), as the emulation.

Per chunk and value head (C = 16, K = 64 or 128), with the algebra and roundings of ``local_grad_ops._k1_grads``
and ``emulate._local_grads``::

    sums     X, dMf [C, C]; dkd, dqd, dkr [C, K]; dglast [K]; db [C]      (B3a's partials, summed over V blocks)
    K1 again qn, kn, G (cumsum), kd = bf(kn 2^G), ki = bf(kn 2^-G), qd = bf(qn 2^G scale)
    chain    dL = strict(-(INV^T bf(X)) INV^T),  db += rowsum(dL * (kd ki^T))
    products dkd' = bf(dL b) ki,  dki = bf(dL b)^T kd + sp(dMf)^T qd,  dqd' = sp(dMf) ki
    gate     dG = ln2 (dkd' kd + dqd' qd - dki ki + dkd kd_ws + dqd qd_ws - dkr kr_ws), reverse cumsum, + Glast term
    norms    dq, dk through the L2 norms; dg through the bounded sigmoid gate; dbeta through its sigmoid

``bf(x)`` is x rounded to bf16; ``sp(x)`` the pair ``bf(x), bf(x - bf(x))``, each a bf16 operand (`emulate._split`).

Imports Triton and the forward's K1 kernel module (no torch), so the offline compile script can load both by path
(Triton 3.6).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# the forward K1's layout and constants: the tokens of one channel per thread (col_layout), its shared-memory tile
# layouts
from flashkda.fwd.v2.prepare_kernel import CHUNK, L2NORM_EPS, LOG2E, SMEM_KT, SMEM_TOK, _add, col_layout

NUM_WARPS = gl.constexpr(8)  # the forward K1's, over which col_layout spreads the channels
LN2 = gl.constexpr(0.6931471805599453)

# mma.sync m16n8k16 over 8 warps side by side: a [16, K] result is K / 8 columns per warp
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 8], instr_shape=[16, 8]))
DOT_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
DOT_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# [16 rows, 16 summed, 16 columns]: the summed axis in one thread (the fp32 product of the chain)
L3 = gl.constexpr(gl.BlockedLayout([1, 16, 1], [4, 1, 8], [4, 1, 2], [2, 1, 0]))
CC = gl.constexpr(gl.SliceLayout(1, L3))  # [16, 16] tiles of the chain and the dbeta term
SMEM_TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=2, order=[1, 0]))


@gluon.jit
def _bf(x):
    """fp32 -> its bf16 rounding (to nearest), kept in fp32."""
    return x.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _mm_tok(a_s, b_s, acc, K: gl.constexpr):
    """``a @ b + acc``: ``a`` a [16, 16] bf16 tile and ``b`` a [16, K] bf16 tile in shared memory, fp32 [16, K] in
    `col_layout`."""
    return gl.convert_layout(mma_v2(a_s.load(DOT_A), b_s.load(DOT_B), acc), col_layout(K))


@gluon.jit
def kda_bwd_v2_k1_gluon_kernel(
    q, k, g, A_log, dt_bias,  # raw inputs: [T, HQ, K] x2, [T, HV, K]; [HV], [HV * K]
    kd, qd, kr, inv, glast, bsig, chunk_index,  # K1's workspace
    part_ck, part_cc, part_k, part_c,  # B3a's partials [NV, NTS, HV, ...]: dkd/dqd/dkr, X/dMf, dglast, db
    dq, dk, dg, dbeta, part_alog, part_dt,
    bounds, grp, scale, lower_bound, NT, NTS,
    HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, NV: gl.constexpr, HAS_ALOG: gl.constexpr,
    HAS_DT: gl.constexpr,
):
    """One CTA of `NUM_WARPS` warps per (chunk of the group, value head), grid ``(chunks of the group, HV)``; head
    width K (64 or 128); the arguments as the Triton B3b's (`local_split_kernel.kda_bwd_v2_local_chunk_kernel`,
    less its chunk size)."""
    gl.static_assert((K == 64) or (K == 128), "B3b serves head widths 64 and 128")
    C: gl.constexpr = CHUNK
    COL: gl.constexpr = col_layout(K)
    c0 = gl.load(bounds + grp)
    i_j = gl.program_id(0)
    in_group = i_j < gl.load(bounds + grp + 1) - c0
    i_c = gl.minimum(c0 + i_j, NT - 1)
    i_h = gl.program_id(1)
    i_hq = i_h // (HV // HQ)
    row0 = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.where(in_group, gl.load(chunk_index + i_c * 3 + 2), 0)
    live = n_valid > 0
    i_ch = i_c.to(gl.int64) * HV + i_h

    # ---- token tiles [C, K] in COL
    o_t = gl.arange(0, C, layout=gl.SliceLayout(1, COL))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, COL))
    m_t = o_t < n_valid
    m_tk = gl.expand_dims(m_t, 1) & gl.expand_dims(o_k < K, 0)
    l_k = o_k < gl.where(live, K, 0)
    rows = (row0 + o_t).to(gl.int64)
    p_hk = gl.expand_dims((rows * HV + i_h) * K, 1) + gl.expand_dims(o_k, 0)
    p_qk = gl.expand_dims((rows * HQ + i_hq) * K, 1) + gl.expand_dims(o_k, 0)
    o_ck = gl.expand_dims(o_t * K, 1) + gl.expand_dims(o_k, 0)

    b_q = gl.load(q + p_qk, mask=m_tk, other=0.0).to(gl.float32)
    b_k = gl.load(k + p_qk, mask=m_tk, other=0.0).to(gl.float32)
    b_rq = gl.rsqrt(gl.sum(b_q * b_q, axis=1) + L2NORM_EPS)  # [C]
    b_rk = gl.rsqrt(gl.sum(b_k * b_k, axis=1) + L2NORM_EPS)
    b_qn = b_q * gl.expand_dims(b_rq, 1)
    b_kn = b_k * gl.expand_dims(b_rk, 1)
    b_g = gl.load(g + p_hk, mask=m_tk, other=0.0).to(gl.float32)
    if HAS_DT:
        b_g = b_g + gl.expand_dims(gl.load(dt_bias + i_h * K + o_k).to(gl.float32), 0)
    if HAS_ALOG:
        a_log = gl.load(A_log + i_h).to(gl.float32)
        a = gl.exp(a_log)
        a2 = gl.exp2(a_log * LOG2E)
    else:
        a = 1.0
        a2 = 1.0
    b_gl2 = gl.where(m_tk, lower_bound * LOG2E / (1.0 + gl.exp2(-(b_g * a2) * LOG2E)), 0.0)
    b_G = gl.associative_scan(b_gl2, 0, _add)  # [C, K] log2 units
    b_Glast = gl.sum(b_gl2, axis=0)  # [K]
    b_e = gl.exp2(b_G)
    b_kdh = (b_kn * b_e).to(gl.bfloat16)
    b_kih = (b_kn * gl.exp2(-b_G)).to(gl.bfloat16)
    b_qdh = (b_qn * b_e * scale).to(gl.bfloat16)
    kdh_s = gl.allocate_shared_memory(gl.bfloat16, [C, K], SMEM_TOK)
    kih_s = gl.allocate_shared_memory(gl.bfloat16, [C, K], SMEM_TOK)
    qdh_s = gl.allocate_shared_memory(gl.bfloat16, [C, K], SMEM_TOK)
    kiT_s = gl.allocate_shared_memory(gl.bfloat16, [K, C], SMEM_KT)
    kdh_s.store(b_kdh)
    kih_s.store(b_kih)
    qdh_s.store(b_qdh)
    kiT_s.store(gl.permute(b_kih, [1, 0]))

    # ---- [C, C]: B3a's sums, the chain, the dbeta term
    o_i = gl.arange(0, C, layout=gl.SliceLayout(1, CC))
    o_j = gl.arange(0, C, layout=gl.SliceLayout(0, CC))
    ii = gl.expand_dims(o_i, 1)
    jj = gl.expand_dims(o_j, 0)
    o_cc = ii * C + jj
    l_cc = o_cc < gl.where(live, C * C, 0)
    b_X = gl.zeros([C, C], gl.float32, CC)
    b_dMf = gl.zeros([C, C], gl.float32, CC)
    b_db = gl.zeros([C], gl.float32, gl.SliceLayout(1, CC))
    for i_v in gl.static_range(NV):
        i_p = (i_v * NTS + i_j).to(gl.int64) * HV + i_h
        b_X += gl.load(part_cc + i_p * 2 * C * C + o_cc, mask=l_cc, other=0.0)
        b_dMf += gl.load(part_cc + i_p * 2 * C * C + C * C + o_cc, mask=l_cc, other=0.0)
        b_db += gl.load(part_c + i_p * C + o_i, mask=o_i < gl.where(live, C, 0), other=0.0)

    # INV^T bf(X) on mma.sync: INV^T and bf(X) through shared memory
    b_inv = gl.load(inv + i_ch * C * C + o_cc, mask=l_cc, other=0.0)  # [C, C] bf16
    invT_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SMEM_TILE)
    x_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SMEM_TILE)
    invT_s.store(gl.permute(b_inv, [1, 0]))
    x_s.store(b_X.to(gl.bfloat16))
    b_Y = mma_v2(invT_s.load(DOT_A), x_s.load(DOT_B), gl.zeros([C, C], gl.float32, MMA))
    # (INV^T X) INV^T in fp32: [i, j, l] products summed over j in one thread
    o_jl = gl.arange(0, C, layout=gl.SliceLayout(1, gl.SliceLayout(0, L3)))
    o_ll = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))
    p_invT = gl.expand_dims(o_ll * C, 0) + gl.expand_dims(o_jl, 1)  # [j, l] -> INV[l, j]
    l_jl = p_invT < gl.where(live, C * C, 0)
    b_invT = gl.load(inv + i_ch * C * C + p_invT, mask=l_jl, other=0.0).to(gl.float32)  # [C, C] (j, l)
    b_Y3 = gl.expand_dims(gl.convert_layout(b_Y, gl.SliceLayout(2, L3)), 2)  # [C, C, 1]
    b_dL = -gl.sum(b_Y3 * gl.expand_dims(b_invT, 0), axis=1)  # [C, C] in CC
    b_dL = gl.where(ii > jj, b_dL, 0.0)

    # P = kd ki^T (the bf16 factors), the dbeta term of L
    b_P = mma_v2(kdh_s.load(DOT_A), kiT_s.load(DOT_B), gl.zeros([C, C], gl.float32, MMA))
    b_db += gl.sum(b_dL * gl.convert_layout(b_P, CC), axis=1)
    b_b = gl.load(bsig + (row0 + o_i).to(gl.int64) * HV + i_h, mask=o_i < n_valid, other=0.0)  # [C] fp32
    b_dLb = (b_dL * gl.expand_dims(b_b, 1)).to(gl.bfloat16)
    # dMqk as two bf16 operands, its rounding and the remainder (`emulate._split`)
    b_dMm = gl.where(ii >= jj, b_dMf, 0.0)
    b_dM = b_dMm.to(gl.bfloat16)
    b_dMr = (b_dMm - b_dM.to(gl.float32)).to(gl.bfloat16)
    dl_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SMEM_TILE)
    dlT_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SMEM_TILE)
    dm_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SMEM_TILE)
    dmT_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SMEM_TILE)
    dmr_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SMEM_TILE)
    dmrT_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SMEM_TILE)
    dl_s.store(b_dLb)
    dlT_s.store(gl.permute(b_dLb, [1, 0]))
    dm_s.store(b_dM)
    dmT_s.store(gl.permute(b_dM, [1, 0]))
    dmr_s.store(b_dMr)
    dmrT_s.store(gl.permute(b_dMr, [1, 0]))

    # ---- the gate's dG and the normed q, k's gradients, accumulated term by term (few tiles live at once):
    # first the state terms (B3a's dkd, dqd, dkr against the workspace's bf16 factors), then each product's
    b_dkd = gl.zeros([C, K], gl.float32, COL)
    b_dqd = gl.zeros([C, K], gl.float32, COL)
    b_dkr = gl.zeros([C, K], gl.float32, COL)
    b_dglast = gl.zeros([K], gl.float32, gl.SliceLayout(0, COL))
    l_tk = gl.expand_dims(o_t < gl.where(live, C, 0), 1) & gl.expand_dims(o_k < K, 0)
    for i_v in gl.static_range(NV):
        i_p = (i_v * NTS + i_j).to(gl.int64) * HV + i_h
        b_dkd += gl.load(part_ck + i_p * 3 * C * K + o_ck, mask=l_tk, other=0.0)
        b_dqd += gl.load(part_ck + i_p * 3 * C * K + C * K + o_ck, mask=l_tk, other=0.0)
        b_dkr += gl.load(part_ck + i_p * 3 * C * K + 2 * C * K + o_ck, mask=l_tk, other=0.0)
        b_dglast += gl.load(part_k + i_p * K + o_k, mask=l_k, other=0.0)
    b_kdf = gl.load(kd + p_hk, mask=m_tk, other=0.0).to(gl.float32)
    b_qdf = gl.load(qd + p_hk, mask=m_tk, other=0.0).to(gl.float32)
    b_krf = gl.load(kr + p_hk, mask=m_tk, other=0.0).to(gl.float32)
    b_dG = b_dkd * b_kdf + b_dqd * b_qdf - b_dkr * b_krf
    b_dGlast = LN2 * gl.sum(b_dkr * b_krf, axis=0)  # [K], the glast term added below
    b_dkn = b_dkd * b_e + b_dkr * gl.exp2(gl.expand_dims(b_Glast, 0) - b_G)
    b_dqn = b_dqd * b_e
    zero = gl.zeros([C, K], gl.float32, MMA)
    b_dkdh = _mm_tok(dl_s, kih_s, zero, K)
    b_dG += b_dkdh * kdh_s.load(COL).to(gl.float32)
    b_dkn += b_dkdh * b_e
    b_dqdh = _mm_tok(dmr_s, kih_s, mma_v2(dm_s.load(DOT_A), kih_s.load(DOT_B), zero), K)
    b_dG += b_dqdh * qdh_s.load(COL).to(gl.float32)
    b_dqn += b_dqdh * b_e
    b_dkih = mma_v2(dmrT_s.load(DOT_A), qdh_s.load(DOT_B), mma_v2(dlT_s.load(DOT_A), kdh_s.load(DOT_B), zero))
    b_dkih = _mm_tok(dmT_s, qdh_s, b_dkih, K)
    b_dG -= b_dkih * kih_s.load(COL).to(gl.float32)
    b_dkn += b_dkih * gl.exp2(-b_G)

    b_gl = gl.load(glast + i_ch * K + o_k, mask=l_k, other=0.0)  # [K] fp32, 2^Glast
    b_dGlast += LN2 * b_dglast * b_gl
    b_dgl = LN2 * gl.associative_scan(b_dG, 0, _add, reverse=True) + gl.expand_dims(b_dGlast, 0)
    b_x = b_g * a
    b_sig = 1.0 / (1.0 + gl.exp(-b_x))
    b_dx = b_dgl * (lower_bound * LOG2E) * b_sig * (1.0 - b_sig)
    b_dgate = b_dx * a
    gl.store(part_alog + i_ch * K + o_k, gl.sum(gl.where(m_tk, b_dx * b_x, 0.0), axis=0), mask=l_k)
    gl.store(part_dt + i_ch * K + o_k, gl.sum(gl.where(m_tk, b_dgate, 0.0), axis=0), mask=l_k)
    gl.store(dg + p_hk, b_dgate.to(dg.dtype.element_ty), mask=m_tk)

    # ---- the normed q, k, then the L2 norms backwards
    b_dqn = b_dqn * scale
    b_dq = (b_dqn - b_qn * gl.expand_dims(gl.sum(b_dqn * b_qn, axis=1), 1)) * gl.expand_dims(b_rq, 1)
    b_dk = (b_dkn - b_kn * gl.expand_dims(gl.sum(b_dkn * b_kn, axis=1), 1)) * gl.expand_dims(b_rk, 1)
    gl.store(dq + p_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    gl.store(dk + p_hk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    b_db = gl.convert_layout(b_db, gl.SliceLayout(1, COL))
    b_bt = gl.convert_layout(b_b, gl.SliceLayout(1, COL))
    gl.store(dbeta + rows * HV + i_h, (b_db * b_bt * (1.0 - b_bt)).to(dbeta.dtype.element_ty), mask=m_t)
