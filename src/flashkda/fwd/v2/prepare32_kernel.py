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
# the batched kernel: the six 16x16x128 products as two [4, 16, 16] batches, one (batch, 8-column half) per warp
MMA3 = _k16.MMA3
DOT_A3 = _k16.DOT_A3
DOT_B3 = _k16.DOT_B3
SMEM_TOK3 = _k16.SMEM_TOK3
SMEM_TILE3 = _k16.SMEM_TILE3
SMEM_KT = _k16.SMEM_KT
SMEM_KT3 = _k16.SMEM_KT3
# unswizzled fp32 [4, 16, 16]: stored whole through the 3D layout, read back 16x16 tiles through the 2D one
SMEM_F32 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
SMEM_F32_3 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
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
def _elementwise32(q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale, gate_scale,
                   GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr):
    """The elementwise part of a chunk: stores ``kd, qd, kr, glast`` and returns the bf16 ``[16, K]`` product
    operands ``kd_A, qd_A, ki_A, kiAr, kd_B, qd_B, ki_B`` (module docstring) in the ``COL`` layout."""
    K: gl.constexpr = HEAD_DIM
    n_a = gl.minimum(n_valid, HALF)
    n_b = gl.maximum(n_valid - HALF, 0)
    q_a, k_a, g_a = _load_tokens(q, k, g, first, n_a, i_h, H, GROUP)
    q_b, k_b, g_b = _load_tokens(q, k, g, first + HALF, n_b, i_h, H, GROUP)
    b_dt, a_log = _gate_params(A_log, dt_bias, i_h, HAS_A_LOG, HAS_DT_BIAS)
    m_a, base_a, o_tk = _token_offsets(first, n_a, i_h, H)
    m_b, base_b, _ = _token_offsets(first + HALF, n_b, i_h, H)
    q_a, k_a, G_a, r = _norm_gate(q_a, k_a, g_a, b_dt, a_log, m_a, scale, gate_scale, HAS_A_LOG, HAS_DT_BIAS)
    q_b, k_b, G_b, Gb_end = _norm_gate(q_b, k_b, g_b, b_dt, a_log, m_b, scale, gate_scale, HAS_A_LOG,
                                       HAS_DT_BIAS)
    G_last = r + Gb_end  # [K]
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, COL))
    gl.store(glast + tile * K + o_k, gl.exp2(G_last), mask=(o_k < K) & (n_valid > 0))
    # half A: stored kd/qd/kr; operands kd_A, qd_A, ki_A = k 2^-G_A, kiAr = k 2^(r - G_A)
    e_a = gl.exp2(G_a)
    kd_a = (k_a * e_a).to(gl.bfloat16)
    qd_a = (q_a * e_a).to(gl.bfloat16)
    gl.store(kd + base_a + o_tk, kd_a, mask=m_a)
    gl.store(qd + base_a + o_tk, qd_a, mask=m_a)
    gl.store(kr + base_a + o_tk, (k_a * gl.exp2(gl.expand_dims(G_last, 0) - G_a)).to(gl.bfloat16), mask=m_a)
    ki_a = (k_a * gl.exp2(-G_a)).to(gl.bfloat16)
    kiar = (k_a * gl.exp2(gl.expand_dims(r, 0) - G_a)).to(gl.bfloat16)
    # half B: stored kd = k 2^(r + G_B'), qd, kr = k 2^(G_B'[15] - G_B'); operands with the reference r
    gl.store(kd + base_b + o_tk, (k_b * gl.exp2(gl.expand_dims(r, 0) + G_b)).to(gl.bfloat16), mask=m_b)
    gl.store(qd + base_b + o_tk, (q_b * gl.exp2(gl.expand_dims(r, 0) + G_b)).to(gl.bfloat16), mask=m_b)
    gl.store(kr + base_b + o_tk, (k_b * gl.exp2(gl.expand_dims(Gb_end, 0) - G_b)).to(gl.bfloat16), mask=m_b)
    e_b = gl.exp2(G_b)
    kd_b = (k_b * e_b).to(gl.bfloat16)
    qd_b = (q_b * e_b).to(gl.bfloat16)
    ki_b = (k_b * gl.exp2(-G_b)).to(gl.bfloat16)
    return kd_a, qd_a, ki_a, kiar, kd_b, qd_b, ki_b


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
    """One CTA per (32-token chunk, value head), grid ``NT * H``; GROUP value heads share a q/k head (GVA). The
    16x16 products run over all 8 warps (6 compute copies)."""
    K: gl.constexpr = HEAD_DIM
    C: gl.constexpr = 2 * HALF
    i_c = gl.program_id(0) // H
    i_h = gl.program_id(0) % H
    first = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.load(chunk_index + i_c * 3 + 2)
    n_a = gl.minimum(n_valid, HALF)
    n_b = gl.maximum(n_valid - HALF, 0)
    tile = i_c.to(gl.int64) * H + i_h
    o_i = gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA))
    o_j = gl.arange(0, HALF, layout=gl.SliceLayout(0, MMA))
    rows_a = (first + o_i).to(gl.int64) * H + i_h
    rows_b = (first + HALF + o_i).to(gl.int64) * H + i_h
    beta_a = gl.load(beta_in + rows_a, mask=o_i < n_a, other=0.0)
    beta_b = gl.load(beta_in + rows_b, mask=o_i < n_b, other=0.0)
    kd_a, qd_a, ki_a, kiar, kd_b, qd_b, ki_b = _elementwise32(
        q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale, gate_scale, GROUP,
        HAS_A_LOG, HAS_DT_BIAS)
    kd_a_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, kd_a)
    qd_a_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, qd_a)
    ki_a_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, ki_a)
    kiar_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, kiar)
    kd_b_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, kd_b)
    qd_b_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, qd_b)
    ki_b_s = gl.allocate_shared_memory(gl.bfloat16, [HALF, K], SMEM_TOK, ki_b)

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


