"""The Gluon prepare kernel (K1) for 32-token chunks; imported only by `flashkda.fwd.v2.prepare32` on first launch,
and by path (without torch) by the offline compile script.

`kda_fwd_v2_prepare32_kernel`: one CTA of 8 warps per (32-token chunk, value head), grid ``NT * H`` with the
head fastest, capped at `MAX_REGISTERS` per thread. The elementwise part runs on the whole chunk in one
``[2 halves, 16 tokens, 128]`` layout (`_elementwise32`), with the exponent references of ``emulate32`` (so
that no factor leaves ``2^+-115`` at ``lower_bound = -5``)::

    G_A = cumsum(gate_A), r = G_A[15];  G_B' = cumsum(gate_B) (= G_B - r);  Glast = r + G_B'[15]
    stored:  kd = k 2^G, qd = q 2^G scale, kr = k 2^(Glast - G)   (G = G_A, r + G_B'),  glast = 2^Glast
    products (bf16 operands, fp32 accumulation, mma.sync 16x16, two batches of four, `_products32`):
        L11 = kd_A (k_A 2^-G_A)^T,  L22 = (k_B 2^G_B') (k_B 2^-G_B')^T,  L21 = (k_B 2^G_B') (k_A 2^(r - G_A))^T
        Mqk11, Mqk22, Mqk21 likewise with q for the left factor; rows of L times beta
    INV = [[A^-1, 0], [-B^-1 (L21 A^-1), B^-1]]   (Neumann inverses and products from fp16 operands)

The elementwise part, per element:

- **8-byte global accesses.** A thread owns both halves of 2 tokens x 4 adjacent channels (``E3``), so each
  token row of q, k, g, kd, qd, kr is one 8-byte access. The L2 norms reduce 4 channels in registers and over 4
  lanes, then across the 8 warps; the gate's cumsum runs over 8 lanes and 2 registers.
- **The gate in five instructions.** ``gate_scale * sigmoid(exp(A_log) (g + dt_bias))`` as
  ``t = g a + dt_bias a`` (one FFMA, ``a = -exp(A_log) log2(e)`` per head, ``dt_bias a`` per channel),
  ``gate_scale * rcp(1 + 2^t)`` with ``ex2.approx.ftz`` and ``rcp.approx.ftz`` (no ``div.full`` range fix-ups).
  The gate of a token past the chunk's end loads as ``-inf``, so its activation is exactly 0 (``2^t = inf``,
  ``rcp(inf) = 0``) without a select.
- **``2^-G = rcp(2^G)``**: one special function instead of a negation and an ``ex2`` (``2^G`` is within
  ``2^+-115``, a normal number either way, so the reciprocal is within 1 ulp of ``2^-G`` rounded).

Shared memory is laid out so that none of the kernel's own stores and loads conflicts on a bank
(``gl.bank_conflicts`` is 0 for each, ``tests/flashkda/test_fwd_v2_smem.py``; the compiler's scratch of the L2 norms'
cross-warp sums is not ours to lay out): the right operands are stored token-major like the left ones (8-byte stores) and read transposed by
``ldmatrix``; the 16x16 fp16 tiles of the inverses take `prepare_kernel.SMEM_TILE3`; the fp32 tiles swizzle 16-byte
vectors.

Helpers shared with the chunk-16 kernel come from `prepare_kernel`.
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
#: register cap per thread: 3 CTAs of 8 warps per SM (the fastest cap measured, ``docs/flashkda-v2.md``)
MAX_REGISTERS = gl.constexpr(80)
HALF = gl.constexpr(16)
HEAD_DIM = _k16.HEAD_DIM
LOG2E = _k16.LOG2E
L2NORM_EPS = _k16.L2NORM_EPS
SMEM_TOK = _k16.SMEM_TOK
SMEM_TOK3 = _k16.SMEM_TOK3
# 16x16 tiles of the lower block -B^-1 (L21 A^-1): mma.sync over all 8 warps
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 8], instr_shape=[16, 8]))
DOT_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
DOT_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# the six 16x16x128 products as two [4, 16, 16] batches, one (batch, 8-column half) per warp
MMA3 = _k16.MMA3
DOT_A3 = _k16.DOT_A3
DOT_B3 = _k16.DOT_B3
SMEM_TILE = _k16.SMEM_TILE
SMEM_TILE3 = _k16.SMEM_TILE3
# fp32 [4, 16, 16] (64-byte rows), stored whole through the 3D layout and read back 16x16 tiles through the 2D one
SMEM_F32 = gl.constexpr(gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=4, order=[1, 0]))
SMEM_F32_3 = gl.constexpr(gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=4, order=[2, 1, 0]))
_add = _k16._add
_mm16 = _k16._mm16
_neumann_inverse = _k16._neumann_inverse
_beta_sigmoid = _k16._beta_sigmoid


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
    qd_B]``, ``q_s = [qd_A, qd_B, qd_A, qd_B]``, ``right_s = [ki_A, ki_B, kiAr, kiAr]``, all ``[4, 16, K]``), the beta
    ``b_beta`` of L's rows: stores ``beta``, ``inv`` and ``mqk`` of the chunk."""
    K: gl.constexpr = HEAD_DIM
    C: gl.constexpr = 2 * HALF
    right = right_s._reinterpret(gl.bfloat16, [4, HALF, K], SMEM_TOK3).permute([0, 2, 1]).load(DOT_B3)
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


