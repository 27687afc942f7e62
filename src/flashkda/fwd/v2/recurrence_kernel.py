"""The Gluon recurrence kernel (K2) of the v2 forward; imported only by `flashkda.fwd.v2.recurrence` on first launch.

One CTA per (sequence, head, V-slice of ``BV`` columns), one warpgroup per 64 columns; the head width ``K = V`` (64
or 128) is a constexpr, and ``BV`` is 64 or 128 at ``K = 128``, 64 at ``K = 64`` (wgmma's smallest M). The state is
kept transposed, ``S^T`` ``[BV, K]``, as the fp32 accumulator of Hopper ``wgmma`` (V on M, so M = 64 per
warpgroup), and never leaves registers between chunks. Per 16-token chunk (shapes per CTA)::

    u^T  = S^T kd^T                      [BV, 16]   A = bf16(S^T) from registers, B = kd tile (smem, TMA)
    qS^T = S^T qd^T                      [BV, 16]
    U^T  = bf16((v - u)^T beta) INV^T    [BV, 16]   B = INV tile viewed transposed
    o^T  = qS^T + bf16(U^T) Mqk^T        [BV, 16]
    S^T  = S^T diag(glast) + bf16(U^T) kr   [BV, K]

``kd, qd, kr, INV, Mqk`` arrive by TMA through a ring of ``STAGES`` shared-memory slots, ``STAGES - 1`` chunks ahead
of the math; ``v``, ``beta`` and ``glast`` are loaded into registers two chunks ahead. Token rows past a sequence's
end belong to the next sequence (or are TMA zero fill): ``W = (v - u) beta`` is selected to zero there (so ``U`` is
zero there too), they add nothing to the state, and ``o`` is stored only for valid rows. Such rows may even be uninitialised memory (tokens
after the last sequence): ``v - u`` is selected away there, and the ``kr`` rows of a partial chunk are zeroed in
shared memory, so no NaN can reach the state.

With ``EVERY > 0`` (training) the kernel also stores the state entering every ``EVERY``-th chunk of a sequence
(chunk ``j`` with ``j % EVERY == 0``) as bf16 to ``ckpt`` ``[NCK, H, K, V]`` (K-first), row
``ck_offsets[n] + j // EVERY`` (`flashkda.bwd.v2.checkpoints`); ``EVERY = 0`` compiles the stores away.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

CHUNK = gl.constexpr(16)


@gluon.jit
def _sequence(cu_seqlens, seq_chunks, order, USE_ORDER: gl.constexpr, C: gl.constexpr, NV: gl.constexpr):
    """This program's sequence and head: ``(i_n, i_h, i_v, bos, eos, c0, n_chunks, n_full)`` (``c0`` its first
    chunk in the flattened chunk index)."""
    i_hv = gl.program_id(0)
    i_n = gl.program_id(1)
    i_h = i_hv // NV
    i_v = i_hv % NV
    if USE_ORDER:
        i_n = gl.load(order + i_n)
    bos = gl.load(cu_seqlens + i_n)
    eos = gl.load(cu_seqlens + i_n + 1)
    c0 = gl.load(seq_chunks + i_n)
    return i_n, i_h, i_v, bos, eos, c0, (eos - bos + C - 1) // C, (eos - bos) // C


@gluon.jit
def _issue_chunk_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, kd_s, qd_s, kr_s, inv_s, mqk_s,
                       kd_b, qd_b, kr_b, inv_b, mqk_b, j, bos, c0, i_h, H, K: gl.constexpr,
                       STAGES: gl.constexpr):
    # one mbarrier ring per tensor: TMA copies that share a barrier get a CTA barrier between them from the
    # compiler; with separate barriers only the one between the expects and the copies remains
    slot = j % STAGES
    row = bos + j * 16
    tile = ((c0 + j) * H + i_h) * 16
    mbarrier.expect(kd_b.index(slot), kd_desc.block_type.nbytes)
    mbarrier.expect(qd_b.index(slot), qd_desc.block_type.nbytes)
    mbarrier.expect(kr_b.index(slot), kr_desc.block_type.nbytes)
    mbarrier.expect(inv_b.index(slot), inv_desc.block_type.nbytes)
    mbarrier.expect(mqk_b.index(slot), mqk_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kd_desc, [row, i_h * K], kd_b.index(slot), kd_s.index(slot))
    tma.async_copy_global_to_shared(qd_desc, [row, i_h * K], qd_b.index(slot), qd_s.index(slot))
    tma.async_copy_global_to_shared(kr_desc, [row, i_h * K], kr_b.index(slot), kr_s.index(slot))
    tma.async_copy_global_to_shared(inv_desc, [tile, 0], inv_b.index(slot), inv_s.index(slot))
    tma.async_copy_global_to_shared(mqk_desc, [tile, 0], mqk_b.index(slot), mqk_s.index(slot))


@gluon.jit
def _load_chunk_regs(v, beta, glast, bos, eos, c0, j, n_chunks, i_h, H, o_vc, o_tc, o_kg, V: gl.constexpr,
                     K: gl.constexpr, C: gl.constexpr):
    # v^T [BV, C] straight into the accumulator layout (no layout conversion, so no CTA barrier), beta [C], and
    # glast [K] one value per thread; zero (glast one) past the sequence's end or its last chunk
    rows = bos.to(gl.int64) + j * C + o_tc
    m_t = j * C + o_tc < eos - bos
    b_v = gl.load(v + (rows[None, :] * H + i_h) * V + o_vc[:, None], mask=m_t[None, :], other=0.0)
    b_beta = gl.load(beta + rows * H + i_h, mask=m_t, other=0.0)
    b_g = gl.load(glast + ((c0 + j) * H + i_h).to(gl.int64) * K + o_kg, mask=j < n_chunks, other=1.0)
    return b_v, b_beta, b_g


@gluon.jit
def _store_state_bf16(dst, b_s, row, i_h, H, o_vk, o_kk, K: gl.constexpr, V: gl.constexpr):
    """Store ``S^T`` ``[BV, K]`` (accumulator layout) as bf16 to the K-first ``dst[row, i_h]`` of ``[R, H, K, V]``."""
    offs = (row * H + i_h).to(gl.int64) * (K * V) + o_kk[None, :] * V + o_vk[:, None]
    gl.store(dst + offs, b_s.to(gl.bfloat16))


@gluon.jit
def _store_o(o, b_o, row0, n_valid, i_h, H, o_vc, o_tc, V: gl.constexpr):
    # o^T [BV, C] of one chunk, token rows row0 .. row0 + n_valid - 1, straight from the accumulator layout (2-byte
    # stores, 16 contiguous bytes per 8 lanes; a layout conversion would cost two CTA barriers per chunk)
    rows = row0.to(gl.int64) + o_tc
    gl.store(o + (rows[None, :] * H + i_h) * V + o_vc[:, None], b_o, mask=(o_tc < n_valid)[None, :])


@gluon.jit
def kda_fwd_v2_recurrence_kernel(
    kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc,  # TMA descriptors: kd/qd/kr [T_total, H*K], inv/mqk [NT*H*16, 16]
    glast, beta, v, o, h0, ht,  # [NT, H, K] fp32, [T_total, H] fp32, [T_total, H, V] bf16 x2, [N, H, K, V] fp32
    cu_seqlens, seq_chunks, order,  # [N + 1] int32, [N + 1] int32, [N] int32 (longest first)
    ckpt, ck_offsets,  # [NCK, H, K, V] bf16, [N + 1] int32 (training checkpoints; unused when EVERY = 0)
    H, K: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
    USE_ORDER: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr, EVERY: gl.constexpr,
    num_warps: gl.constexpr,
):
    V: gl.constexpr = K
    C: gl.constexpr = CHUNK
    NV: gl.constexpr = V // BV
    gl.static_assert(K == 64 or K == 128, "head width 64 or 128")
    gl.static_assert(BV == 16 * num_warps, "one warp per 16 state columns")
    gl.static_assert(BV <= V, "at most V state columns per CTA")

    i_n, i_h, i_v, bos, eos, c0, n_chunks, _ = _sequence(cu_seqlens, seq_chunks, order, USE_ORDER, C, NV)

    # wgmma layouts: M = BV state columns over the warps, N = 16 tokens or K state rows
    acc_c: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, C, 16])
    acc_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, K, 16])
    a_c: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_c, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    g_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                              warps_per_cta=[num_warps], order=[0])
    # [C, K] in 16-byte vectors, K // 8 lanes to a row: a warp covers two rows at K = 128, four at K = 64
    kr_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[256 // K, K // 8],
                                               warps_per_cta=[num_warps, 1], order=[1, 0])

    kd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], kd_desc.layout)
    qd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], qd_desc.layout)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], kr_desc.layout)
    inv_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, C], inv_desc.layout)
    mqk_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, C], mqk_desc.layout)
    kd_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qd_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kr_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    inv_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mqk_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(kd_b.index(s), count=1)
        mbarrier.init(qd_b.index(s), count=1)
        mbarrier.init(kr_b.index(s), count=1)
        mbarrier.init(inv_b.index(s), count=1)
        mbarrier.init(mqk_b.index(s), count=1)

    for s in gl.static_range(STAGES - 1):
        if s < n_chunks:
            _issue_chunk_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, kd_s, qd_s, kr_s, inv_s, mqk_s,
                               kd_b, qd_b, kr_b, inv_b, mqk_b,
                               s, bos, c0, i_h, H, K, STAGES)

    # index vectors: tokens and state columns in the two accumulator layouts and the glast layout
    o_tc = gl.arange(0, C, layout=gl.SliceLayout(0, acc_c))  # [C] tokens
    o_vc = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, acc_c))  # [BV] state columns
    o_vk = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, acc_k))  # [BV]
    o_kk = gl.arange(0, K, layout=gl.SliceLayout(0, acc_k))  # [K]
    o_kg = gl.arange(0, K, layout=g_layout)  # [K]

    # S^T [BV, K]: element (v, k) of the K-first state [N, H, K, V]
    o_state = (i_n * H + i_h).to(gl.int64) * (K * V) + o_kk[None, :] * V + o_vk[:, None]
    if USE_H0:
        b_s = gl.load(h0 + o_state)
    else:
        b_s = gl.zeros([BV, K], gl.float32, layout=acc_k)

    # v, beta and glast travel in registers, loaded two chunks ahead of their use
    b_v, b_beta, b_g = _load_chunk_regs(v, beta, glast, bos, eos, c0, 0, n_chunks, i_h, H, o_vc, o_tc, o_kg, V, K, C)
    n_v, n_beta, n_g = _load_chunk_regs(v, beta, glast, bos, eos, c0, 1, n_chunks, i_h, H, o_vc, o_tc, o_kg, V, K, C)

    if EVERY > 0:
        ck0 = gl.load(ck_offsets + i_n)
    zero_c = gl.zeros([BV, C], gl.float32, layout=acc_c)
    for j in range(n_chunks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        # refill the slot consumed by chunk j - 1 (its wgmmas were waited for by every warp)
        gl.thread_barrier()
        if j + STAGES - 1 < n_chunks:
            _issue_chunk_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, kd_s, qd_s, kr_s, inv_s, mqk_s,
                               kd_b, qd_b, kr_b, inv_b, mqk_b,
                               j + STAGES - 1, bos, c0, i_h, H, K, STAGES)
        nn_v, nn_beta, nn_g = _load_chunk_regs(v, beta, glast, bos, eos, c0, j + 2, n_chunks, i_h, H, o_vc, o_tc,
                                               o_kg, V, K, C)
        if EVERY > 0:
            if j % EVERY == 0:
                _store_state_bf16(ckpt, b_s, ck0 + j // EVERY, i_h, H, o_vk, o_kk, K, V)

        # this chunk's glast into the accumulator's column layout, while its TMA loads may still be in flight
        b_gk = gl.convert_layout(b_g, gl.SliceLayout(0, acc_k))  # [K]

        mbarrier.wait(kd_b.index(slot), phase)
        mbarrier.wait(qd_b.index(slot), phase)
        mbarrier.wait(kr_b.index(slot), phase)
        mbarrier.wait(inv_b.index(slot), phase)
        mbarrier.wait(mqk_b.index(slot), phase)
        kd_t = kd_s.index(slot)
        qd_t = qd_s.index(slot)
        kr_t = kr_s.index(slot)
        inv_t = inv_s.index(slot)
        mqk_t = mqk_s.index(slot)
        if j * C + C > eos - bos:
            # a partial last chunk: its rows past the sequence's end may hold any bits (token rows after the last
            # sequence are never written), and kr^T U would turn a NaN there into NaN state even with U = 0
            o_tr = gl.arange(0, C, layout=gl.SliceLayout(1, kr_layout))
            b_kr = kr_t.load(kr_layout)
            kr_t.store(gl.where((j * C + o_tr < eos - bos)[:, None], b_kr, 0.0))
            fence_async_shared()
            gl.thread_barrier()

        # ptxas serialises every wgmma of the kernel (a wait after each instruction, C7514 "non wgmma instructions
        # reading accumulator registers") for some code shapes, e.g. a select on U^T right after its wait; check
        # `ptxas -v` (benchmarks/kda/v2_compile_recurrence.py) after changing this block.
        # u^T and (qd S)^T from the chunk-start state
        a_s = gl.convert_layout(b_s.to(gl.bfloat16), a_c)  # [BV, K]
        b_u = warpgroup_mma(a_s, kd_t.permute((1, 0)), zero_c, use_acc=False, is_async=True)
        b_o = warpgroup_mma(a_s, qd_t.permute((1, 0)), zero_c, use_acc=False, is_async=True)
        b_u, a_s = warpgroup_mma_wait(num_outstanding=1, deps=(b_u, a_s))
        # U^T = ((v - u)^T beta) INV^T; W^T is zero past the sequence's end, and so is U^T, since INV's rows past the
        # end are zero (or unit) left of the diagonal (the workspace contract)
        m_t = j * C + o_tc < eos - bos
        b_w = gl.where(m_t[None, :], (b_v.to(gl.float32) - b_u) * b_beta[None, :], 0.0)
        a_w = gl.convert_layout(b_w.to(gl.bfloat16), a_c)
        b_uu = warpgroup_mma(a_w, inv_t.permute((1, 0)), zero_c, use_acc=False, is_async=True)
        b_uu, b_o, a_w = warpgroup_mma_wait(num_outstanding=0, deps=(b_uu, b_o, a_w))
        b_uu = b_uu.to(gl.bfloat16)  # [BV, C]
        # o^T = (qd S)^T + U^T Mqk^T;  S^T = S^T diag(glast) + U^T kr
        b_s = b_s * b_gk[None, :]
        a_uc = gl.convert_layout(b_uu, a_c)
        a_u = gl.convert_layout(b_uu, a_k)
        b_o = warpgroup_mma(a_uc, mqk_t.permute((1, 0)), b_o, is_async=True)
        b_s = warpgroup_mma(a_u, kr_t, b_s, is_async=True)
        b_o, b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, b_s))
        _store_o(o, b_o.to(gl.bfloat16), bos + j * C, eos - bos - j * C, i_h, H, o_vc, o_tc, V)
        b_v, b_beta, b_g = n_v, n_beta, n_g
        n_v, n_beta, n_g = nn_v, nn_beta, nn_g

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(kd_b.index(s))
        mbarrier.invalidate(qd_b.index(s))
        mbarrier.invalidate(kr_b.index(s))
        mbarrier.invalidate(inv_b.index(s))
        mbarrier.invalidate(mqk_b.index(s))
    if STORE_HT:
        gl.store(ht + o_state, b_s)
