"""The Gluon prepare kernel (K1) of the v2 forward; imported only by `flashkda.fwd.v2.prepare` on first launch.

It imports nothing but Triton, so the offline compile script can load it by path with Triton 3.6 and no torch.

One CTA of 8 warps per (16-token chunk, head). Each thread owns 8 tokens of one channel (two lanes share a
channel), so the gate's cumsum runs in registers plus one shuffle, and the L2 norms are one cross-warp reduction per
token. Per CTA (C = 16, K = 128)::

    q, k, g  [C, K] bf16 -> fp32   rows past the chunk's last token load as 0, and their gate is forced to 0
    G        = cumsum(lower_bound * log2(e) * sigmoid(exp(A_log) * (g + dt_bias)))      (fp32, log2 units)
    kd, ki, qd, kr = k 2^G, k 2^-G, q 2^G scale, (k 2^-G) 2^Glast                       (rounded to bf16)
    L        = strict_lower(diag(beta) kd ki^T),  Mqk = lower(qd ki^T)                  (mma.sync, bf16 in, fp32 acc)
    INV      = (I - L)(I + L^2)(I + L^4)(I + L^8)                                        (mma.sync, fp16 in, fp32 acc)

The 16x16 products go through shared memory (bf16 ``kd, qd, ki`` tiles, fp16 16x16 tiles), because an mma.sync
operand layout spreads a row over four lanes while the elementwise layout keeps a channel in two lanes.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

CHUNK = gl.constexpr(16)
HEAD_DIM = gl.constexpr(128)
NUM_WARPS = gl.constexpr(8)
LOG2E = gl.constexpr(1.4426950408889634)
L2NORM_EPS = gl.constexpr(1e-6)

# 8 tokens of one channel per thread
COL = gl.constexpr(gl.BlockedLayout([8, 1], [2, 16], [1, 8], [0, 1]))
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 8], instr_shape=[16, 8]))
DOT_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
DOT_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
SMEM_TOK = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
SMEM_TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=2, order=[1, 0]))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _mm16(a, b, a_s, b_s):
    """``a @ b`` of two [16, 16] fp32 tensors in the MMA layout: fp16 operands, fp32 accumulation."""
    a_s.store(a.to(gl.float16))
    b_s.store(b.to(gl.float16))
    acc = gl.zeros([CHUNK, CHUNK], gl.float32, MMA)
    return mma_v2(a_s.load(DOT_A), b_s.load(DOT_B), acc)


@gluon.jit
def kda_fwd_v2_prepare_kernel(
    q, k, g, beta_in,  # [T_total, H, 128] bf16 x3, [T_total, H] logits (any float)
    A_log, dt_bias,  # [H], [H * 128] (any float; unused without HAS_A_LOG / HAS_DT_BIAS)
    chunk_index,  # [NT, 3] int32 (sequence, first token row, valid tokens)
    kd, qd, kr, inv, mqk, glast, beta,  # the workspace (see flashkda.fwd.v2.workspace)
    scale, gate_scale,  # fp32: query scale, lower_bound * log2(e)
    H,
    HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
):
    C: gl.constexpr = CHUNK
    K: gl.constexpr = HEAD_DIM
    i_c = gl.program_id(0)
    i_h = gl.program_id(1)
    first = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.load(chunk_index + i_c * 3 + 2)

    # ---- elementwise part: one channel per thread, [C, K]
    o_t = gl.arange(0, C, layout=gl.SliceLayout(1, COL))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, COL))
    m_t = o_t < n_valid
    m_tk = gl.expand_dims(m_t, 1) & gl.expand_dims(o_k < K, 0)
    base = (first.to(gl.int64) * H + i_h) * K  # the chunk's first token-head row; rows within it fit int32
    o_tk = gl.expand_dims(o_t * (H * K), 1) + gl.expand_dims(o_k, 0)
    b_q = gl.load(q + base + o_tk, mask=m_tk, other=0.0).to(gl.float32)
    b_k = gl.load(k + base + o_tk, mask=m_tk, other=0.0).to(gl.float32)
    b_g = gl.load(g + base + o_tk, mask=m_tk, other=0.0).to(gl.float32)

    b_q = b_q * gl.expand_dims(gl.rsqrt(gl.sum(b_q * b_q, axis=1) + L2NORM_EPS) * scale, 1)
    b_k = b_k * gl.expand_dims(gl.rsqrt(gl.sum(b_k * b_k, axis=1) + L2NORM_EPS), 1)
    if HAS_DT_BIAS:
        b_g = b_g + gl.expand_dims(gl.load(dt_bias + i_h * K + o_k).to(gl.float32), 0)
    if HAS_A_LOG:
        b_g = b_g * gl.exp2(gl.load(A_log + i_h).to(gl.float32) * LOG2E)
    b_g = gate_scale / (1.0 + gl.exp2(-b_g * LOG2E))
    b_g = gl.where(m_tk, b_g, 0.0)
    b_G = gl.associative_scan(b_g, 0, _add)  # [C, K]
    # padded rows add 0 to the cumsum, so row C - 1 holds the last valid token's G
    G_last = gl.sum(gl.where(gl.expand_dims(o_t == C - 1, 1), b_G, 0.0), axis=0)  # [K]

    e_pos = gl.exp2(b_G)
    b_kd = (b_k * e_pos).to(gl.bfloat16)
    b_qd = (b_q * e_pos).to(gl.bfloat16)
    b_k = b_k * gl.exp2(-b_G)
    b_ki = b_k.to(gl.bfloat16)
    b_kr = (b_k * gl.expand_dims(gl.exp2(G_last), 0)).to(gl.bfloat16)
    gl.store(kd + base + o_tk, b_kd, mask=m_tk)
    gl.store(qd + base + o_tk, b_qd, mask=m_tk)
    gl.store(kr + base + o_tk, b_kr, mask=m_tk)
    tile = i_c.to(gl.int64) * H + i_h
    live = (n_valid > 0).to(gl.float32)
    gl.store(glast + tile * K + o_k, gl.exp2(G_last) * live)

    # ---- 16x16 products
    kd_s = gl.allocate_shared_memory(gl.bfloat16, [C, K], SMEM_TOK, b_kd)
    qd_s = gl.allocate_shared_memory(gl.bfloat16, [C, K], SMEM_TOK, b_qd)
    ki_s = gl.allocate_shared_memory(gl.bfloat16, [C, K], SMEM_TOK, b_ki)
    ki_t = ki_s.permute([1, 0]).load(DOT_B)  # [K, C]
    zero = gl.zeros([C, C], gl.float32, MMA)
    A_kk = mma_v2(kd_s.load(DOT_A), ki_t, zero)
    A_qk = mma_v2(qd_s.load(DOT_A), ki_t, zero)

    o_i = gl.arange(0, C, layout=gl.SliceLayout(1, MMA))
    o_j = gl.arange(0, C, layout=gl.SliceLayout(0, MMA))
    m_i = o_i < n_valid
    rows_i = (first + o_i).to(gl.int64) * H + i_h
    b_beta = gl.load(beta_in + rows_i, mask=m_i, other=0.0).to(gl.float32)
    b_beta = gl.where(m_i, 1.0 / (1.0 + gl.exp2(-b_beta * LOG2E)), 0.0)
    gl.store(beta + rows_i, b_beta, mask=m_i)

    ii = gl.expand_dims(o_i, 1)
    jj = gl.expand_dims(o_j, 0)
    L1 = gl.where(ii > jj, A_kk * gl.expand_dims(b_beta, 1), 0.0)
    A_qk = gl.where(ii >= jj, A_qk, 0.0)
    eye = gl.where(ii == jj, 1.0, 0.0)

    a_s = gl.allocate_shared_memory(gl.float16, [C, C], SMEM_TILE)
    b_s = gl.allocate_shared_memory(gl.float16, [C, C], SMEM_TILE)
    # each product's operands are rounded to fp16 on the way into shared memory, as in emulate.neumann_inverse
    L2 = _mm16(L1, L1, a_s, b_s)
    L4 = _mm16(L2, L2, a_s, b_s)
    L8 = _mm16(L4, L4, a_s, b_s)
    X = _mm16(eye - L1, eye + L2, a_s, b_s)
    X = _mm16(X, eye + L4, a_s, b_s)
    X = _mm16(X, eye + L8, a_s, b_s)
    X = gl.where(gl.expand_dims(m_i, 1), X, 0.0)

    o_ij = (tile * C + ii) * C + jj
    gl.store(inv + o_ij, X.to(gl.bfloat16))
    gl.store(mqk + o_ij, A_qk.to(gl.bfloat16))