@gluon.jit
def _beta_rows(beta_in, first, n_valid, i_h, H):
    """Indices of the batched products' rows (batch ``b``, row ``i``: token ``(b > 0) * 16 + i``), their validity
    and token-head rows, and the beta logits of L's rows (batches 0-2; the sigmoid is stored from batches 0-1)."""
    o_b = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA3)))
    o_i = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA3)))
    tok = gl.expand_dims(gl.where(o_b > 0, HALF, 0), 1) + gl.expand_dims(o_i, 0)  # [4, 16]
    ok = tok < n_valid
    rows = (first + tok).to(gl.int64) * H + i_h
    b_beta = gl.load(beta_in + rows, mask=ok & gl.expand_dims(o_b < 3, 1), other=0.0)
    return o_b, o_i, ok, rows, b_beta


@gluon.jit
def _products32(left_s, q_s, right_s, b_beta, rows, ok, o_b, o_i, beta, inv, mqk, tile, n_valid):
    """The batched products of a chunk from the operand tiles in shared memory (``left_s = [kd_A, kd_B, kd_B,
    qd_B]``, ``q_s = [qd_A, qd_B, qd_A, qd_B]``, ``right_s = [ki_A, ki_B, kiAr, kiAr]^T``), the beta logits
    ``b_beta`` of L's rows: stores ``beta``, ``inv`` and ``mqk`` of the chunk."""
    K: gl.constexpr = HEAD_DIM
    C: gl.constexpr = 2 * HALF
    right = right_s._reinterpret(gl.bfloat16, [4, K, HALF], SMEM_KT3).load(DOT_B3)
    zero3 = gl.zeros([4, HALF, HALF], gl.float32, MMA3)
    P = mma_v2(left_s._reinterpret(gl.bfloat16, [4, HALF, K], SMEM_TOK3).load(DOT_A3), right, zero3)
    Q = mma_v2(q_s._reinterpret(gl.bfloat16, [4, HALF, K], SMEM_TOK3).load(DOT_A3), right, zero3)

    b_sig = _beta_sigmoid(b_beta, beta, rows, ok & gl.expand_dims(o_b < 3, 1))  # batch 2 stores batch 1's again
    o_j = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA3)))
    bb = gl.expand_dims(gl.expand_dims(o_b, 1), 2)  # [4, 1, 1]
    ii = gl.expand_dims(gl.expand_dims(o_i, 0), 2)  # [1, 16, 1]
    jj = gl.expand_dims(gl.expand_dims(o_j, 0), 1)  # [1, 1, 16]
    P = gl.where(bb < 3, P * gl.expand_dims(b_sig, 2), P)  # rows of L11, L22, L21 times beta
    L1 = gl.where((bb < 2) & (ii > jj), P, 0.0)  # the diagonal blocks; batches 2, 3 invert to I
    eye = gl.where(ii == jj, 1.0, 0.0) + zero3
    a_s3 = gl.allocate_shared_memory(gl.float16, [4, HALF, HALF], SMEM_TILE3)
    b_s3 = gl.allocate_shared_memory(gl.float16, [4, HALF, HALF], SMEM_TILE3)
    X = _neumann_inverse(L1, eye, a_s3, b_s3, MMA3, DOT_A3, DOT_B3)

    # the lower block -B^-1 (L21 A^-1) on 16x16 tiles: batches 0, 1 of X and 2 of P through shared memory
    x_s = gl.allocate_shared_memory(gl.float32, [4, HALF, HALF], SMEM_F32)
    p_s = gl.allocate_shared_memory(gl.float32, [4, HALF, HALF], SMEM_F32)
    x_s._reinterpret(gl.float32, [4, HALF, HALF], SMEM_F32_3).store(X)
    p_s._reinterpret(gl.float32, [4, HALF, HALF], SMEM_F32_3).store(P)
    a_s = gl.allocate_shared_memory(gl.float16, [HALF, HALF], SMEM_TILE)
    b_s = gl.allocate_shared_memory(gl.float16, [HALF, HALF], SMEM_TILE)
    Y = _mm16(p_s.index(2).load(MMA), x_s.index(0).load(MMA), a_s, b_s, MMA, DOT_A, DOT_B)
    X21 = -_mm16(x_s.index(1).load(MMA), Y, a_s, b_s, MMA, DOT_A, DOT_B)

    # stores of the [32, 32] tiles: batch b of X at diagonal block (b, b) for b < 2; Mqk11/22 likewise from Q;
    # Mqk21 from batch 3 of P at block (1, 0); zeros at block (0, 1) from batch 0
    row_ok = gl.expand_dims(ok, 2)  # [4, 16, 1]
    blk = gl.where(bb > 0, 1, 0)
    o_diag = (tile * C + blk * HALF + ii) * C + blk * HALF + jj
    diag = (bb < 2) & (jj < HALF)
    gl.store(inv + o_diag, gl.where(row_ok, X, 0.0).to(gl.bfloat16), mask=diag)
    gl.store(mqk + o_diag, gl.where(ii >= jj, Q, 0.0).to(gl.bfloat16), mask=diag)
    o_lower = (tile * C + HALF + ii) * C + jj + bb * 0  # [4, 16, 16]: only batch 3 stores
    gl.store(mqk + o_lower, P.to(gl.bfloat16), mask=(bb == 3) & (jj < HALF))
    o_upper = (tile * C + ii) * C + HALF + jj + bb * 0  # only batch 0 stores
    zero_bf = gl.zeros([4, HALF, HALF], gl.bfloat16, MMA3)
    gl.store(inv + o_upper, zero_bf, mask=(bb == 0) & (jj < HALF))
    gl.store(mqk + o_upper, zero_bf, mask=(bb == 0) & (jj < HALF))
    o_i2 = gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA))
    o_j2 = gl.arange(0, HALF, layout=gl.SliceLayout(0, MMA))
    ok_b = gl.expand_dims(HALF + o_i2 < n_valid, 1)
    o_x21 = (tile * C + HALF + gl.expand_dims(o_i2, 1)) * C + gl.expand_dims(o_j2, 0)
    gl.store(inv + o_x21, gl.where(ok_b, X21, 0.0).to(gl.bfloat16))


