"""The Gluon recurrence kernel (K2) for chunks of ``C`` tokens (32: half the serial steps of chunk 16); imported only
by `flashkda.fwd.v2.recurrence32` on first launch, and by path (without torch) by the offline compile script.

The math and layouts are those of the chunk-16 kernel (`recurrence_kernel`): one CTA per (sequence, head, V-slice
of ``BV`` columns), one warpgroup per 64 columns, the state ``S^T`` ``[BV, K]`` as the fp32 wgmma accumulator, here
at head width ``K = V = 128`` only. Per chunk (shapes per CTA, ``C = 32``)::

    u^T  = S^T kd^T                      [BV, C]   wgmma M64 N32 K128, A = bf16(S^T) from registers
    qS^T = S^T qd^T                      [BV, C]   M64 N32 K128
    U^T  = bf16((v - u)^T beta) INV^T    [BV, C]   M64 N32 K32
    o^T  = qS^T + bf16(U^T) Mqk^T        [BV, C]   M64 N32 K32
    S^T  = S^T diag(glast) + bf16(U^T) kr   [BV, K]   M64 N128 K32

What differs from the chunk-16 kernel besides ``C``:
- ``glast`` comes by TMA with the other tiles (one mbarrier ring per tensor: copies that share a barrier get a CTA
  barrier between them from the compiler) and is read from shared memory straight into the accumulator's column
  layout, so it needs neither a register prefetch nor a layout conversion (a CTA barrier) per chunk.
- ``v`` and ``beta`` are loaded into registers one chunk ahead (a chunk is twice as long).
- A sequence's partial last chunk is peeled off the loop (`_chunk_step` with ``PARTIAL``): the loop over full
  chunks has no row masks and no branch, so no CTA barrier after the ``kr`` fix-up's branch in every step.
Rows past a sequence's end: ``W = (v - u) beta`` is selected to zero there, ``U`` is then zero (INV's rows past the
end are zero), ``o`` is stored for valid rows only, and the ``kr`` rows of a partial chunk are zeroed in shared
memory once per sequence (rows after the last sequence may be uninitialised memory, and ``0 * NaN`` is NaN).
``EVERY > 0`` adds the training checkpoint stores of the chunk-16 kernel (the state entering every ``EVERY``-th
chunk, bf16, row ``ck_offsets[n] + j // EVERY`` of ``ckpt``).

The ring helpers here (`_issue_loads`, `_wait_slot`, `_load_v_beta`, `_zero_rows_past`) take the head width ``K`` (64
or 128) and also serve the backward's state-gradient chain (`flashkda.bwd.v2.state_grad_kernel`), which walks the
same tiles in reverse.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

try:
    from flashkda.fwd.v2 import recurrence_kernel as _k16
except ImportError:  # loaded by path by the offline compile script (no flashkda, no torch there)
    _spec = importlib.util.spec_from_file_location("flashkda_v2_recurrence_kernel",
                                                   Path(__file__).with_name("recurrence_kernel.py"))
    _k16 = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_k16)

HEAD_DIM = gl.constexpr(128)
_store_state_bf16 = _k16._store_state_bf16
_sequence = _k16._sequence


@gluon.jit
def _allocate_ring(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, C: gl.constexpr, K: gl.constexpr,
                   STAGES: gl.constexpr):
    """The TMA ring: ``STAGES`` slots of each workspace tile and one initialised mbarrier per tile and slot."""
    kd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], kd_desc.layout)
    qd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], qd_desc.layout)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], kr_desc.layout)
    inv_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, C], inv_desc.layout)
    mqk_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, C], mqk_desc.layout)
    g_s = gl.allocate_shared_memory(gl.float32, [STAGES, 1, K], g_desc.layout)
    kd_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qd_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kr_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    inv_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mqk_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    g_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(kd_b.index(s), count=1)
        mbarrier.init(qd_b.index(s), count=1)
        mbarrier.init(kr_b.index(s), count=1)
        mbarrier.init(inv_b.index(s), count=1)
        mbarrier.init(mqk_b.index(s), count=1)
        mbarrier.init(g_b.index(s), count=1)
    return kd_s, qd_s, kr_s, inv_s, mqk_s, g_s, kd_b, qd_b, kr_b, inv_b, mqk_b, g_b


@gluon.jit
def _state_offsets(i_n, i_h, i_v, H, acc_c: gl.constexpr, acc_k: gl.constexpr, C: gl.constexpr,
                   BV: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    """Token and state-column offsets in the wgmma layouts, and the offsets of this program's ``S^T [BV, K]`` in a
    K-first ``[N, H, K, V]`` state: ``(o_tc, o_vc, o_vk, o_kk, o_state)``."""
    o_tc = gl.arange(0, C, layout=gl.SliceLayout(0, acc_c))
    o_vc = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, acc_c))
    o_vk = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, acc_k))
    o_kk = gl.arange(0, K, layout=gl.SliceLayout(0, acc_k))
    o_state = (i_n * H + i_h).to(gl.int64) * (K * V) + o_kk[None, :] * V + o_vk[:, None]
    return o_tc, o_vc, o_vk, o_kk, o_state


@gluon.jit
def _issue_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, kd_s, qd_s, kr_s, inv_s, mqk_s, g_s,
                 kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, j, bos, c0, i_h, H, C: gl.constexpr, K: gl.constexpr,
                 STAGES: gl.constexpr):
    slot = j % STAGES
    row = bos + j * C
    chunk = (c0 + j) * H + i_h
    mbarrier.expect(kd_b.index(slot), kd_desc.block_type.nbytes)
    mbarrier.expect(qd_b.index(slot), qd_desc.block_type.nbytes)
    mbarrier.expect(kr_b.index(slot), kr_desc.block_type.nbytes)
    mbarrier.expect(inv_b.index(slot), inv_desc.block_type.nbytes)
    mbarrier.expect(mqk_b.index(slot), mqk_desc.block_type.nbytes)
    mbarrier.expect(g_b.index(slot), g_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kd_desc, [row, i_h * K], kd_b.index(slot), kd_s.index(slot))
    tma.async_copy_global_to_shared(qd_desc, [row, i_h * K], qd_b.index(slot), qd_s.index(slot))
    tma.async_copy_global_to_shared(kr_desc, [row, i_h * K], kr_b.index(slot), kr_s.index(slot))
    tma.async_copy_global_to_shared(inv_desc, [chunk * C, 0], inv_b.index(slot), inv_s.index(slot))
    tma.async_copy_global_to_shared(mqk_desc, [chunk * C, 0], mqk_b.index(slot), mqk_s.index(slot))
    tma.async_copy_global_to_shared(g_desc, [chunk, 0], g_b.index(slot), g_s.index(slot))


@gluon.jit
def _wait_slot(kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, slot, phase):
    mbarrier.wait(kd_b.index(slot), phase)
    mbarrier.wait(qd_b.index(slot), phase)
    mbarrier.wait(kr_b.index(slot), phase)
    mbarrier.wait(inv_b.index(slot), phase)
    mbarrier.wait(mqk_b.index(slot), phase)
    mbarrier.wait(g_b.index(slot), phase)


@gluon.jit
def _zero_rows_past(t, n_valid, layout: gl.constexpr):
    """Zero the rows ``>= n_valid`` of the shared-memory tile ``t`` ``[C, K]`` (the caller fences and syncs)."""
    o_r = gl.arange(0, t.shape[0], layout=gl.SliceLayout(1, layout))
    b_t = t.load(layout)
    gl.thread_barrier()
    t.store(gl.where((o_r < n_valid)[:, None], b_t, 0.0))


@gluon.jit
def _load_v_beta(v, beta, bos, eos, j, i_h, H, o_vc, o_tc, V: gl.constexpr, C: gl.constexpr):
    # v^T [BV, C] straight into the accumulator layout, beta [C]; zero past the sequence's end
    rows = bos.to(gl.int64) + j * C + o_tc
    m_t = j * C + o_tc < eos - bos
    b_v = gl.load(v + (rows[None, :] * H + i_h) * V + o_vc[:, None], mask=m_t[None, :], other=0.0)
    b_beta = gl.load(beta + rows * H + i_h, mask=m_t, other=0.0)
    return b_v, b_beta


@gluon.jit
def _chunk_step(b_s, b_v, b_beta, kd_t, qd_t, kr_t, inv_t, mqk_t, g_t, o, row0, n_valid, i_h, H, o_vc, o_tc,
                acc_c: gl.constexpr, acc_k: gl.constexpr, V: gl.constexpr, C: gl.constexpr,
                PARTIAL: gl.constexpr):
    """One chunk: stores its ``o`` rows and returns the next ``S^T``. With PARTIAL, tokens ``>= n_valid`` are
    masked (W and the store); the caller has zeroed their ``kr`` rows."""
    a_c: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_c, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    zero_c = gl.zeros(b_v.shape, gl.float32, layout=acc_c)
    # keep non-wgmma reads of accumulators out of the pipeline stages: ptxas serialises every wgmma otherwise
    # (C7514; `benchmarks/kda/v2_compile.py` flags it)
    a_s = gl.convert_layout(b_s.to(gl.bfloat16), a_c)  # [BV, K]
    b_u = warpgroup_mma(a_s, kd_t.permute((1, 0)), zero_c, use_acc=False, is_async=True)
    b_o = warpgroup_mma(a_s, qd_t.permute((1, 0)), zero_c, use_acc=False, is_async=True)
    b_u, a_s = warpgroup_mma_wait(num_outstanding=1, deps=(b_u, a_s))
    b_w = (b_v.to(gl.float32) - b_u) * b_beta[None, :]
    if PARTIAL:
        b_w = gl.where((o_tc < n_valid)[None, :], b_w, 0.0)
    a_w = gl.convert_layout(b_w.to(gl.bfloat16), a_c)
    b_uu = warpgroup_mma(a_w, inv_t.permute((1, 0)), zero_c, use_acc=False, is_async=True)
    b_gk = g_t.load(acc_k)  # [1, K]: each thread its accumulator columns, no layout conversion
    b_uu, b_o, a_w = warpgroup_mma_wait(num_outstanding=0, deps=(b_uu, b_o, a_w))
    b_uu = b_uu.to(gl.bfloat16)  # [BV, C]
    b_s = b_s * b_gk
    a_uc = gl.convert_layout(b_uu, a_c)
    a_u = gl.convert_layout(b_uu, a_k)
    b_o = warpgroup_mma(a_uc, mqk_t.permute((1, 0)), b_o, is_async=True)
    b_s = warpgroup_mma(a_u, kr_t, b_s, is_async=True)
    b_o, b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, b_s))
    ptrs = o + ((row0.to(gl.int64) + o_tc)[None, :] * H + i_h) * V + o_vc[:, None]
    if PARTIAL:
        gl.store(ptrs, b_o.to(gl.bfloat16), mask=(o_tc < n_valid)[None, :])
    else:
        gl.store(ptrs, b_o.to(gl.bfloat16))
    return b_s


@gluon.jit
def kda_fwd_v2_recurrence32_kernel(
    kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc,  # TMA: [T_total, H*128] x3, [NT*H*C, C] x2, [NT*H, 128]
    beta, v, o, h0, ht,  # [T_total, H] fp32, [T_total, H, 128] bf16 x2, [N, H, 128, 128] fp32 x2
    cu_seqlens, seq_chunks, order,  # [N + 1] int32, [N + 1] int32, [N] int32 (longest first)
    ckpt, ck_offsets,  # [NCK, H, 128, 128] bf16, [N + 1] int32 (training checkpoints; unused when EVERY = 0)
    H, C: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
    USE_ORDER: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr, EVERY: gl.constexpr,
    num_warps: gl.constexpr, STATE_V_FIRST: gl.constexpr = False,
):
    K: gl.constexpr = HEAD_DIM
    V: gl.constexpr = HEAD_DIM
    NV: gl.constexpr = V // BV
    gl.static_assert(BV == 16 * num_warps, "one warp per 16 state columns")

    i_n, i_h, i_v, bos, eos, c0, n_chunks, n_full = _sequence(cu_seqlens, seq_chunks, order, USE_ORDER, C, NV)

    acc_c: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, C, 16])
    acc_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, K, 16])
    kr_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[num_warps, 1], order=[1, 0])

    kd_s, qd_s, kr_s, inv_s, mqk_s, g_s, kd_b, qd_b, kr_b, inv_b, mqk_b, g_b = _allocate_ring(
        kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, C, K, STAGES)

    for s in gl.static_range(STAGES - 1):
        if s < n_chunks:
            _issue_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, kd_s, qd_s, kr_s, inv_s, mqk_s, g_s,
                         kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, s, bos, c0, i_h, H, C, K, STAGES)

    o_tc, o_vc, o_vk, o_kk, o_state = _state_offsets(i_n, i_h, i_v, H, acc_c, acc_k, C, BV, K, V)
    if STATE_V_FIRST:  # h0 and ht are [N, H, V, K]: S^T's rows as stored
        o_state = (i_n * H + i_h).to(gl.int64) * (K * V) + o_vk[:, None] * K + o_kk[None, :]
    if USE_H0:
        b_s = gl.load(h0 + o_state)
    else:
        b_s = gl.zeros([BV, K], gl.float32, layout=acc_k)

    if EVERY > 0:
        ck0 = gl.load(ck_offsets + i_n)
    b_v, b_beta = _load_v_beta(v, beta, bos, eos, 0, i_h, H, o_vc, o_tc, V, C)
    for j in range(n_full):
        slot = j % STAGES
        # refill the slot consumed by chunk j - 1 (every warp has waited for its wgmmas)
        gl.thread_barrier()
        if j + STAGES - 1 < n_chunks:
            _issue_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, kd_s, qd_s, kr_s, inv_s, mqk_s, g_s,
                         kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, j + STAGES - 1, bos, c0, i_h, H, C, K, STAGES)
        n_v, n_beta = _load_v_beta(v, beta, bos, eos, j + 1, i_h, H, o_vc, o_tc, V, C)
        if EVERY > 0:
            if j % EVERY == 0:
                _store_state_bf16(ckpt, b_s, ck0 + j // EVERY, i_h, H, o_vk, o_kk, K, V)
        # three CTA barriers per chunk: this one, the compiler's between the expects and the copies, and its one
        # between the copies and the waits (the ring's slots share one allocation per tensor)
        _wait_slot(kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, slot, (j // STAGES) & 1)
        b_s = _chunk_step(b_s, b_v, b_beta, kd_s.index(slot), qd_s.index(slot), kr_s.index(slot),
                          inv_s.index(slot), mqk_s.index(slot), g_s.index(slot), o, bos + j * C, C, i_h, H,
                          o_vc, o_tc, acc_c, acc_k, V, C, False)
        b_v, b_beta = n_v, n_beta

    if n_full < n_chunks:
        # the partial last chunk: its kr rows past the sequence's end may hold any bits (token rows after the last
        # sequence are never written), and kr^T U would turn a NaN there into NaN state even with U = 0
        j = n_full
        slot = j % STAGES
        if EVERY > 0:
            if j % EVERY == 0:
                _store_state_bf16(ckpt, b_s, ck0 + j // EVERY, i_h, H, o_vk, o_kk, K, V)
        _wait_slot(kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, slot, (j // STAGES) & 1)
        kr_t = kr_s.index(slot)
        n_valid = eos - bos - j * C
        _zero_rows_past(kr_t, n_valid, kr_layout)
        fence_async_shared()
        gl.thread_barrier()
        b_s = _chunk_step(b_s, b_v, b_beta, kd_s.index(slot), qd_s.index(slot), kr_t, inv_s.index(slot),
                          mqk_s.index(slot), g_s.index(slot), o, bos + j * C, n_valid, i_h, H, o_vc, o_tc,
                          acc_c, acc_k, V, C, True)

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(kd_b.index(s))
        mbarrier.invalidate(qd_b.index(s))
        mbarrier.invalidate(kr_b.index(s))
        mbarrier.invalidate(inv_b.index(s))
        mbarrier.invalidate(mqk_b.index(s))
        mbarrier.invalidate(g_b.index(s))
    if STORE_HT:
        gl.store(ht + o_state, b_s)
