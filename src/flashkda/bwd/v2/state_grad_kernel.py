"""The Gluon state-gradient chain (B2) of the v2 backward; imported only by `flashkda.bwd.v2.state_grad` on first
launch, and by path (without torch) by the offline compile script.

K2's shape walked backwards: one CTA per (sequence, head, 64 value columns), one warpgroup holding the state
gradient ``dS^T`` ``[64, K]`` as the fp32 wgmma accumulator; the head width ``K = V`` (64 or 128) is a constexpr, and
at ``K = 64`` one CTA holds a head's whole ``dS``. From the sequence's last chunk to its first, per chunk of ``C``
tokens (16 or 32; shapes per CTA)::

    store bf16(dS^T)                              the gradient of the state leaving the chunk, ``ds[chunk]``
    dU^T = bf16(do^T Mqk + bf16(dS^T) kr^T)       [64, C]    M64 NC KC, then NC K128 (K64)
    du^T = bf16(-(dU^T INV) diag(beta))           [64, C]    M64 NC KC
    dS^T = dS^T diag(glast) + do^T qd + du^T kd   [64, K]    M64 N128 (N64) KC, twice

and after the first chunk stores ``dh0 = dS``. ``kd, qd, kr, INV, Mqk, glast`` arrive by TMA through K2's ring
(`recurrence32_kernel._issue_loads`: same descriptors and tiles), ``do`` and ``beta`` are loaded into registers one
chunk ahead (K2's ``v`` loader). Rows past a sequence's end: ``do`` and ``beta`` load as zero, and the partial last
chunk (the first one walked) has its ``kd, qd, kr`` rows zeroed in shared memory (token rows after the last sequence
may be uninitialised, and ``0 * NaN`` is NaN); with ``Mqk``/``INV`` rows zero there (the workspace contract),
``dU`` and ``du`` are then zero on those rows.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

try:
    from flashkda.fwd.v2 import recurrence32_kernel as _k2
except ImportError:  # loaded by path by the offline compile script (no flashkda, no torch there)
    _spec = importlib.util.spec_from_file_location(
        "flashkda_v2_recurrence32_kernel",
        Path(__file__).resolve().parents[2] / "fwd" / "v2" / "recurrence32_kernel.py")
    _k2 = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_k2)

_sequence = _k2._sequence
_allocate_ring = _k2._allocate_ring
_state_offsets = _k2._state_offsets
_issue_loads = _k2._issue_loads
_wait_slot = _k2._wait_slot
_load_v_beta = _k2._load_v_beta
_store_state_bf16 = _k2._store_state_bf16
_zero_rows_past = _k2._zero_rows_past


@gluon.jit
def _grad_step(b_ds, b_do, b_beta, kd_t, qd_t, kr_t, inv_t, mqk_t, g_t, ds, chunk, i_h, H, o_vk, o_kk,
               acc_c: gl.constexpr, acc_k: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    """One chunk backwards: stores the ``dS`` leaving it and returns the ``dS^T`` entering it."""
    a_c: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_c, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    zero_c = gl.zeros(b_do.shape, gl.float32, layout=acc_c)
    b_dsb = b_ds.to(gl.bfloat16)  # [BV, K]
    _store_state_bf16(ds, b_dsb, chunk, i_h, H, o_vk, o_kk, K, V)
    # every read of the accumulator before the first wgmma is issued (ptxas serialises the wgmmas otherwise)
    b_ds = b_ds * g_t.load(acc_k)
    a_ds = gl.convert_layout(b_dsb, a_c)
    a_doc = gl.convert_layout(b_do, a_c)
    a_dok = gl.convert_layout(b_do, a_k)
    # dU^T = do^T Mqk + dS^T kr^T, and (not waited for yet) dS^T += do^T qd
    b_du = warpgroup_mma(a_doc, mqk_t, zero_c, use_acc=False, is_async=True)
    b_du = warpgroup_mma(a_ds, kr_t.permute((1, 0)), b_du, is_async=True)
    b_ds = warpgroup_mma(a_dok, qd_t, b_ds, is_async=True)
    b_du, a_ds, a_doc = warpgroup_mma_wait(num_outstanding=1, deps=(b_du, a_ds, a_doc))
    a_du = gl.convert_layout(b_du.to(gl.bfloat16), a_c)
    b_w = warpgroup_mma(a_du, inv_t, zero_c, use_acc=False, is_async=True)
    b_w, b_ds, a_du, a_dok = warpgroup_mma_wait(num_outstanding=0, deps=(b_w, b_ds, a_du, a_dok))
    # du^T = -(dU^T INV) diag(beta);  dS^T += du^T kd
    a_dd = gl.convert_layout((b_w * -b_beta[None, :]).to(gl.bfloat16), a_k)
    b_ds = warpgroup_mma(a_dd, kd_t, b_ds, is_async=True)
    b_ds, a_dd = warpgroup_mma_wait(num_outstanding=0, deps=(b_ds, a_dd))
    return b_ds


@gluon.jit
def kda_bwd_v2_state_grad_kernel(
    kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc,  # K2's TMA descriptors (chunks of C tokens)
    beta, do, ds, dht, dh0,  # [T_total, H] fp32, [T_total, H, V] bf16, [NT, H, K, V] bf16, [N, H, K, V] fp32 x2
    cu_seqlens, seq_chunks, order,  # [N + 1] int32, [N + 1] int32, [N] int32 (longest first)
    H, C: gl.constexpr, K: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
    USE_ORDER: gl.constexpr, USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
    num_warps: gl.constexpr,
):
    V: gl.constexpr = K
    NV: gl.constexpr = V // BV
    gl.static_assert(K == 64 or K == 128, "head width 64 or 128")
    gl.static_assert(BV == 16 * num_warps, "one warp per 16 state columns")
    gl.static_assert(BV <= V, "at most V state columns per CTA")

    i_n, i_h, i_v, bos, eos, c0, n_chunks, n_full = _sequence(cu_seqlens, seq_chunks, order, USE_ORDER, C, NV)

    acc_c: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, C, 16])
    acc_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, K, 16])
    tile_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                 warps_per_cta=[num_warps, 1], order=[1, 0])

    kd_s, qd_s, kr_s, inv_s, mqk_s, g_s, kd_b, qd_b, kr_b, inv_b, mqk_b, g_b = _allocate_ring(
        kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, C, K, STAGES)

    # the ring runs backwards: chunk j lives in slot j % STAGES, and is that slot's ((n_chunks - 1 - j) // STAGES)-th
    # fill; the loads run STAGES - 1 chunks ahead (below j) of the math
    for s in gl.static_range(STAGES - 1):
        if s < n_chunks:
            _issue_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, kd_s, qd_s, kr_s, inv_s, mqk_s, g_s,
                         kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, n_chunks - 1 - s, bos, c0, i_h, H, C, K, STAGES)

    # dS^T [BV, K]: element (v, k) of the K-first [N, H, K, V]
    o_tc, o_vc, o_vk, o_kk, o_state = _state_offsets(i_n, i_h, i_v, H, acc_c, acc_k, C, BV, K, V)
    if USE_DHT:
        b_ds = gl.load(dht + o_state)
    else:
        b_ds = gl.zeros([BV, K], gl.float32, layout=acc_k)

    # do^T [BV, C] and beta of the last chunk (chunk 0 of an empty sequence loads nothing: every row is masked)
    b_do, b_beta = _load_v_beta(do, beta, bos, eos, gl.maximum(n_chunks - 1, 0), i_h, H, o_vc, o_tc, V, C)
    if n_full < n_chunks:
        # the partial last chunk, walked first: its rows past the sequence's end are zeroed in kd, qd, kr
        j = n_full
        slot = j % STAGES
        if j - (STAGES - 1) >= 0:
            _issue_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, kd_s, qd_s, kr_s, inv_s, mqk_s, g_s,
                         kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, j - (STAGES - 1), bos, c0, i_h, H, C, K, STAGES)
        n_do, n_beta = _load_v_beta(do, beta, bos, eos, gl.maximum(j - 1, 0), i_h, H, o_vc, o_tc, V, C)
        _wait_slot(kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, slot, 0)
        n_valid = eos - bos - j * C
        _zero_rows_past(kd_s.index(slot), n_valid, tile_layout)
        _zero_rows_past(qd_s.index(slot), n_valid, tile_layout)
        _zero_rows_past(kr_s.index(slot), n_valid, tile_layout)
        fence_async_shared()
        gl.thread_barrier()
        b_ds = _grad_step(b_ds, b_do, b_beta, kd_s.index(slot), qd_s.index(slot), kr_s.index(slot),
                          inv_s.index(slot), mqk_s.index(slot), g_s.index(slot), ds, c0 + j, i_h, H, o_vk, o_kk,
                          acc_c, acc_k, K, V)
        b_do, b_beta = n_do, n_beta

    for i in range(n_full):
        j = n_full - 1 - i
        slot = j % STAGES
        # refill the slot consumed by chunk j + 1 (every warp has waited for its wgmmas)
        gl.thread_barrier()
        if j - (STAGES - 1) >= 0:
            _issue_loads(kd_desc, qd_desc, kr_desc, inv_desc, mqk_desc, g_desc, kd_s, qd_s, kr_s, inv_s, mqk_s, g_s,
                         kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, j - (STAGES - 1), bos, c0, i_h, H, C, K, STAGES)
        n_do, n_beta = _load_v_beta(do, beta, bos, eos, gl.maximum(j - 1, 0), i_h, H, o_vc, o_tc, V, C)
        _wait_slot(kd_b, qd_b, kr_b, inv_b, mqk_b, g_b, slot, ((n_chunks - 1 - j) // STAGES) & 1)
        b_ds = _grad_step(b_ds, b_do, b_beta, kd_s.index(slot), qd_s.index(slot), kr_s.index(slot),
                          inv_s.index(slot), mqk_s.index(slot), g_s.index(slot), ds, c0 + j, i_h, H, o_vk, o_kk,
                          acc_c, acc_k, K, V)
        b_do, b_beta = n_do, n_beta

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(kd_b.index(s))
        mbarrier.invalidate(qd_b.index(s))
        mbarrier.invalidate(kr_b.index(s))
        mbarrier.invalidate(inv_b.index(s))
        mbarrier.invalidate(mqk_b.index(s))
        mbarrier.invalidate(g_b.index(s))
    if STORE_DH0:
        gl.store(dh0 + o_state, b_ds)