# [2 halves, 16 tokens, 128 channels]: a thread owns both halves of 2 tokens x 4 adjacent channels (8-byte loads
# and stores), 8 lanes along tokens, 4 lanes x 8 warps along channels
E3 = gl.constexpr(gl.BlockedLayout([2, 2, 4], [1, 8, 4], [1, 1, 8], [2, 1, 0]))
E_H = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, E3)))  # [2] halves
E_T = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(2, E3)))  # [16] tokens
E_K = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(1, E3)))  # [128] channels
E_HK = gl.constexpr(gl.SliceLayout(1, E3))  # [2, 128]


@gluon.jit
def _rcp(x):
    """``1 / x`` by ``rcp.approx.ftz.f32`` (1 ulp; ``1 / inf = 0``), without ``div.full``'s range fix-ups."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _token_offsets(first, n_valid, i_h, H):
    """``[2, 16, 128]`` mask of a chunk's valid tokens (half, token, channel), the 64-bit offset of its first
    token-head row and the 32-bit element offsets from there, for tensors with ``H`` heads."""
    hh = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=E_H), 1), 2)  # [2, 1, 1]
    tt = gl.expand_dims(gl.expand_dims(gl.arange(0, HALF, layout=E_T), 0), 2)  # [1, 16, 1]
    kk = gl.expand_dims(gl.expand_dims(gl.arange(0, HEAD_DIM, layout=E_K), 0), 1)  # [1, 1, 128]
    tok = hh * HALF + tt
    mask = (tok < n_valid) & (kk < HEAD_DIM)
    base = (first.to(gl.int64) * H + i_h) * HEAD_DIM
    return mask, base, tok * (H * HEAD_DIM) + kk


@gluon.jit
def _chunk_ends(G, glast, tile, o_k, n_valid):
    """From the in-half cumsums ``G`` (``[2, 16, K]``, ``E3``): stores ``2^Glast`` of the chunk and returns ``r``
    and ``G_B'[15]`` (``[K]`` each)."""
    K: gl.constexpr = HEAD_DIM
    tt = gl.expand_dims(gl.expand_dims(gl.arange(0, HALF, layout=E_T), 0), 2)
    G_end = gl.sum(gl.where(tt == HALF - 1, G, 0.0), axis=1)  # [2, K]: r and G_B'[15] (padded rows add 0)
    h2 = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, E_HK)), 1)  # [2, 1]
    r = gl.sum(gl.where(h2 == 0, G_end, 0.0), axis=0)  # [K]
    b_end = gl.sum(gl.where(h2 == 1, G_end, 0.0), axis=0)
    gl.store(glast + tile * K + o_k, gl.exp2(r + b_end), mask=(o_k < K) & (n_valid > 0))
    return r, b_end


@gluon.jit
def _store_operands(kd_op, qd_op, ki_op, kiar, left_s, q_s, right_s):
    """The products' bf16 operands from the ``[2, 16, K]`` fp32 factors, token-major: left = [kd_A, kd_B, kd_B,
    qd_B], q = [qd_A, qd_B, qd_A, qd_B], right = [ki_A, ki_B, kiAr, kiAr]."""
    K: gl.constexpr = HEAD_DIM
    kd_op = kd_op.to(gl.bfloat16)
    qd_op = qd_op.to(gl.bfloat16)
    left3 = left_s._reinterpret(gl.bfloat16, [4, HALF, K], SMEM_TOK3)
    q3 = q_s._reinterpret(gl.bfloat16, [4, HALF, K], SMEM_TOK3)
    right3 = right_s._reinterpret(gl.bfloat16, [4, HALF, K], SMEM_TOK3)
    left3.slice(0, 2).store(kd_op)
    q3.slice(0, 2).store(qd_op)
    q3.slice(2, 2).store(qd_op)
    right3.slice(0, 2).store(ki_op.to(gl.bfloat16))
    _, kd_b = gl.split(gl.permute(kd_op, [1, 2, 0]))
    _, qd_b = gl.split(gl.permute(qd_op, [1, 2, 0]))
    kiar_a, _ = gl.split(gl.permute(kiar.to(gl.bfloat16), [1, 2, 0]))
    left_s.index(2).store(kd_b)
    left_s.index(3).store(qd_b)
    right_s.index(2).store(kiar_a)
    right_s.index(3).store(kiar_a)


