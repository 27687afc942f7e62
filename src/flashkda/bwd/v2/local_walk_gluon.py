"""B3a of the v2 backward in Gluon: the state walk of one checkpoint segment on Hopper warpgroup MMA (16-token chunks).

The Triton B3a (`local_split_kernel.kda_bwd_v2_local_state_kernel`) runs every product on mma.sync tiles of M = 16
and moves the state between layouts every chunk. Here, as in the forward's K2 (`fwd.v2.recurrence_kernel`), the
state is kept transposed, ``S^T [BV, K]``, as the fp32 accumulator of ``wgmma`` (V on M: one warpgroup, BV = 64),
and never changes layout. Per chunk (shapes per CTA, ``bf`` a rounding to bf16)::

    u^T   = bf(S)^T kd^T                        [BV, C]   A: the state (registers), B: kd (smem, viewed transposed)
    W^T   = bf((v - u)^T beta),  U^T = bf(W^T INV^T)
    dU^T  = bf(do^T Mqk + bf(dS)^T kr^T)        [BV, C]   A: do^T, dS^T (registers), B: Mqk, kr (smem)
    dW^T  = dU^T INV;  dv = dW beta;  du^T = bf(-beta dW^T)
    X     = dU W^T,  dMf = do U^T               [C, C]    contractions over the V rows: mma.sync from shared memory
    dkr^T = bf(dS) U^T, dqd^T = bf(S) do^T, dkd^T = bf(S) du^T   [K, C]   wgmma, M = K = 128, A from shared memory
    S^T   = S^T diag(glast) + U^T kr            [BV, K]
    db    = rowsum over V of dW * (v - u),  dglast = rowsum over V of S * dS

with the algebra and roundings of the Triton B3a, and the same outputs: ``dv`` and the fp32 partials of the
``BV``-column block (``part_ck``: dkd, dqd, dkr ``[C, K]``; ``part_cc``: X, dMf ``[C, C]``; ``part_k``: dglast;
``part_c``: db), same grid and arguments.

Imports Triton and the forward's K1 kernel module (no torch), so the offline compile script can load both by path
(Triton 3.6).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from flashkda.fwd.v2.prepare_kernel import CHUNK, HEAD_DIM

BLOCK_V = gl.constexpr(64)
NUM_WARPS = gl.constexpr(4)

# wgmma accumulators, V (or K) on M over the warps: [BV, C], [BV, K], [K, C]
ACC_C = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
ACC_K = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
A_C = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC_C, k_width=2))
A_K = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC_K, k_width=2))
# mma.sync for the [C, C] contractions over the V rows
MMA2 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8]))
DOT_A2 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA2, k_width=2))
DOT_B2 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA2, k_width=2))
SM_CK = gl.constexpr(gl.NVMMASharedLayout.get_default_for([16, 128], gl.bfloat16))
SM_CC = gl.constexpr(gl.NVMMASharedLayout.get_default_for([16, 16], gl.bfloat16))
SM_VC = gl.constexpr(gl.NVMMASharedLayout.get_default_for([64, 16], gl.bfloat16))
SM_KV = gl.constexpr(gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16))
SM_VK = gl.constexpr(gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16))
# plain loads of the [C, K] and [C, C] tiles before they go to shared memory
LD_CK = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
LD_KV = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
LD_CC = gl.constexpr(gl.BlockedLayout([1, 2], [16, 2], [1, 4], [1, 0]))


@gluon.jit
def _tile_ck(ptr, row0, n_valid, HV, i_h, dst):
    """A chunk's ``[C, K]`` token-major rows at value head ``i_h`` (0 past ``n_valid``) into shared memory."""
    o_t = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LD_CK))
    o_k = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD_CK))
    rows = (row0 + o_t).to(gl.int64)
    x = gl.load(ptr + gl.expand_dims((rows * HV + i_h) * HEAD_DIM, 1) + gl.expand_dims(o_k, 0),
                mask=gl.expand_dims(o_t < n_valid, 1), other=0.0)
    dst.store(x)


@gluon.jit
def _tile_cc(ptr, i_ch, dst):
    """A chunk's ``[C, C]`` workspace tile into shared memory."""
    o_i = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LD_CC))
    o_j = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LD_CC))
    dst.store(gl.load(ptr + i_ch * CHUNK * CHUNK + gl.expand_dims(o_i * CHUNK, 1) + gl.expand_dims(o_j, 0)))