@gluon.jit
def kda_fwd_v2_prepare32_batched_kernel(
    q, k, g, beta_in, A_log, dt_bias, chunk_index, kd, qd, kr, inv, mqk, glast, beta, scale, gate_scale, NT, H,
    GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
):
    """`kda_fwd_v2_prepare32_kernel` with the six 16x16x128 products as two batches of four, one (batch, 8-column
    half) per warp, nothing computed twice: ``[kd_A, kd_B, kd_B, qd_B] x [ki_A, ki_B, kiAr, kiAr]^T`` gives
    ``L11, L22, L21, Mqk21`` and ``[qd_A, qd_B, qd_A, qd_B] x`` the same gives ``Mqk11, Mqk22`` (slots 2, 3 unused);
    the two Neumann inverses run as one batch, ``-B^-1 (L21 A^-1)`` on 16x16 tiles."""
    K: gl.constexpr = HEAD_DIM
    i_c = gl.program_id(0) // H
    i_h = gl.program_id(0) % H
    first = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.load(chunk_index + i_c * 3 + 2)
    tile = i_c.to(gl.int64) * H + i_h
    o_b, o_i, ok, rows, b_beta = _beta_rows(beta_in, first, n_valid, i_h, H)

    left_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    right_s = gl.allocate_shared_memory(gl.bfloat16, [4, K, HALF], SMEM_KT)
    kd_a, qd_a, ki_a, kiar, kd_b, qd_b, ki_b = _elementwise32(
        q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale, gate_scale, GROUP,
        HAS_A_LOG, HAS_DT_BIAS)
    left_s.index(0).store(kd_a)
    left_s.index(1).store(kd_b)
    left_s.index(2).store(kd_b)
    left_s.index(3).store(qd_b)
    q_s.index(0).store(qd_a)
    q_s.index(1).store(qd_b)
    q_s.index(2).store(qd_a)
    q_s.index(3).store(qd_b)
    right_s.index(0).store(gl.permute(ki_a, [1, 0]))
    right_s.index(1).store(gl.permute(ki_b, [1, 0]))
    right_s.index(2).store(gl.permute(kiar, [1, 0]))
    right_s.index(3).store(gl.permute(kiar, [1, 0]))

    _products32(left_s, q_s, right_s, b_beta, rows, ok, o_b, o_i, beta, inv, mqk, tile, n_valid)


