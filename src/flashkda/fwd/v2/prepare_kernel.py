"""The Gluon prepare kernel (K1) of the v2 forward; imported only by `flashkda.fwd.v2.prepare` on first launch.

It imports nothing but Triton, so the offline compile script can load it by path with Triton 3.6 and no torch.

One kernel, `kda_fwd_v2_prepare_batched_kernel`, for head width K = 64 or 128: 8 warps per CTA, one CTA per (4
consecutive chunks, head). Each thread owns the tokens of one channel in the chunk's ``[16, K]`` tiles (`col_layout`:
at K = 128 8 tokens, two lanes sharing a channel; at K = 64 4 tokens, four lanes), so the gate's cumsum runs in
registers plus one (two) shuffles, and the L2 norms are one cross-warp reduction per token. Per chunk and head
(C = 16)::

    q, k, g  [C, K] bf16 -> fp32   rows past the chunk's last token load as 0, and their gate is forced to 0
    G        = cumsum(lower_bound * log2(e) * sigmoid(exp(A_log) * (g + dt_bias)))      (fp32, log2 units)
    kd, ki, qd, kr = k 2^G, k 2^-G, q 2^G scale, (k 2^-G) 2^Glast                       (rounded to bf16)
    L        = strict_lower(diag(beta) kd ki^T),  Mqk = lower(qd ki^T)                  (mma.sync, bf16 in, fp32 acc)
    INV      = (I - L)(I + L^2)(I + L^4)(I + L^8)                                        (mma.sync, fp16 in, fp32 acc)

The 16x16 products go through shared memory (bf16 ``kd, qd, ki`` tiles, fp16 16x16 tiles), because an mma.sync
operand layout spreads a row over four lanes while the elementwise layout keeps a channel in a few lanes. A 16x16
result needs only two warps, so the kernel gives each warp its own (chunk, 8-column half) of the [4, 16, 16] products
(with one chunk per CTA, six of the eight warps would compute copies).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

CHUNK = gl.constexpr(16)
#: the chunk-32 kernel's head width (`prepare32_kernel`); this one takes K as an argument
HEAD_DIM = gl.constexpr(128)
NUM_WARPS = gl.constexpr(8)
#: register cap per thread: 4 CTAs of 8 warps per SM (uncapped, ptxas takes 153 at K = 128; the cap is the measured fastest,
#: ``docs/flashkda-v2.md``)
MAX_REGISTERS = gl.constexpr(64)
LOG2E = gl.constexpr(1.4426950408889634)
L2NORM_EPS = gl.constexpr(1e-6)


@gluon.constexpr_function
def col_layout(K):
    """``[C, K]`` tiles over the CTA's warps side by side (K / 8 channels per warp), each thread on the tokens of one
    channel: ``256 / K`` lanes share a channel (two at K = 128, 8 tokens each; four at K = 64, 4 tokens each)."""
    lanes = 32 * NUM_WARPS.value // K
    return gl.BlockedLayout([CHUNK.value // lanes, 1], [lanes, 32 // lanes], [1, NUM_WARPS.value], [0, 1])


SMEM_TOK = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
# the batched kernel: CB chunks per CTA, one (chunk, 8-column half) of every 16x16 product per warp
CB = gl.constexpr(4)
MMA3 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 2], instr_shape=[1, 16, 8]))
DOT_A3 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2))
DOT_B3 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2))
SMEM_TOK3 = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]))
# tiles of 16 16-bit columns (32-byte rows): [K, 16] token-contiguous operands and the 16x16 products. The 16-byte
# vector's phase flips every 4 rows, so the 8 rows of an ldmatrix / stmatrix 8x8 matrix fall in 8 different
# 16-byte bank groups: no bank conflicts (``gl.bank_conflicts``) for the stores from `col_layout` or the mma layouts
# and the loads as either operand, direct or through a transposed view
SMEM_KT = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=4, max_phase=2, order=[1, 0]))
SMEM_KT3 = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=4, max_phase=2, order=[2, 1, 0]))
SMEM_TILE = SMEM_KT
SMEM_TILE3 = SMEM_KT3


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _mm16(a, b, a_s, b_s, mma: gl.constexpr, dot_a: gl.constexpr, dot_b: gl.constexpr):
    """``a @ b`` of (batches of) 16x16 fp32 tensors in the ``mma`` layout: fp16 operands, fp32 accumulation."""
    a_s.store(a.to(gl.float16))
    b_s.store(b.to(gl.float16))
    return mma_v2(a_s.load(dot_a), b_s.load(dot_b), gl.zeros(a.shape, gl.float32, mma))


@gluon.jit
def _neumann_inverse(L1, eye, a_s, b_s, mma: gl.constexpr, dot_a: gl.constexpr, dot_b: gl.constexpr):
    """``(I + L1)^-1 = (I - L1)(I + L1^2)(I + L1^4)(I + L1^8)`` for strictly lower 16x16 ``L1``; each product's
    operands are rounded to fp16 on the way into shared memory, as in ``emulate.neumann_inverse``."""
    L2 = _mm16(L1, L1, a_s, b_s, mma, dot_a, dot_b)
    L4 = _mm16(L2, L2, a_s, b_s, mma, dot_a, dot_b)
    L8 = _mm16(L4, L4, a_s, b_s, mma, dot_a, dot_b)
    X = _mm16(eye - L1, eye + L2, a_s, b_s, mma, dot_a, dot_b)
    X = _mm16(X, eye + L4, a_s, b_s, mma, dot_a, dot_b)
    return _mm16(X, eye + L8, a_s, b_s, mma, dot_a, dot_b)


@gluon.jit
def _token_offsets(first, n_valid, i_h, H, K: gl.constexpr):
    """Mask ``[C, K]`` of a chunk's valid tokens, the 64-bit offset of its first token-head row and the 32-bit
    offsets of its elements from there, for tensors with ``H`` heads."""
    COL: gl.constexpr = col_layout(K)
    o_t = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, COL))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, COL))
    m_tk = gl.expand_dims(o_t < n_valid, 1) & gl.expand_dims(o_k < K, 0)
    base = (first.to(gl.int64) * H + i_h) * K
    o_tk = gl.expand_dims(o_t * (H * K), 1) + gl.expand_dims(o_k, 0)
    return m_tk, base, o_tk


@gluon.jit
def _load_tokens(q, k, g, first, n_valid, i_h, H, K: gl.constexpr, GROUP: gl.constexpr):
    """A chunk's ``q, k, g`` ``[C, K]`` as stored (0 past its last token); GROUP value heads share a q/k head."""
    m_tk, base, o_tk = _token_offsets(first, n_valid, i_h, H, K)
    if GROUP == 1:
        b_q = gl.load(q + base + o_tk, mask=m_tk, other=0.0)
        b_k = gl.load(k + base + o_tk, mask=m_tk, other=0.0)
    else:
        _, base_qk, o_qk = _token_offsets(first, n_valid, i_h // GROUP, H // GROUP, K)
        b_q = gl.load(q + base_qk + o_qk, mask=m_tk, other=0.0)
        b_k = gl.load(k + base_qk + o_qk, mask=m_tk, other=0.0)
    b_g = gl.load(g + base + o_tk, mask=m_tk, other=0.0)
    return b_q, b_k, b_g


@gluon.jit
def _gate_params(A_log, dt_bias, i_h, K: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr):
    """The head's gate bias ``[K]`` (0 without dt_bias) and raw A_log (0 without it, i.e. a factor of 1)."""
    COL: gl.constexpr = col_layout(K)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, COL))
    if HAS_DT_BIAS:
        b_dt = gl.load(dt_bias + i_h * K + o_k).to(gl.float32)
    else:
        b_dt = gl.zeros([K], gl.float32, gl.SliceLayout(0, COL))
    if HAS_A_LOG:
        a_log = gl.load(A_log + i_h).to(gl.float32)
    else:
        a_log = 0.0
    return b_dt, a_log


