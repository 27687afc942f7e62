"""The chunk-32 prepare kernel (K1 c32) fed by TMA; imported only by `flashkda.fwd.v2.prepare32` on first launch (with
``kernel="tma"``), and by path (without torch) by the offline compile script.

`kda_fwd_v2_prepare32_tma_kernel` computes what `prepare32_kernel.kda_fwd_v2_prepare32_wide_kernel` computes, with
the same formulas (module docstring there, and ``emulate32``), the way the CUTLASS FlashKDA's K1 keeps many CTAs
resident (``docs/flashkda-v2.md``, "How the CUTLASS FlashKDA's K1 reaches its occupancy"): one CTA of 4 warps per
(32-token chunk, value head), grid ``NT * H`` with the head fastest, and

1. q and k arrive by TMA as four ``[32, 64]`` boxes (a chunk, a channel half: 64 bf16 are one row of the 128-byte
   swizzle, so ``[16, 64]`` tiles stack into taller tiles with the same swizzle), a bf16 gate as four ``[16, 64]``
   boxes, each behind an mbarrier of its own; beta, dt_bias and A_log are a few plain loads issued before the waits
   (beta's token-head rows are not 16-byte aligned for every H; a gate of another dtype is read by plain loads);
2. `_row_norms`: the 64 row norms from shared memory into a 256-byte table;
3. `_gate_ends`: a first pass over half B of the gate gives ``G_B'[15]`` (``kr`` of half A needs it);
4. `_elementwise_tile`, a loop over the four ``[16, 64]`` tiles, half A before half B (not unrolled, so that one
   tile's values are in registers at a time: a thread owns 4 tokens of two channels): the gate and its cumsum (half
   A's end is ``r``, handed to half B through shared memory), then ``kd, qd, kr`` pass through shared memory to
   16-byte stores (`_store_rows`; through the tiles their operands go to, no staging buffer), and the products'
   operands are written over their inputs: ``kd_op`` over ``k``, ``qd_op`` over ``q``, ``[ki_A, kiAr, ki_B]`` over
   and between the gate's tiles;
5. `_products`: two wgmma ``[kd_A; kd_B; qd_A; qd_B] (64 x 128) x [ki_A; kiAr]^T`` and ``x [kiAr; ki_B]^T``
   straight from shared memory (rows of half A keep the first, rows of half B the second: ``L11, L21 | L22,
   Mqk11, Mqk21 | Mqk22``); ``Mqk`` is stored from the accumulator, ``L`` goes through shared memory to the
   mma.sync layout of the block inverse, formed on 32x32 tiles whose off-diagonal blocks are exact zeros (the
   wide kernel's 16x16 results, entry for entry).

Shared memory: 16 KiB of q/k tiles and 12 KiB of gate/operand tiles (29.3 KiB in all, the fp32 ``L`` and the fp16
product tiles over dead ones), and a register cap (`MAX_REGISTERS`, all 72 used, no spills): 7 CTAs (28 warps) per
SM.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

try:
    from flashkda.fwd.v2 import prepare32_kernel as _k32
except ImportError:  # loaded by path by the offline compile script (no flashkda, no torch there)
    _spec = importlib.util.spec_from_file_location("flashkda_v2_prepare32_kernel",
                                                   Path(__file__).with_name("prepare32_kernel.py"))
    _k32 = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_k32)

NUM_WARPS = gl.constexpr(4)
#: register cap per thread: 7 CTAs of 4 warps per SM (65536 / (7 * 128) = 73; shared memory allows 7 too)
MAX_REGISTERS = gl.constexpr(72)
HALF = _k32.HALF
HEAD_DIM = _k32.HEAD_DIM
LOG2E = _k32.LOG2E
L2NORM_EPS = _k32.L2NORM_EPS
#: channels per TMA tile: 64 bf16, one row of the 128-byte swizzle
KH = gl.constexpr(64)
SMEM_TILE = _k32.SMEM_TILE
# plain fp32 tables: stored as [2, n] (SMEM_VEC2), read one row at a time (SMEM_VEC); the [64, 32] L staging
SMEM_VEC = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
SMEM_VEC2 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
# the elementwise layout of a [16, 64] tile: a thread owns every fourth token of two adjacent channels (4-byte
# shared-memory accesses), 4 lanes along tokens (the gate's scan: two shuffle steps), 8 lanes x 4 warps along channels
P2 = gl.constexpr(gl.BlockedLayout([1, 2], [4, 8], [1, NUM_WARPS.value], [1, 0]))
P2_T = gl.constexpr(gl.SliceLayout(1, P2))  # [16] tokens
P2_K = gl.constexpr(gl.SliceLayout(0, P2))  # [64] channels
# a [16, 64] tile by rows: 8 consecutive channels (16 bytes) per thread, a row over 8 lanes (the row norms: three
# shuffles per sum; the stores of the staged outputs: 16 bytes per thread)
ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS.value, 1], [1, 0]))
# the products: one warpgroup, M = 64 (kd_A, kd_B, qd_A, qd_B: a warp per 16 rows), N = 32
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS.value, 1],
                                             instr_shape=[16, 32, 16]))
# the block inverse on 32x32 tiles, a 16x16 quarter per warp
MMA32 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 2], instr_shape=[16, 8]))
DOT_A32 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA32, k_width=2))
DOT_B32 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA32, k_width=2))
_add = _k32._add
_mm16 = _k32._mm16
_beta_sigmoid = _k32._beta_sigmoid


@gluon.jit
def _tiles(buf, start, n: gl.constexpr, layout: gl.constexpr):
    """``n`` consecutive ``[16, 64]`` bf16 tiles of ``buf`` from tile ``start`` as one ``[16 n, 64]`` tile in
    ``layout`` (the 128-byte swizzle: NVMMA for wgmma, or its swizzled twin)."""
    return buf.index(start)._reinterpret(gl.bfloat16, [n * HALF, KH], layout)


@gluon.jit
def _new_barrier():
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    return bar


@gluon.jit
def _vector(buf, i, n: gl.constexpr):
    """Row ``i`` of the ``[2, 2, n]`` fp32 table ``buf`` read as ``[4, n]``."""
    return buf._reinterpret(gl.float32, [4, n], SMEM_VEC).index(i)


@gluon.jit
def _row_norms(kq_s, norms_s, scale):
    """``scale / |q_t|`` and ``1 / |k_t|`` of the chunk's 32 tokens into rows ``h`` (q) and ``2 + h`` (k) of
    ``norms_s`` read as ``[4, 16]`` (rows past the chunk's end hold whatever their bytes give; the elementwise pass
    masks them)."""
    for h in gl.static_range(2):
        s_q = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, ROWS))
        s_k = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, ROWS))
        for j in range(2):  # not unrolled: one tile's values at a time
            b_k = kq_s.index(4 * j + h).load(ROWS).to(gl.float32)
            s_k += gl.sum(b_k * b_k, axis=1)
            b_q = kq_s.index(4 * j + 2 + h).load(ROWS).to(gl.float32)
            s_q += gl.sum(b_q * b_q, axis=1)
        _vector(norms_s, h, HALF).store(gl.rsqrt(s_q + L2NORM_EPS) * scale)
        _vector(norms_s, 2 + h, HALF).store(gl.rsqrt(s_k + L2NORM_EPS))


@gluon.jit
def _gate_act(w_s, g, A_log, dt_bias, first, n_valid, i_h, H, gate_scale, j, h, G_TMA: gl.constexpr,
              HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr):
    """Token half ``h``, channel half ``j``: the activated gate ``[16, 64]`` (0 past the chunk's end), the tile's mask
    and its channels."""
    K: gl.constexpr = HEAD_DIM
    tok = h * HALF + gl.arange(0, HALF, layout=P2_T)
    o_k = j * KH + gl.arange(0, KH, layout=P2_K)
    mask = gl.expand_dims(tok < n_valid, 1) & gl.expand_dims(o_k < K, 0)  # [16, 64]
    if G_TMA:
        b_g = w_s.index(3 * j + 2 * h).load(P2)
    else:
        rows = (first.to(gl.int64) + gl.expand_dims(tok, 1)) * H + i_h
        b_g = gl.load(g + rows * K + gl.expand_dims(o_k, 0), mask=mask, other=0.0)
    b_g = b_g.to(gl.float32)
    if HAS_DT_BIAS:
        b_g = b_g + gl.expand_dims(gl.load(dt_bias + i_h * K + o_k).to(gl.float32), 0)
    if HAS_A_LOG:
        b_g = b_g * gl.exp2(gl.load(A_log + i_h).to(gl.float32) * LOG2E)
    b_g = gate_scale / (1.0 + gl.exp2(-b_g * LOG2E))
    return gl.where(mask, b_g, 0.0), mask, o_k


@gluon.jit
def _gate_ends(w_s, g, A_log, dt_bias, ends_s, first, n_valid, i_h, H, gate_scale, G_TMA: gl.constexpr,
               HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr):
    """The first pass over the gate, half B only: ``G_B'[15]`` (the sum of its activated gates) of channel half j
    into row ``2 + j`` of ``ends_s`` ``[4, 64]``. Half A's end ``r`` comes from its own cumsum in the second pass
    (row j)."""
    for j in range(2):
        b_g, _, _ = _gate_act(w_s, g, A_log, dt_bias, first, n_valid, i_h, H, gate_scale, j, 1, G_TMA, HAS_A_LOG,
                              HAS_DT_BIAS)
        ends_s.index(2 + j).store(gl.sum(b_g, axis=0))


@gluon.jit
def _store_rows(kd_t, qd_t, kr_t, kd, qd, kr, first, n_valid, i_h, H, j, h):
    """The staged ``kd, qd, kr`` ``[16, 64]`` of token half ``h``, channel half ``j`` to the workspace, 16 bytes per
    thread and store."""
    K: gl.constexpr = HEAD_DIM
    tok = h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, ROWS))
    o_k = j * KH + gl.arange(0, KH, layout=gl.SliceLayout(0, ROWS))
    mask = gl.expand_dims(tok < n_valid, 1) & gl.expand_dims(o_k < K, 0)
    base = (first.to(gl.int64) * H + i_h) * K
    offs = gl.expand_dims(tok * (H * K), 1) + gl.expand_dims(o_k, 0)
    gl.store(kd + base + offs, kd_t.load(ROWS), mask=mask)
    gl.store(qd + base + offs, qd_t.load(ROWS), mask=mask)
    gl.store(kr + base + offs, kr_t.load(ROWS), mask=mask)


@gluon.jit
def _elementwise_tile(kq_s, w_s, norms_s, ends_s, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H,
                      tile, gate_scale, j, h, G_TMA: gl.constexpr, HAS_A_LOG: gl.constexpr,
                      HAS_DT_BIAS: gl.constexpr):
    """Token half ``h``, channel half ``j`` (`_elementwise32_wide`'s formulas; half A before half B): stores its
    ``kd, qd, kr`` (and from half A ``glast`` of its channels), then writes the products' operands: ``kd_op`` over
    ``k``, ``qd_op`` over ``q``, ``ki`` over its gate tile ``3j + 2h`` and from half A ``kiAr`` into ``3j + 1``.
    The stored values pass through the tiles their operands go to (``kr`` through ``3j + 1 + h``), so the stores
    need no staging buffer of their own."""
    K: gl.constexpr = HEAD_DIM
    b_g, mask, o_k = _gate_act(w_s, g, A_log, dt_bias, first, n_valid, i_h, H, gate_scale, j, h, G_TMA, HAS_A_LOG,
                               HAS_DT_BIAS)
    G = gl.associative_scan(b_g, 0, _add)  # G_A, or G_B' = G_B - r
    o_t = gl.expand_dims(gl.arange(0, HALF, layout=P2_T), 1)
    G_end = gl.sum(gl.where(o_t == HALF - 1, G, 0.0), axis=0)  # [64]; padded rows add 0
    # r = G_A[15]: half A's own (and for half B, which comes next, through ends_s row j)
    r = gl.where(h == 0, G_end, ends_s.index(j).load(P2_K))
    if h == 0:
        ends_s.index(j).store(G_end)
    b_end = ends_s.index(2 + j).load(P2_K)
    e_r = gl.expand_dims(gl.exp2(r), 0)  # [1, 64]
    e_end = gl.expand_dims(gl.exp2(b_end), 0)
    # factors of exactly 1 pick the half's formula without a branch: kd = kd_op (A), kd_op 2^r (B);
    # kr = (ki_op 2^r) 2^G_B'[15] (A), ki_op 2^G_B'[15] (B); qd like kd
    f_b = gl.where(h == 1, e_r, 1.0)
    f_a = gl.where(h == 0, e_r, 1.0)
    e_pos = gl.exp2(G)

    k_t = kq_s.index(4 * j + h)
    q_t = kq_s.index(4 * j + 2 + h)
    x_t = w_s.index(3 * j + 1 + h)  # kiAr (A) or ki_B (B); kr on its way out first
    r_k = gl.expand_dims(_vector(norms_s, 2 + h, HALF).load(P2_T), 1)  # [16, 1]
    b_k = gl.where(mask, k_t.load(P2).to(gl.float32) * r_k, 0.0)
    kd_op = b_k * e_pos  # k 2^G_A, k 2^G_B'
    ki_op = b_k * gl.exp2(-G)  # k 2^-G_A, k 2^-G_B'
    kiar = ki_op * f_a  # half A: k 2^(r - G_A); half B: ki_op
    if h == 0:
        w_s.index(3 * j).store(ki_op.to(gl.bfloat16))  # over the gate tile this thread read the same elements of
        gl.store(glast + tile * K + o_k, gl.exp2(r + b_end), mask=(o_k < K) & (n_valid > 0))
    r_q = gl.expand_dims(_vector(norms_s, h, HALF).load(P2_T), 1)
    b_q = gl.where(mask, q_t.load(P2).to(gl.float32) * r_q, 0.0)
    qd_op = b_q * e_pos
    # each thread writes the elements it read: no other thread's load of this tile is pending
    k_t.store((kd_op * f_b).to(gl.bfloat16))
    q_t.store((qd_op * f_b).to(gl.bfloat16))
    x_t.store((kiar * e_end).to(gl.bfloat16))
    kd_op = kd_op.to(gl.bfloat16)  # held as bf16 across the stores
    qd_op = qd_op.to(gl.bfloat16)
    kiar = kiar.to(gl.bfloat16)
    gl.thread_barrier()
    _store_rows(k_t, q_t, x_t, kd, qd, kr, first, n_valid, i_h, H, j, h)
    gl.thread_barrier()
    x_t.store(kiar)
    if h == 1:  # half A's kd, qd are its operands already (f_b = 1)
        k_t.store(kd_op)
        q_t.store(qd_op)


@gluon.jit
def _neumann_inverse(L1, eye, a_s, b_s, mma: gl.constexpr, dot_a: gl.constexpr, dot_b: gl.constexpr):
    """`prepare_kernel._neumann_inverse`'s six products, ``(I - L1)(I + L1^2)(I + L1^4)(I + L1^8)``, each from the
    same fp16 operands, issued so that at most three 32x32 tiles are live (registers)."""
    L2 = _mm16(L1, L1, a_s, b_s, mma, dot_a, dot_b)
    X = _mm16(eye - L1, eye + L2, a_s, b_s, mma, dot_a, dot_b)
    L4 = _mm16(L2, L2, a_s, b_s, mma, dot_a, dot_b)
    X = _mm16(X, eye + L4, a_s, b_s, mma, dot_a, dot_b)
    L8 = _mm16(L4, L4, a_s, b_s, mma, dot_a, dot_b)
    return _mm16(X, eye + L8, a_s, b_s, mma, dot_a, dot_b)


@gluon.jit
def _products(kq_s, w_s, nvmma: gl.constexpr, b_beta, beta, rows, ok, inv, mqk, tile):
    """``L``, ``Mqk`` and ``INV`` of the chunk from the operand tiles; stores ``beta``, ``inv`` and ``mqk``.

    ``A_j = [kd_A; kd_B; qd_A; qd_B]`` (``kq_s`` tiles ``4j..4j+3``), ``W0_j = [ki_A; kiAr]``, ``W1_j = [kiAr;
    ki_B]`` (``w_s`` tiles ``3j, 3j+1`` and ``3j+1, 3j+2``); ``sum_j A_j W0_j^T`` keeps its rows of half A
    (``L11``, ``Mqk11`` in columns 0-15), ``sum_j A_j W1_j^T`` its rows of half B (``L21 | L22``, ``Mqk21 |
    Mqk22``); the other entries are masked off. K = 128 runs as the two channel halves in order."""
    C: gl.constexpr = 2 * HALF
    acc0 = gl.zeros([4 * HALF, C], gl.float32, ACC)
    acc1 = gl.zeros([4 * HALF, C], gl.float32, ACC)
    for j in gl.static_range(2):
        a = _tiles(kq_s, 4 * j, 4, nvmma)  # [64, 64]
        acc0 = warpgroup_mma(a, _tiles(w_s, 3 * j, 2, nvmma).permute((1, 0)), acc0)
        acc1 = warpgroup_mma(a, _tiles(w_s, 3 * j + 1, 2, nvmma).permute((1, 0)), acc1)
    rr = gl.expand_dims(gl.arange(0, 4 * HALF, layout=gl.SliceLayout(1, ACC)), 1)  # [64, 1]
    cc = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, ACC)), 0)  # [1, 32]
    S = gl.where((rr % C) < HALF, acc0, acc1)
    # Mqk: rows 32-63, lower triangle with the diagonal (rows past the chunk's end are zero: q was masked)
    i_m = rr - C
    gl.store(mqk + (tile * C + i_m) * C + cc, gl.where(cc <= i_m, S, 0.0).to(gl.bfloat16), mask=(i_m >= 0) & (cc < C))
    # L: rows 0-31 into the mma.sync layout through shared memory (over q/k: the wgmmas above have completed)
    gl.thread_barrier()
    s_s = kq_s._reinterpret(gl.float32, [4 * HALF, C], SMEM_VEC2)
    s_s.store(S)
    gl.thread_barrier()
    P = s_s.slice(0, C).load(MMA32)  # [32, 32]

    ii = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(1, MMA32)), 1)  # [32, 1]
    jj = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, MMA32)), 0)  # [1, 32]
    b_sig = _beta_sigmoid(b_beta, beta, rows, ok)
    L = gl.where(jj < ii, P * gl.expand_dims(b_sig, 1), 0.0)  # rows of L times beta
    diag = (ii < HALF) == (jj < HALF)
    eye = gl.where(ii == jj, 1.0, 0.0) + gl.zeros([C, C], gl.float32, MMA32)
    # the fp16 product tiles over the operand tiles (read by the wgmmas above)
    a_s = w_s.index(0)._reinterpret(gl.float16, [C, C], SMEM_TILE)
    b_s = w_s.index(1)._reinterpret(gl.float16, [C, C], SMEM_TILE)
    # blockdiag(A^-1, B^-1): the off-diagonal blocks add exact zeros to every product
    X = _neumann_inverse(gl.where(diag, L, 0.0), eye, a_s, b_s, MMA32, DOT_A32, DOT_B32)
    # the lower block: Y = L21 A^-1 (rounded to fp16 in _mm16), then -B^-1 Y; X - X Y is that block and X elsewhere
    Y = _mm16(gl.where(diag, 0.0, L), X, a_s, b_s, MMA32, DOT_A32, DOT_B32)
    X = X - _mm16(X, Y, a_s, b_s, MMA32, DOT_A32, DOT_B32)
    gl.store(inv + (tile * C + ii) * C + jj, gl.where(gl.expand_dims(ok, 1), X, 0.0).to(gl.bfloat16))


@gluon.jit
def kda_fwd_v2_prepare32_tma_kernel(
    q_desc, k_desc, g_desc,  # TMA: [T_total, H / GROUP * 128] bf16 x2 ([32, 64] boxes), [T_total, H * 128] bf16 ([16, 64])
    g, beta_in,  # [T_total, H, 128] raw gate (read here only without G_TMA), [T_total, H] logits (any float)
    A_log, dt_bias,  # [H], [H * 128] (any float; unused without HAS_A_LOG / HAS_DT_BIAS)
    chunk_index,  # [NT, 3] int32 (sequence, first token row, valid tokens)
    kd, qd, kr, inv, mqk, glast, beta,  # the chunk-32 workspace (see flashkda.fwd.v2.workspace32)
    scale, gate_scale,  # fp32: query scale, lower_bound * log2(e)
    NT, H,  # chunks, value heads
    GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr, G_TMA: gl.constexpr,
):
    """K1 c32 by TMA (module docstring). G_TMA: the gate is bf16 and comes by TMA (``g_desc``); otherwise it is
    read from ``g`` by plain loads (``g_desc`` is not used)."""
    K: gl.constexpr = HEAD_DIM
    i_c = gl.program_id(0) // H
    i_h = gl.program_id(0) % H
    first = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.load(chunk_index + i_c * 3 + 2)
    tile = i_c.to(gl.int64) * H + i_h
    i_hq = i_h // GROUP

    nvmma: gl.constexpr = q_desc.layout
    # kq_s tile 4j + h: k of token half h, channels 64j..64j+63; tile 4j + 2 + h: q (then kd_op, qd_op)
    kq_s = gl.allocate_shared_memory(gl.bfloat16, [8, HALF, KH], nvmma)
    # w_s tiles 3j, 3j + 2: the gate of halves A, B (by TMA); then 3j, 3j + 1, 3j + 2 = ki_A, kiAr, ki_B
    w_s = gl.allocate_shared_memory(gl.bfloat16, [6, HALF, KH], nvmma)
    norms_s = gl.allocate_shared_memory(gl.float32, [2, 2, HALF], SMEM_VEC2)
    ends_s = gl.allocate_shared_memory(gl.float32, [4, KH], SMEM_VEC)
    # q, k: four copies of [32, 64] (a chunk, a channel half); the gate: four of [16, 64] (its halves A, B go to
    # tiles 3j, 3j + 2, around kiAr's); each copy behind an mbarrier of its own, issued as all inits, all expects,
    # all copies: the compiler puts a CTA barrier between two accesses to one mbarrier
    k0_b = _new_barrier()
    k1_b = _new_barrier()
    q0_b = _new_barrier()
    q1_b = _new_barrier()
    g0a_b = _new_barrier()
    g0b_b = _new_barrier()
    g1a_b = _new_barrier()
    g1b_b = _new_barrier()
    fence_async_shared()
    mbarrier.expect(k0_b, k_desc.block_type.nbytes)
    mbarrier.expect(k1_b, k_desc.block_type.nbytes)
    mbarrier.expect(q0_b, q_desc.block_type.nbytes)
    mbarrier.expect(q1_b, q_desc.block_type.nbytes)
    if G_TMA:
        mbarrier.expect(g0a_b, g_desc.block_type.nbytes)
        mbarrier.expect(g0b_b, g_desc.block_type.nbytes)
        mbarrier.expect(g1a_b, g_desc.block_type.nbytes)
        mbarrier.expect(g1b_b, g_desc.block_type.nbytes)
    # (the compiler also orders two copies into one allocation by a CTA barrier: the gate's go between the others)
    tma.async_copy_global_to_shared(k_desc, [first, i_hq * K], k0_b, _tiles(kq_s, 0, 2, nvmma))
    if G_TMA:
        tma.async_copy_global_to_shared(g_desc, [first, i_h * K], g0a_b, w_s.index(0))
    tma.async_copy_global_to_shared(k_desc, [first, i_hq * K + KH], k1_b, _tiles(kq_s, 4, 2, nvmma))
    if G_TMA:
        tma.async_copy_global_to_shared(g_desc, [first + HALF, i_h * K], g0b_b, w_s.index(2))
    tma.async_copy_global_to_shared(q_desc, [first, i_hq * K], q0_b, _tiles(kq_s, 2, 2, nvmma))
    if G_TMA:
        tma.async_copy_global_to_shared(g_desc, [first, i_h * K + KH], g1a_b, w_s.index(3))
    tma.async_copy_global_to_shared(q_desc, [first, i_hq * K + KH], q1_b, _tiles(kq_s, 6, 2, nvmma))
    if G_TMA:
        tma.async_copy_global_to_shared(g_desc, [first + HALF, i_h * K + KH], g1b_b, w_s.index(5))

    # beta's logits while the copies are in flight (rows of the block inverse's layout)
    o_i = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(1, MMA32))
    ok = o_i < n_valid
    rows = (first + o_i).to(gl.int64) * H + i_h
    b_beta = gl.load(beta_in + rows, mask=ok, other=0.0)
    mbarrier.wait(k0_b, 0)
    mbarrier.wait(k1_b, 0)
    mbarrier.wait(q0_b, 0)
    mbarrier.wait(q1_b, 0)
    if G_TMA:
        mbarrier.wait(g0a_b, 0)
        mbarrier.wait(g0b_b, 0)
        mbarrier.wait(g1a_b, 0)
        mbarrier.wait(g1b_b, 0)

    _row_norms(kq_s, norms_s, scale)
    _gate_ends(w_s, g, A_log, dt_bias, ends_s, first, n_valid, i_h, H, gate_scale, G_TMA, HAS_A_LOG, HAS_DT_BIAS)
    for i in range(4):  # not unrolled; half A before half B (half B takes r from half A)
        gl.thread_barrier()  # the previous tile's reads of the tiles written here, its write of r
        _elementwise_tile(kq_s, w_s, norms_s, ends_s, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid,
                          i_h, H, tile, gate_scale, i // 2, i % 2, G_TMA, HAS_A_LOG, HAS_DT_BIAS)
    # the operands were written by plain stores; the wgmmas read them through the async proxy
    fence_async_shared()
    gl.thread_barrier()
    _products(kq_s, w_s, nvmma, b_beta, beta, rows, ok, inv, mqk, tile)
    # here every thread has long passed its waits
    mbarrier.invalidate(k0_b)
    mbarrier.invalidate(k1_b)
    mbarrier.invalidate(q0_b)
    mbarrier.invalidate(q1_b)
    mbarrier.invalidate(g0a_b)
    mbarrier.invalidate(g0b_b)
    mbarrier.invalidate(g1a_b)
    mbarrier.invalidate(g1b_b)