# the wide kernel's elementwise layout, [2 halves, 16 tokens, 128 channels]: a thread owns both halves of 4 tokens x
# 2 adjacent channels (4-byte loads and stores), 4 lanes along tokens, 8 lanes x 8 warps along channels
W3 = gl.constexpr(gl.BlockedLayout([2, 4, 2], [1, 4, 8], [1, 1, 8], [2, 1, 0]))
W_H = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, W3)))  # [2] halves
W_T = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(2, W3)))  # [16] tokens
W_K = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(1, W3)))  # [128] channels
W_HK = gl.constexpr(gl.SliceLayout(1, W3))  # [2, 128]


@gluon.jit
def _wide_offsets(first, n_valid, i_h, H):
    """``[2, 16, 128]`` mask of a chunk's valid tokens (half, token, channel), the 64-bit offset of its first
    token-head row and the 32-bit element offsets from there, for tensors with ``H`` heads."""
    hh = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=W_H), 1), 2)  # [2, 1, 1]
    tt = gl.expand_dims(gl.expand_dims(gl.arange(0, HALF, layout=W_T), 0), 2)  # [1, 16, 1]
    kk = gl.expand_dims(gl.expand_dims(gl.arange(0, HEAD_DIM, layout=W_K), 0), 1)  # [1, 1, 128]
    tok = hh * HALF + tt
    mask = (tok < n_valid) & (kk < HEAD_DIM)
    base = (first.to(gl.int64) * H + i_h) * HEAD_DIM
    return mask, base, tok * (H * HEAD_DIM) + kk