@gluon.jit
def _prepare_tokens(b_q, b_k, b_g, b_dt, a_log, kd, qd, kr, glast, tile, i_h, first, n_valid, scale, gate_scale,
                    H, K: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr):
    """The elementwise part for one [16, K] chunk-head from its loaded ``q, k, g``: stores ``kd, qd, kr`` and
    ``glast[tile]``, returns the bf16 ``kd, qd, ki`` tiles (in `col_layout`) for the products."""
    C: gl.constexpr = CHUNK
    COL: gl.constexpr = col_layout(K)
    m_tk, base, o_tk = _token_offsets(first, n_valid, i_h, H, K)
    o_t = gl.arange(0, C, layout=gl.SliceLayout(1, COL))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, COL))
    b_q = b_q.to(gl.float32)
    b_k = b_k.to(gl.float32)
    b_g = b_g.to(gl.float32)

    b_q = b_q * gl.expand_dims(gl.rsqrt(gl.sum(b_q * b_q, axis=1) + L2NORM_EPS) * scale, 1)
    b_k = b_k * gl.expand_dims(gl.rsqrt(gl.sum(b_k * b_k, axis=1) + L2NORM_EPS), 1)
    if HAS_DT_BIAS:
        b_g = b_g + gl.expand_dims(b_dt, 0)
    if HAS_A_LOG:
        b_g = b_g * gl.exp2(a_log * LOG2E)
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
    gl.store(glast + tile * K + o_k, gl.exp2(G_last), mask=(o_k < K) & (n_valid > 0))
    return b_kd, b_qd, b_ki