@gluon.jit
def kda_bwd_v2_walk_gluon_kernel(
    v, do, kd, kr, inv, mqk, glast, bsig,  # [T, HV, 128] bf16 x2, the workspace
    ckpt, ds, chunk_index, segments,  # [NCK, HV, K, V] bf16, [NT, HV, K, V] bf16, [NT, 3], [NSEG, 2] int32
    dv, part_ck, part_cc, part_k, part_c, bounds, grp, segment0, NTS,
    HV: gl.constexpr,
):
    """One CTA of `NUM_WARPS` warps per (segment of the group, `BLOCK_V`-column block, value head); the arguments
    and grid of the Triton B3a (`local_split_kernel.kda_bwd_v2_local_state_kernel`)."""
    C: gl.constexpr = CHUNK
    K: gl.constexpr = HEAD_DIM
    V: gl.constexpr = HEAD_DIM
    BV: gl.constexpr = BLOCK_V
    NV: gl.constexpr = V // BV
    i_s = segment0 + gl.program_id(0) // NV
    i_v = gl.program_id(0) % NV
    i_h = gl.program_id(1)
    first = gl.load(segments + i_s * 2)
    n_chunks = gl.load(segments + i_s * 2 + 1)
    c0 = gl.load(bounds + grp)

    kd_s = gl.allocate_shared_memory(gl.bfloat16, [C, K], SM_CK)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [C, K], SM_CK)
    inv_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SM_CC)
    mqk_s = gl.allocate_shared_memory(gl.bfloat16, [C, C], SM_CC)
    ut_s = gl.allocate_shared_memory(gl.bfloat16, [BV, C], SM_VC)  # U^T
    wt_s = gl.allocate_shared_memory(gl.bfloat16, [BV, C], SM_VC)  # W^T
    dot_s = gl.allocate_shared_memory(gl.bfloat16, [BV, C], SM_VC)  # do^T
    dut_s = gl.allocate_shared_memory(gl.bfloat16, [BV, C], SM_VC)  # dU^T
    dupt_s = gl.allocate_shared_memory(gl.bfloat16, [BV, C], SM_VC)  # du^T
    ds_s = gl.allocate_shared_memory(gl.bfloat16, [K, BV], SM_KV)  # dS block, K-first
    st_s = gl.allocate_shared_memory(gl.bfloat16, [BV, K], SM_VK)  # bf(S)^T

    o_tc = gl.arange(0, C, layout=gl.SliceLayout(0, ACC_C))  # [C] tokens
    o_vc = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, ACC_C))  # [BV] value columns
    o_vk = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, ACC_K))
    o_kk = gl.arange(0, K, layout=gl.SliceLayout(0, ACC_K))  # [K]
    o_km = gl.arange(0, K, layout=gl.SliceLayout(1, ACC_C))  # [K] rows of the [K, C] results
    o_kv = gl.expand_dims(o_kk, 0) * V + gl.expand_dims(o_vk, 1)  # [BV, K]: element (v, k) of a K-first state
    o_ld_k = gl.arange(0, K, layout=gl.SliceLayout(1, LD_KV))
    o_ld_v = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LD_KV))

    b_s = gl.load(ckpt + (i_s.to(gl.int64) * HV + i_h) * K * V + o_kv).to(gl.float32)  # S^T [BV, K] entering
    zero_c = gl.zeros([BV, C], gl.float32, ACC_C)
    zero_kc = gl.zeros([K, C], gl.float32, ACC_C)
    for j in range(n_chunks):
        i_c = first + j
        row0 = gl.load(chunk_index + i_c * 3 + 1)
        n_valid = gl.load(chunk_index + i_c * 3 + 2)
        i_ch = i_c.to(gl.int64) * HV + i_h
        i_p = (i_v * NTS + i_c - c0).to(gl.int64) * HV + i_h  # (V block, chunk, head) row of the partials
        m_t = o_tc < n_valid
        rows = (row0 + o_tc).to(gl.int64)
        p_vt = gl.expand_dims((rows * HV + i_h) * V, 0) + gl.expand_dims(o_vc, 1)  # [BV, C] of v, do, dv

        gl.thread_barrier()  # the previous chunk's reads of the shared tiles are done
        _tile_ck(kd, row0, n_valid, HV, i_h, kd_s)
        _tile_ck(kr, row0, n_valid, HV, i_h, kr_s)
        _tile_cc(inv, i_ch, inv_s)
        _tile_cc(mqk, i_ch, mqk_s)
        b_dsb = gl.load(ds + i_ch * K * V + gl.expand_dims(o_ld_k * V, 1) + gl.expand_dims(o_ld_v, 0))  # [K, BV]
        ds_s.store(b_dsb)
        b_vt = gl.load(v + p_vt, mask=gl.expand_dims(m_t, 0), other=0.0).to(gl.float32)  # v^T [BV, C]
        b_dot = gl.load(do + p_vt, mask=gl.expand_dims(m_t, 0), other=0.0)  # do^T [BV, C] bf16
        dot_s.store(b_dot)
        b_beta = gl.load(bsig + rows * HV + i_h, mask=m_t, other=0.0)  # [C]
        b_gl = gl.load(glast + i_ch * K + o_kk)  # [K] 2^Glast
        st_s.store(b_s.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()

        # dglast from the state entering the chunk, before it moves on; the state and dS^T as wgmma A operands
        # from shared memory (no register copies of the [BV, K] tiles)
        b_dst = ds_s.permute((1, 0)).load(ACC_K).to(gl.float32)  # dS^T [BV, K]
        gl.store(part_k + i_p * K + o_kk, gl.sum(b_s * b_dst, axis=0))
        b_u = warpgroup_mma(st_s, kd_s.permute((1, 0)), zero_c, use_acc=False, is_async=True)
        b_u = warpgroup_mma_wait(num_outstanding=0, deps=[b_u])
        b_vu = b_vt - b_u
        b_w = gl.where(gl.expand_dims(m_t, 0), b_vu * gl.expand_dims(b_beta, 0), 0.0).to(gl.bfloat16)
        b_uu = warpgroup_mma(gl.convert_layout(b_w, A_C), inv_s.permute((1, 0)), zero_c, use_acc=False,
                             is_async=True)
        b_du = warpgroup_mma(gl.convert_layout(b_dot, A_C), mqk_s, zero_c, use_acc=False, is_async=True)
        b_du = warpgroup_mma(ds_s.permute((1, 0)), kr_s.permute((1, 0)), b_du, is_async=True)
        b_uu, b_du = warpgroup_mma_wait(num_outstanding=0, deps=(b_uu, b_du))
        b_uu = b_uu.to(gl.bfloat16)  # U^T [BV, C]
        b_du = b_du.to(gl.bfloat16)  # dU^T
        b_dw = warpgroup_mma(gl.convert_layout(b_du, A_C), inv_s, zero_c, use_acc=False, is_async=True)
        # the state for the next chunk: S^T diag(glast) + U^T kr
        b_s = warpgroup_mma(gl.convert_layout(b_uu, A_K), kr_s, b_s * gl.expand_dims(b_gl, 0), is_async=True)
        b_dw, b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_dw, b_s))

        gl.store(dv + p_vt, (b_dw * gl.expand_dims(b_beta, 0)).to(dv.dtype.element_ty), mask=gl.expand_dims(m_t, 0))
        gl.store(part_c + i_p * C + o_tc, gl.sum(b_dw * b_vu, axis=0))
        b_dut = (-gl.expand_dims(b_beta, 0) * b_dw).to(gl.bfloat16)  # du^T
        ut_s.store(b_uu)
        wt_s.store(b_w)
        dut_s.store(b_du)
        dupt_s.store(b_dut)
        fence_async_shared()
        gl.thread_barrier()

        # X = dU W^T and dMf = do U^T [C, C] on mma.sync; the [K, C] products on wgmma with M = K
        zero_cc = gl.zeros([C, C], gl.float32, MMA2)
        b_x = mma_v2(dut_s.permute((1, 0)).load(DOT_A2), wt_s.load(DOT_B2), zero_cc)
        b_m = mma_v2(dot_s.permute((1, 0)).load(DOT_A2), ut_s.load(DOT_B2), zero_cc)
        o_i = gl.arange(0, C, layout=gl.SliceLayout(1, MMA2))
        o_j = gl.arange(0, C, layout=gl.SliceLayout(0, MMA2))
        p_cc = part_cc + i_p * 2 * C * C + gl.expand_dims(o_i * C, 1) + gl.expand_dims(o_j, 0)
        gl.store(p_cc, b_x)
        gl.store(p_cc + C * C, b_m)
        # one [K, C] product at a time: each is 16 accumulator registers per thread, stored before the next
        p_ck = part_ck + i_p * 3 * C * K + gl.expand_dims(o_tc, 0) * K + gl.expand_dims(o_km, 1)  # [K, C] -> [C, K]
        b_kc = warpgroup_mma(st_s.permute((1, 0)), dupt_s, zero_kc, use_acc=False, is_async=True)
        gl.store(p_ck, warpgroup_mma_wait(num_outstanding=0, deps=[b_kc]))  # dkd
        b_kc = warpgroup_mma(st_s.permute((1, 0)), dot_s, zero_kc, use_acc=False, is_async=True)
        gl.store(p_ck + C * K, warpgroup_mma_wait(num_outstanding=0, deps=[b_kc]))  # dqd
        b_kc = warpgroup_mma(ds_s, ut_s, zero_kc, use_acc=False, is_async=True)
        gl.store(p_ck + 2 * C * K, warpgroup_mma_wait(num_outstanding=0, deps=[b_kc]))  # dkr