@gluon.jit
def _elementwise32_wide(q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale,
                        gate_scale, left_s, q_s, right_s, GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr,
                        HAS_DT_BIAS: gl.constexpr):
    """`_elementwise32` on the whole chunk at once in the ``W3`` layout: stores ``kd, qd, kr, glast`` and writes the
    product operands into ``left_s, q_s, right_s`` (slots as `_products32` reads them). Per element four special
    functions instead of six: ``2^-G`` once, and the factors with the reference ``r`` or the half's end as
    per-channel products (``2^(r - G) = 2^r 2^-G``, both within ``2^+-115``)."""
    K: gl.constexpr = HEAD_DIM
    mask, base, offs = _wide_offsets(first, n_valid, i_h, H)
    if GROUP == 1:
        b_q = gl.load(q + base + offs, mask=mask, other=0.0)
        b_k = gl.load(k + base + offs, mask=mask, other=0.0)
    else:
        _, base_qk, offs_qk = _wide_offsets(first, n_valid, i_h // GROUP, H // GROUP)
        b_q = gl.load(q + base_qk + offs_qk, mask=mask, other=0.0)
        b_k = gl.load(k + base_qk + offs_qk, mask=mask, other=0.0)
    b_g = gl.load(g + base + offs, mask=mask, other=0.0)
    o_k = gl.arange(0, K, layout=W_K)
    if HAS_DT_BIAS:
        b_dt = gl.load(dt_bias + i_h * K + o_k).to(gl.float32)
    if HAS_A_LOG:
        a_log = gl.load(A_log + i_h).to(gl.float32)
    b_q = b_q.to(gl.float32)
    b_k = b_k.to(gl.float32)
    b_g = b_g.to(gl.float32)
    b_q = b_q * gl.expand_dims(gl.rsqrt(gl.sum(b_q * b_q, axis=2) + L2NORM_EPS) * scale, 2)
    b_k = b_k * gl.expand_dims(gl.rsqrt(gl.sum(b_k * b_k, axis=2) + L2NORM_EPS), 2)
    if HAS_DT_BIAS:
        b_g = b_g + gl.expand_dims(gl.expand_dims(b_dt, 0), 1)
    if HAS_A_LOG:
        b_g = b_g * gl.exp2(a_log * LOG2E)
    b_g = gate_scale / (1.0 + gl.exp2(-b_g * LOG2E))
    b_g = gl.where(mask, b_g, 0.0)
    G = gl.associative_scan(b_g, 1, _add)  # in-half cumsum: G_A, and G_B' = G_B - r
    tt = gl.expand_dims(gl.expand_dims(gl.arange(0, HALF, layout=W_T), 0), 2)
    G_end = gl.sum(gl.where(tt == HALF - 1, G, 0.0), axis=1)  # [2, K]: r and G_B'[15] (padded rows add 0)
    h2 = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, W_HK)), 1)  # [2, 1]
    r = gl.sum(gl.where(h2 == 0, G_end, 0.0), axis=0)  # [K]
    b_end = gl.sum(gl.where(h2 == 1, G_end, 0.0), axis=0)
    gl.store(glast + tile * K + o_k, gl.exp2(r + b_end), mask=(o_k < K) & (n_valid > 0))
    e_r = gl.expand_dims(gl.expand_dims(gl.exp2(r), 0), 1)  # [1, 1, K]
    e_end = gl.expand_dims(gl.expand_dims(gl.exp2(b_end), 0), 1)
    hh = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=W_H), 1), 2)
    e_pos = gl.exp2(G)
    kd_op = b_k * e_pos  # k 2^G_A, k 2^G_B'
    qd_op = b_q * e_pos
    ki_op = b_k * gl.exp2(-G)  # k 2^-G_A, k 2^-G_B'
    kiar = ki_op * e_r  # half A: k 2^(r - G_A)
    # stored: kd = k 2^G (half B: k 2^(G_B' + r)), kr = k 2^(Glast - G) (half A: 2^(r - G_A) 2^G_B'[15])
    b_half = hh == 1
    gl.store(kd + base + offs, gl.where(b_half, kd_op * e_r, kd_op).to(gl.bfloat16), mask=mask)
    gl.store(qd + base + offs, gl.where(b_half, qd_op * e_r, qd_op).to(gl.bfloat16), mask=mask)
    gl.store(kr + base + offs, (gl.where(b_half, ki_op, kiar) * e_end).to(gl.bfloat16), mask=mask)

    # operands: left = [kd_A, kd_B, kd_B, qd_B], q = [qd_A, qd_B, qd_A, qd_B], right = [ki_A, ki_B, kiAr, kiAr]^T
    kd_op = kd_op.to(gl.bfloat16)
    qd_op = qd_op.to(gl.bfloat16)
    left3 = left_s._reinterpret(gl.bfloat16, [4, HALF, K], SMEM_TOK3)
    q3 = q_s._reinterpret(gl.bfloat16, [4, HALF, K], SMEM_TOK3)
    right3 = right_s._reinterpret(gl.bfloat16, [4, K, HALF], SMEM_KT3)
    left3.slice(0, 2).store(kd_op)
    q3.slice(0, 2).store(qd_op)
    q3.slice(2, 2).store(qd_op)
    right3.slice(0, 2).store(gl.permute(ki_op.to(gl.bfloat16), [0, 2, 1]))
    _, kd_b = gl.split(gl.permute(kd_op, [1, 2, 0]))
    _, qd_b = gl.split(gl.permute(qd_op, [1, 2, 0]))
    kiar_a, _ = gl.split(gl.permute(kiar.to(gl.bfloat16), [1, 2, 0]))
    left_s.index(2).store(kd_b)
    left_s.index(3).store(qd_b)
    right_s.index(2).store(gl.permute(kiar_a, [1, 0]))
    right_s.index(3).store(gl.permute(kiar_a, [1, 0]))