@gluon.jit
def _elementwise32(q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale, gate_scale,
                   left_s, q_s, right_s, GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr):
    """The elementwise part of a chunk, whole, in the ``E3`` layout: stores ``kd, qd, kr, glast`` and writes the
    product operands into ``left_s, q_s, right_s`` (slots as `_products32` reads them). The factors with the
    reference ``r`` or the half's end are per-channel products (``2^(r - G) = 2^r 2^-G``, both within ``2^+-115``)."""
    K: gl.constexpr = HEAD_DIM
    mask, base, offs = _token_offsets(first, n_valid, i_h, H)
    if GROUP == 1:
        b_q = gl.load(q + base + offs, mask=mask, other=0.0)
        b_k = gl.load(k + base + offs, mask=mask, other=0.0)
    else:
        _, base_qk, offs_qk = _token_offsets(first, n_valid, i_h // GROUP, H // GROUP)
        b_q = gl.load(q + base_qk + offs_qk, mask=mask, other=0.0)
        b_k = gl.load(k + base_qk + offs_qk, mask=mask, other=0.0)
    b_g = gl.load(g + base + offs, mask=mask, other=float("-inf"))  # past the end: an activation of exactly 0
    o_k = gl.arange(0, K, layout=E_K)
    # t = -log2(e) exp(A_log) (g + dt_bias) = g a + dt_bias a
    if HAS_A_LOG:
        a = -gl.exp2(gl.load(A_log + i_h).to(gl.float32) * LOG2E) * LOG2E
    else:
        a = -LOG2E
    b_q = b_q.to(gl.float32)
    b_k = b_k.to(gl.float32)
    b_g = b_g.to(gl.float32)
    b_q = b_q * gl.expand_dims(gl.rsqrt(gl.sum(b_q * b_q, axis=2) + L2NORM_EPS) * scale, 2)
    b_k = b_k * gl.expand_dims(gl.rsqrt(gl.sum(b_k * b_k, axis=2) + L2NORM_EPS), 2)
    if HAS_DT_BIAS:
        c = gl.expand_dims(gl.expand_dims(gl.load(dt_bias + i_h * K + o_k).to(gl.float32) * a, 0), 1)
        b_g = b_g * a + c
    else:
        b_g = b_g * a
    b_g = gate_scale * _rcp(1.0 + gl.exp2(b_g))
    G = gl.associative_scan(b_g, 1, _add)  # in-half cumsum: G_A, and G_B' = G_B - r
    r, b_end = _chunk_ends(G, glast, tile, o_k, n_valid)
    e_r = gl.expand_dims(gl.expand_dims(gl.exp2(r), 0), 1)  # [1, 1, K]
    e_end = gl.expand_dims(gl.expand_dims(gl.exp2(b_end), 0), 1)
    hh = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=E_H), 1), 2)
    e_pos = gl.exp2(G)
    kd_op = b_k * e_pos  # k 2^G_A, k 2^G_B'
    qd_op = b_q * e_pos
    ki_op = b_k * _rcp(e_pos)  # k 2^-G_A, k 2^-G_B'
    kiar = ki_op * e_r  # half A: k 2^(r - G_A)
    # stored: kd = k 2^G (half B: k 2^(G_B' + r)), kr = k 2^(Glast - G) (half A: 2^(r - G_A) 2^G_B'[15])
    b_half = hh == 1
    gl.store(kd + base + offs, gl.where(b_half, kd_op * e_r, kd_op).to(gl.bfloat16), mask=mask)
    gl.store(qd + base + offs, gl.where(b_half, qd_op * e_r, qd_op).to(gl.bfloat16), mask=mask)
    gl.store(kr + base + offs, (gl.where(b_half, ki_op, kiar) * e_end).to(gl.bfloat16), mask=mask)
    _store_operands(kd_op, qd_op, ki_op, kiar, left_s, q_s, right_s)


@gluon.jit
def kda_fwd_v2_prepare32_kernel(
    q, k, g, beta_in, A_log, dt_bias, chunk_index, kd, qd, kr, inv, mqk, glast, beta, scale, gate_scale, NT, H,
    GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
):
    """K1 c32 (module docstring): the elementwise part on the whole chunk in one ``[2, 16, 128]`` layout
    (`_elementwise32`), then the six 16x16x128 products as two batches of four (`_products32`:
    ``[kd_A, kd_B, kd_B, qd_B] x [ki_A, ki_B, kiAr, kiAr]^T`` gives ``L11, L22, L21, Mqk21`` and
    ``[qd_A, qd_B, qd_A, qd_B] x`` the same gives ``Mqk11, Mqk22``), the two Neumann inverses as one batch and
    ``-B^-1 (L21 A^-1)`` on 16x16 tiles. Grid ``NT * H`` (the head fastest); ``chunk_index`` rows are
    ``(sequence, first token, valid tokens)``; ``gate_scale = lower_bound / ln 2``."""
    K: gl.constexpr = HEAD_DIM
    i_c = gl.program_id(0) // H
    i_h = gl.program_id(0) % H
    first = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.load(chunk_index + i_c * 3 + 2)
    tile = i_c.to(gl.int64) * H + i_h
    o_b, o_i, ok, rows, b_beta = _beta_rows(beta_in, first, n_valid, i_h, H)
    left_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    right_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    _elementwise32(q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale, gate_scale,
                   left_s, q_s, right_s, GROUP, HAS_A_LOG, HAS_DT_BIAS)
    _products32(left_s, q_s, right_s, b_beta, rows, ok, o_b, o_i, beta, inv, mqk, tile, n_valid)