@gluon.jit
def _beta_sigmoid(b, beta, rows, mask):
    """sigmoid of the loaded beta logits ``b`` at token-head ``rows`` (0 where masked), also stored to the
    workspace."""
    b = gl.where(mask, 1.0 / (1.0 + gl.exp2(-b.to(gl.float32) * LOG2E)), 0.0)
    gl.store(beta + rows, b, mask=mask)
    return b


@gluon.jit
def kda_fwd_v2_prepare_batched_kernel(
    q, k, g, beta_in,  # [T_total, H / GROUP, K] bf16 x2, [T_total, H, K], [T_total, H] logits (any float)
    A_log, dt_bias,  # [H], [H * K] (any float; unused without HAS_A_LOG / HAS_DT_BIAS)
    chunk_index,  # [NT, 3] int32 (sequence, first token row, valid tokens)
    kd, qd, kr, inv, mqk, glast, beta,  # the workspace (see flashkda.fwd.v2.workspace)
    scale, gate_scale,  # fp32: query scale, lower_bound * log2(e)
    NT, H,  # chunks, value heads
    K: gl.constexpr, GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
):
    """One CTA per (CB consecutive chunks, value head), grid ``ceil(NT / CB) * H``; head width K (64 or 128); GROUP
    value heads share a q/k head (GVA). The elementwise part runs chunk by chunk; the products run once for all CB
    chunks, each warp on its own (chunk, column half)."""
    gl.static_assert((K == 64) or (K == 128), "K1 serves head widths 64 and 128")
    C: gl.constexpr = CHUNK
    i_b = gl.program_id(0) // H
    i_h = gl.program_id(0) % H
    # written chunk by chunk through 2D views, read back whole through 3D views of the same bytes (the swizzle
    # of each [16, K] / [K, 16] slice is the same in both)
    kd_s = gl.allocate_shared_memory(gl.bfloat16, [CB, C, K], SMEM_TOK)
    qd_s = gl.allocate_shared_memory(gl.bfloat16, [CB, C, K], SMEM_TOK)
    kiT_s = gl.allocate_shared_memory(gl.bfloat16, [CB, K, C], SMEM_KT)
    b_dt, a_log = _gate_params(A_log, dt_bias, i_h, K, HAS_A_LOG, HAS_DT_BIAS)
    for s in range(CB):
        c = i_b * CB + s
        first = gl.load(chunk_index + c * 3 + 1, mask=c < NT, other=0)
        n_valid = gl.load(chunk_index + c * 3 + 2, mask=c < NT, other=0)  # 0 past NT: all masked off
        b_q, b_k, b_g = _load_tokens(q, k, g, first, n_valid, i_h, H, K, GROUP)
        b_kd, b_qd, b_ki = _prepare_tokens(b_q, b_k, b_g, b_dt, a_log, kd, qd, kr, glast, c.to(gl.int64) * H + i_h,
                                           i_h, first, n_valid, scale, gate_scale, H, K, HAS_A_LOG, HAS_DT_BIAS)
        kd_s.index(s).store(b_kd)
        qd_s.index(s).store(b_qd)
        kiT_s.index(s).store(gl.permute(b_ki, [1, 0]))

    # ---- 16x16 products, [CB, C, C]
    o_s = gl.arange(0, CB, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA3)))
    c_s = i_b * CB + o_s
    m_s = c_s < NT
    first_s = gl.load(chunk_index + c_s * 3 + 1, mask=m_s, other=0)
    valid_s = gl.load(chunk_index + c_s * 3 + 2, mask=m_s, other=0)
    o_i = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA3)))
    m_si = gl.expand_dims(o_i, 0) < gl.expand_dims(valid_s, 1)  # [CB, C]
    rows = (gl.expand_dims(first_s, 1) + gl.expand_dims(o_i, 0)).to(gl.int64) * H + i_h
    b_beta = _beta_sigmoid(gl.load(beta_in + rows, mask=m_si, other=0.0), beta, rows, m_si)
    ki_t = kiT_s._reinterpret(gl.bfloat16, [CB, K, C], SMEM_KT3).load(DOT_B3)  # [CB, K, C]
    zero = gl.zeros([CB, C, C], gl.float32, MMA3)
    A_kk = mma_v2(kd_s._reinterpret(gl.bfloat16, [CB, C, K], SMEM_TOK3).load(DOT_A3), ki_t, zero)
    A_qk = mma_v2(qd_s._reinterpret(gl.bfloat16, [CB, C, K], SMEM_TOK3).load(DOT_A3), ki_t, zero)

    o_j = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA3)))
    ii = gl.expand_dims(gl.expand_dims(o_i, 0), 2)  # [1, C, 1]
    jj = gl.expand_dims(gl.expand_dims(o_j, 0), 1)  # [1, 1, C]
    L1 = gl.where(ii > jj, A_kk * gl.expand_dims(b_beta, 2), 0.0)
    A_qk = gl.where(ii >= jj, A_qk, 0.0)
    eye = gl.where(ii == jj, 1.0, 0.0) + gl.zeros([CB, C, C], gl.float32, MMA3)
    a_s = gl.allocate_shared_memory(gl.float16, [CB, C, C], SMEM_TILE3)
    b_s = gl.allocate_shared_memory(gl.float16, [CB, C, C], SMEM_TILE3)
    X = _neumann_inverse(L1, eye, a_s, b_s, MMA3, DOT_A3, DOT_B3)
    X = gl.where(gl.expand_dims(m_si, 2), X, 0.0)

    tile = gl.expand_dims(gl.expand_dims(c_s.to(gl.int64) * H + i_h, 1), 2)  # [CB, 1, 1]
    o_ij = (tile * C + ii) * C + jj
    m_ij = gl.expand_dims(gl.expand_dims(m_s, 1), 2) & (jj < C)
    gl.store(inv + o_ij, X.to(gl.bfloat16), mask=m_ij)
    gl.store(mqk + o_ij, A_qk.to(gl.bfloat16), mask=m_ij)