@gluon.jit
def kda_fwd_v2_prepare32_wide_kernel(
    q, k, g, beta_in, A_log, dt_bias, chunk_index, kd, qd, kr, inv, mqk, glast, beta, scale, gate_scale, NT, H,
    GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
):
    """`kda_fwd_v2_prepare32_batched_kernel` with the elementwise part on the whole chunk in one ``[2, 16, 128]``
    layout (`_elementwise32_wide`): 4-byte global accesses, half the cross-lane shuffles of the L2 norms (a thread
    holds two channels), four special functions per element; the products are the batched kernel's."""
    K: gl.constexpr = HEAD_DIM
    i_c = gl.program_id(0) // H
    i_h = gl.program_id(0) % H
    first = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.load(chunk_index + i_c * 3 + 2)
    tile = i_c.to(gl.int64) * H + i_h
    o_b, o_i, ok, rows, b_beta = _beta_rows(beta_in, first, n_valid, i_h, H)
    left_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    right_s = gl.allocate_shared_memory(gl.bfloat16, [4, K, HALF], SMEM_KT)
    _elementwise32_wide(q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale,
                        gate_scale, left_s, q_s, right_s, GROUP, HAS_A_LOG, HAS_DT_BIAS)
    _products32(left_s, q_s, right_s, b_beta, rows, ok, o_b, o_i, beta, inv, mqk, tile, n_valid)
