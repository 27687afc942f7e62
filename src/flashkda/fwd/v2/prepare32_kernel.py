"""The Gluon prepare kernel (K1) for 32-token chunks; imported only by `flashkda.fwd.v2.prepare32` on first launch,
and by path (without torch) by the offline compile script.

One CTA of 8 warps per (32-token chunk, value head), grid ``NT * H`` with the head fastest. The chunk is handled as
two 16-token halves A and B in the elementwise layout of the chunk-16 kernel (`prepare_kernel`, whose helpers it
uses), with
the exponent references of ``emulate32`` (so that no factor leaves ``2^+-115`` at ``lower_bound = -5``)::

    G_A = cumsum(gate_A), r = G_A[15];  G_B' = cumsum(gate_B) (= G_B - r);  Glast = r + G_B'[15]
    stored:  kd = k 2^G, qd = q 2^G scale, kr = k 2^(Glast - G)   (G = G_A, r + G_B'),  glast = 2^Glast
    products (bf16 operands, fp32 accumulation, mma.sync 16x16):
        L11 = kd_A (k_A 2^-G_A)^T,  L22 = (k_B 2^G_B') (k_B 2^-G_B')^T,  L21 = (k_B 2^G_B') (k_A 2^(r - G_A))^T
        Mqk11, Mqk22, Mqk21 likewise with q for the left factor; rows of L times beta
    INV = [[A^-1, 0], [-B^-1 (L21 A^-1), B^-1]]   (Neumann inverses and products from fp16 operands)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

try:
    from flashkda.fwd.v2 import prepare_kernel as _k16
except ImportError:  # loaded by path by the offline compile script (no flashkda, no torch there)
    _spec = importlib.util.spec_from_file_location("flashkda_v2_prepare_kernel",
                                                   Path(__file__).with_name("prepare_kernel.py"))
    _k16 = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_k16)

NUM_WARPS = _k16.NUM_WARPS
#: register cap per thread: 2 CTAs of 8 warps per SM (uncapped, ptxas takes 155 and spills nothing; at 128 it
#: spills 4 bytes)
MAX_REGISTERS = gl.constexpr(128)
HALF = gl.constexpr(16)
HEAD_DIM = _k16.HEAD_DIM
LOG2E = _k16.LOG2E
L2NORM_EPS = _k16.L2NORM_EPS
COL = _k16.COL
SMEM_TOK = _k16.SMEM_TOK
# the 16x16 products: mma.sync over all 8 warps (a 16x16 result needs two, the other six compute copies)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 8], instr_shape=[16, 8]))
DOT_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
DOT_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
SMEM_TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=2, order=[1, 0]))
_add = _k16._add
_mm16 = _k16._mm16
_neumann_inverse = _k16._neumann_inverse
_token_offsets = _k16._token_offsets
_load_tokens = _k16._load_tokens
_gate_params = _k16._gate_params
_beta_sigmoid = _k16._beta_sigmoid


@gluon.jit
def _norm_gate(b_q, b_k, b_g, b_dt, a_log, m_tk, scale, gate_scale, HAS_A_LOG: gl.constexpr,
               HAS_DT_BIAS: gl.constexpr):
    """A half's L2-normed ``q * scale``, ``k`` and in-half gate cumsum ``G`` (fp32 ``[16, K]``, log2 units), and
    ``G`` at its last row ``[K]`` (the last valid token's: padded rows add 0)."""
    o_t = gl.arange(0, HALF, layout=gl.SliceLayout(1, COL))
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
    b_G = gl.associative_scan(b_g, 0, _add)
    G_end = gl.sum(gl.where(gl.expand_dims(o_t == HALF - 1, 1), b_G, 0.0), axis=0)
    return b_q, b_k, b_G, G_end


@gluon.jit
def _mm_tok(a_s, b_s):
    """``a b^T`` of two bf16 ``[16, K]`` shared tiles, fp32 ``[16, 16]`` in the MMA layout."""
    return mma_v2(a_s.load(DOT_A), b_s.permute([1, 0]).load(DOT_B), gl.zeros([HALF, HALF], gl.float32, MMA))


@gluon.jit
def kda_fwd_v2_prepare32_kernel(
    q, k, g, beta_in,  # [T_total, H / GROUP, 128] bf16 x2, [T_total, H, 128], [T_total, H] logits (any float)
    A_log, dt_bias,  # [H], [H * 128] (any float; unused without HAS_A_LOG / HAS_DT_BIAS)
    chunk_index,  # [NT, 3] int32 (sequence, first token row, valid tokens) of 32-token chunks
    kd, qd, kr, inv, mqk, glast, beta,  # the chunk-32 workspace (flashkda.fwd.v2.workspace32)
    scale, gate_scale,  # fp32: query scale, lower_bound * log2(e)
    NT, H,  # chunks, value heads
    GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
):
    """One CTA per (32-token chunk, value head), grid ``NT * H``; GROUP value heads share a q/k head (GVA)."""
    K: gl.constexpr = HEAD_DIM
    C: gl.constexpr = 2 * HALF
    i_c = gl.program_id(0) // H
    i_h = gl.program_id(0) % H
    first = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.load(chunk_index + i_c * 3 + 2)
    n_a = gl.minimum(n_valid, HALF)
    n_b = gl.maximum(n_valid - HALF, 0)
    tile = i_c.to(gl.int64) * H + i_h
    # every global load first
    q_a, k_a, g_a = _load_tokens(q, k, g, first, n_a, i_h, H, GROUP)
    q_b, k_b, g_b = _load_tokens(q, k, g, first + HALF, n_b, i_h, H, GROUP)
    o_i = gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA))
    o_j = gl.arange(0, HALF, layout=gl.SliceLayout(0, MMA))
    rows_a = (first + o_i).to(gl.int64) * H + i_h
    rows_b = (first + HALF + o_i).to(gl.int64) * H + i_h
    beta_a = gl.load(beta_in + rows_a, mask=o_i < n_a, other=0.0)
    beta_b = gl.load(beta_in + rows_b, mask=o_i < n_b, other=0.0)
    b_dt, a_log = _gate_params(A_log, dt_bias, i_h, HAS_A_LOG, HAS_DT_BIAS)

    m_a, base_a, o_tk = _token_offsets(first, n_a, i_h, H)
    m_b, base_b, _ = _token_offsets(first + HALF, n_b, i_h, H)
    q_a, k_a, G_a, r = _norm_gate(q_a, k_a, g_a, b_dt, a_log, m_a, scale, gate_scale, HAS_A_LOG, HAS_DT_BIAS)
    q_b, k_b, G_b, Gb_end = _norm_gate(q_b, k_b, g_b, b_dt, a_log, m_b, scale, gate_scale, HAS_A_LOG,
                                       HAS_DT_BIAS)
    G_last = r + Gb_end  # [K]
    gl.store(glast + tile * K + gl.arange(0, K, layout=gl.SliceLayout(0, COL)), gl.exp2(G_last),
             mask=(gl.arange(0, K, layout=gl.SliceLayout(0, COL)) < K) & (n_valid > 0))

    # half A: stored kd/qd/kr, product operands kd_A, qd_A, ki_A = k 2^-G_A, kiAr = k 2^(r - G_A)
    e_a = gl.exp2(G_a)
    kd_a = (k_a * e_a).to(gl.bfloat16)
    qd_a = (q_a * e_a).to(gl.bfloat16)
    gl.store(kd + base_a + o_tk, kd_a, mask=m_a)
    gl.store(qd + base_a + o_tk, qd_a, mask=m_a)
    gl.store(kr + base_a + o_tk, (k_a * gl.exp2(gl.expand_dims(G_last, 0) - G_a)).to(gl.bfloat16), mask=m_a)
    kd_a_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, kd_a)
    qd_a_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, qd_a)
    ki_a_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, (k_a * gl.exp2(-G_a)).to(gl.bfloat16))
    kiar_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK,
                                       (k_a * gl.exp2(gl.expand_dims(r, 0) - G_a)).to(gl.bfloat16))
    # half B: stored kd = k 2^(r + G_B'), qd, kr = k 2^(G_B'[15] - G_B'); operands with the reference r
    gl.store(kd + base_b + o_tk, (k_b * gl.exp2(gl.expand_dims(r, 0) + G_b)).to(gl.bfloat16), mask=m_b)
    gl.store(qd + base_b + o_tk, (q_b * gl.exp2(gl.expand_dims(r, 0) + G_b)).to(gl.bfloat16), mask=m_b)
    gl.store(kr + base_b + o_tk, (k_b * gl.exp2(gl.expand_dims(Gb_end, 0) - G_b)).to(gl.bfloat16), mask=m_b)
    e_b = gl.exp2(G_b)
    kd_b_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, (k_b * e_b).to(gl.bfloat16))
    qd_b_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, (q_b * e_b).to(gl.bfloat16))
    ki_b_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, (k_b * gl.exp2(-G_b)).to(gl.bfloat16))

    # ---- the three lower 16x16 blocks of L and Mqk
    L11 = _mm_tok(kd_a_s, ki_a_s)
    M11 = _mm_tok(qd_a_s, ki_a_s)
    L22 = _mm_tok(kd_b_s, ki_b_s)
    M22 = _mm_tok(qd_b_s, ki_b_s)
    L21 = _mm_tok(kd_b_s, kiar_s)
    M21 = _mm_tok(qd_b_s, kiar_s)
    beta_a = _beta_sigmoid(beta_a, beta, rows_a, o_i < n_a)
    beta_b = _beta_sigmoid(beta_b, beta, rows_b, o_i < n_b)
    ii = gl.expand_dims(o_i, 1)
    jj = gl.expand_dims(o_j, 0)
    L11 = gl.where(ii > jj, L11 * gl.expand_dims(beta_a, 1), 0.0)
    L22 = gl.where(ii > jj, L22 * gl.expand_dims(beta_b, 1), 0.0)
    L21 = L21 * gl.expand_dims(beta_b, 1)
    M11 = gl.where(ii >= jj, M11, 0.0)
    M22 = gl.where(ii >= jj, M22, 0.0)
    eye = gl.where(ii == jj, 1.0, 0.0)
    a_s = gl.allocate_shared_memory(gl.float16, [HALF, HALF], SMEM_TILE)
    b_s = gl.allocate_shared_memory(gl.float16, [HALF, HALF], SMEM_TILE)
    A_inv = _neumann_inverse(L11, eye, a_s, b_s, MMA, DOT_A, DOT_B)
    B_inv = _neumann_inverse(L22, eye, a_s, b_s, MMA, DOT_A, DOT_B)
    Y = _mm16(L21, A_inv, a_s, b_s, MMA, DOT_A, DOT_B)
    X21 = -_mm16(B_inv, Y, a_s, b_s, MMA, DOT_A, DOT_B)
    ok_a = gl.expand_dims(o_i < n_a, 1)
    ok_b = gl.expand_dims(o_i < n_b, 1)

    # [32, 32] tiles, row-major: blocks (0, 0), (0, 1), (1, 0), (1, 1) at offsets 0, 16, 512, 528
    o_ij = (tile * C + ii) * C + jj
    zero = gl.zeros([HALF, HALF], gl.bfloat16, MMA)
    gl.store(inv + o_ij, gl.where(ok_a, A_inv, 0.0).to(gl.bfloat16))
    gl.store(inv + o_ij + HALF, zero)
    gl.store(inv + o_ij + HALF * C, gl.where(ok_b, X21, 0.0).to(gl.bfloat16))
    gl.store(inv + o_ij + HALF * C + HALF, gl.where(ok_b, B_inv, 0.0).to(gl.bfloat16))
    gl.store(mqk + o_ij, M11.to(gl.bfloat16))
    gl.store(mqk + o_ij + HALF, zero)
    gl.store(mqk + o_ij + HALF * C, M21.to(gl.bfloat16))
    gl.store(mqk + o_ij + HALF * C + HALF, M22.to(gl.bfloat16))
