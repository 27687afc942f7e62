"""Triton kernels of the local dispatch and combine steps (imported on first CUDA use, never by ``import moonep``).

Shape suffixes: T received rows (R*S), K top-k, C slots on this rank, H hidden, n rows of one chunk.

`scatter_rows_triton`: each received token row is read once and stored into every slot it hits on this
rank. Bytes: ``n*H*2`` read, one ``H*2`` write per used slot; at ``C = 65536``, ``H = 7168`` the writes are
0.94 GB (~0.22 ms at ~4.3 TB/s). Gathering slot by slot (``index_select``) instead reads the source row
once per slot (another 0.94 GB: rows are reused ``K`` times, ``R*S*H*2`` = 117 MB does not stay in L2).
`zero_rows_from_triton`: zeroes slot rows past the used count (a device scalar: no host synchronisation).
`sum_ranks_triton`: ``out[t] = sum_r partial[r, t]`` in fp32, stored once in the output dtype.
`reduce_own_and_sum_triton`: the remote-only combine's last step: this rank's own token rows reduced from
their slots and summed with the ``R-1`` received partials in one pass (the same bits as `reduce_slots_triton`
+ all-to-all + `sum_ranks_triton`). Bytes saved per combine at ``S = 4096``, ``H = 7168``, bf16: the own
partial's write (58.7 MB), the all-to-all's self copy (read + write, 117 MB) and its read back (58.7 MB).
`place_hits_triton`: the per-hit placement of `moonep.plan` and the handle's scatters in one kernel (about
30 small torch kernels otherwise, each a few microseconds on the critical path of dispatch).

`reduce_slots_triton`: ``partial[t] = sum_k w[slot[t,k]] * y[slot[t,k]]`` over the hits of row ``t`` that
this rank computed (``slot >= 0``), in fp32, written once in the wire dtype. Bytes: each used slot row is
read once (``C*H*2`` for bf16) and each partial row written once (``T*H*2``); at ``C = 65536``, ``H = 7168``
that is 0.94 GB + 0.12 GB, about 0.25 ms at the H200's ~4.3 TB/s copy rate. The torch alternative
(gather into ``[T, K, H]`` or ``index_add_`` in fp32) moves several times more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def reduce_row(y_ptr, slots_ptr, w_ptr, i_t, o_h, m_h, H, K: tl.constexpr, HAS_W: tl.constexpr, BH: tl.constexpr):
    """``sum_k w[slot[t,k]] * y[slot[t,k], o_h]`` over the hits of row ``i_t`` computed here, fp32 ``[BH]``."""
    b_acc = tl.zeros([BH], dtype=tl.float32)
    for k in tl.static_range(K):
        b_slot = tl.load(slots_ptr + i_t * K + k)
        # Hits computed on another rank (slot -1) contribute nothing and read nothing.
        m_use = b_slot >= 0
        b_slot = tl.where(m_use, b_slot, 0).to(tl.int64)
        m_y = m_h & ((tl.zeros([BH], dtype=tl.int32) + m_use.to(tl.int32)) != 0)  # [BH]
        b_y = tl.load(y_ptr + b_slot * H + o_h, mask=m_y, other=0.0).to(tl.float32)  # [BH]
        if HAS_W:
            b_w = tl.where(m_use, tl.load(w_ptr + b_slot).to(tl.float32), 0.0)
            b_y = b_y * b_w
        b_acc += b_y
    return b_acc


@triton.jit
def reduce_slots_kernel(
    y_ptr,
    slots_ptr,
    w_ptr,
    out_ptr,
    H,
    K: tl.constexpr,
    HAS_W: tl.constexpr,
    BH: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < H
    b_acc = reduce_row(y_ptr, slots_ptr, w_ptr, i_t, o_h, m_h, H, K, HAS_W, BH)  # [BH]
    tl.store(out_ptr + i_t.to(tl.int64) * H + o_h, b_acc.to(out_ptr.dtype.element_ty), mask=m_h)


def reduce_slots_triton(
    y_CH: torch.Tensor,
    recv_slots_TK: torch.Tensor,
    weights_C: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    T, K = recv_slots_TK.shape
    H = y_CH.shape[1]
    y_CH = y_CH.contiguous()
    slots = recv_slots_TK.contiguous()
    out = torch.empty((T, H), dtype=out_dtype, device=y_CH.device)
    if T == 0:
        return out
    BH = min(1024, triton.next_power_of_2(H))
    w = weights_C.contiguous() if weights_C is not None else y_CH
    reduce_slots_kernel[(T, triton.cdiv(H, BH))](
        y_CH, slots, w, out, H, K=K, HAS_W=weights_C is not None, BH=BH, num_warps=4
    )
    return out


@triton.jit
def reduce_own_and_sum_kernel(
    y_ptr,
    slots_ptr,
    w_ptr,
    recv_ptr,
    out_ptr,
    n,
    H,
    rank,
    K: tl.constexpr,
    R: tl.constexpr,
    HAS_W: tl.constexpr,
    BH: tl.constexpr,
):
    # reduce_slots_kernel for one own token row, rounded to the wire dtype, then sum_ranks_kernel's rank-order
    # fp32 sum with that row in place of the partial this rank used to send to itself: same bits, no round trip.
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < H
    b_own = reduce_row(y_ptr, slots_ptr, w_ptr, i_t, o_h, m_h, H, K, HAS_W, BH)  # [BH]
    b_own = b_own.to(recv_ptr.dtype.element_ty).to(tl.float32)
    b_acc = tl.zeros([BH], dtype=tl.float32)
    # As a tensor: Triton may specialise rank == 1 into a constant, and the block index below needs a tensor.
    b_rank = tl.zeros([BH], dtype=tl.int32) + rank  # [BH]
    for r in tl.static_range(R):
        m_own = b_rank == r  # [BH]
        b_q = r - (b_rank < r).to(tl.int32)  # [BH] block of rank r among the R-1 received ones
        p_recv = recv_ptr + (b_q.to(tl.int64) * n + i_t) * H + o_h  # [BH]
        b_p = tl.load(p_recv, mask=m_h & ~m_own, other=0.0)
        b_acc += tl.where(m_own, b_own, b_p.to(tl.float32))
    tl.store(out_ptr + i_t.to(tl.int64) * H + o_h, b_acc.to(out_ptr.dtype.element_ty), mask=m_h)


def reduce_own_and_sum_triton(
    y_CH: torch.Tensor,
    own_slots_nK: torch.Tensor,
    weights_C: torch.Tensor | None,
    recv_QnH: torch.Tensor,
    rank: int,
    out_mH: torch.Tensor,
) -> None:
    m, H = out_mH.shape
    if m == 0:
        return
    Q, n, _ = recv_QnH.shape
    K = own_slots_nK.shape[1]
    BH = min(1024, triton.next_power_of_2(H))
    y_CH = y_CH.contiguous()
    w = weights_C.contiguous() if weights_C is not None else y_CH
    reduce_own_and_sum_kernel[(m, triton.cdiv(H, BH))](
        y_CH, own_slots_nK.contiguous(), w, recv_QnH.contiguous(), out_mH, n, H, rank,
        K=K, R=Q + 1, HAS_W=weights_C is not None, BH=BH, num_warps=4,
    )  # fmt: skip


@triton.jit
def scatter_rows_kernel(src_ptr, rows_ptr, slots_ptr, dst_ptr, H, K: tl.constexpr, BH: tl.constexpr):
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < H
    # rows_ptr[i_n]: the received-row index (src*S + t) of source row i_n; -1 skips the row.
    b_row = tl.load(rows_ptr + i_n)
    m_row = m_h & ((tl.zeros([BH], dtype=tl.int64) + b_row) >= 0)  # [BH]
    b_x = tl.load(src_ptr + i_n.to(tl.int64) * H + o_h, mask=m_row, other=0.0)  # [BH]
    b_row = tl.where(b_row >= 0, b_row, 0)
    for k in tl.static_range(K):
        b_slot = tl.load(slots_ptr + b_row * K + k)
        m_st = m_row & ((tl.zeros([BH], dtype=tl.int64) + b_slot) >= 0)  # [BH]
        b_slot = tl.where(b_slot >= 0, b_slot, 0)
        tl.store(dst_ptr + b_slot * H + o_h, b_x, mask=m_st)


def scatter_rows_triton(
    dst_CH: torch.Tensor, src_nH: torch.Tensor, rows_n: torch.Tensor, recv_slots_TK: torch.Tensor
) -> None:
    n, H = src_nH.shape
    if n == 0:
        return
    K = recv_slots_TK.shape[1]
    BH = min(1024, triton.next_power_of_2(H))
    scatter_rows_kernel[(n, triton.cdiv(H, BH))](
        src_nH.contiguous(), rows_n.contiguous(), recv_slots_TK.contiguous(), dst_CH, H, K=K, BH=BH, num_warps=4
    )


@triton.jit
def zero_rows_from_kernel(dst_ptr, used_ptr, C, H, BC: tl.constexpr, BH: tl.constexpr):
    # Blocks of BC rows: one program per (row block, column block), so that a buffer whose rows are
    # all used costs a few thousand programs whose stores are masked off, not one program per row.
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    o_c = i_c.to(tl.int64) * BC + tl.arange(0, BC)
    o_h = i_h * BH + tl.arange(0, BH)
    b_used = tl.load(used_ptr)
    m_c = (o_c >= b_used) & (o_c < C)  # [BC]
    p_dst = dst_ptr + o_c[:, None] * H + o_h[None, :]  # [BC, BH]
    tl.store(p_dst, tl.zeros([BC, BH], dtype=dst_ptr.dtype.element_ty), mask=m_c[:, None] & (o_h < H)[None, :])


def zero_rows_from_triton(dst_CH: torch.Tensor, used: torch.Tensor) -> None:
    C, H = dst_CH.shape
    if C == 0:
        return
    BC, BH = 16, min(256, triton.next_power_of_2(H))
    grid = (triton.cdiv(C, BC), triton.cdiv(H, BH))
    zero_rows_from_kernel[grid](dst_CH, used.reshape(1).long(), C, H, BC=BC, BH=BH, num_warps=4)


@triton.jit
def sum_ranks_kernel(src_ptr, out_ptr, n, H, R: tl.constexpr, BH: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < H
    b_acc = tl.zeros([BH], dtype=tl.float32)
    for r in tl.static_range(R):
        b_acc += tl.load(src_ptr + (r * n + i_t).to(tl.int64) * H + o_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_t.to(tl.int64) * H + o_h, b_acc.to(out_ptr.dtype.element_ty), mask=m_h)


def sum_ranks_triton(src_RnH: torch.Tensor, out_mH: torch.Tensor) -> None:
    R, n, H = src_RnH.shape
    m = out_mH.shape[0]
    if m == 0:
        return
    BH = min(1024, triton.next_power_of_2(H))
    sum_ranks_kernel[(m, triton.cdiv(H, BH))](src_RnH.contiguous(), out_mH, n, H, R=R, BH=BH, num_warps=4)


@triton.jit
def place_hit(
    b_e,
    b_j,
    m_hit,
    keep_ptr,
    ovf_start_ptr,
    spare_start_ptr,
    spare_end_ptr,
    red_idx_ptr,
    offsets_ptr,
    stride_red_e,
    stride_red_r,
    stride_off_r,
    stride_off_l,
    P: tl.constexpr,
    R: tl.constexpr,
):
    """`plan._place` for a block of hits: ``(dest, slot)`` of the ``b_j``-th slot of expert ``b_e`` (int64)."""
    b_home = b_e // P
    b_keep = tl.load(keep_ptr + b_e, mask=m_hit, other=0)
    b_ovf = tl.load(ovf_start_ptr + b_e, mask=m_hit, other=0)
    m_in_home = b_j < b_keep
    b_q = b_ovf + (b_j - b_keep)
    # searchsorted(spare_end, q, right=True), clamped to R - 1: how many ranks' spare ends at or before q.
    b_spare = tl.zeros_like(b_e)
    for r in tl.static_range(R):
        b_spare += (tl.load(spare_end_ptr + r) <= b_q).to(tl.int64)
    b_spare = tl.minimum(b_spare, R - 1)
    b_dest = tl.where(m_in_home, b_home, b_spare)
    b_spare_start = tl.load(spare_start_ptr + b_dest, mask=m_hit, other=0)
    b_pos = tl.where(m_in_home, b_j, b_q - tl.maximum(b_ovf, b_spare_start))
    b_red = tl.load(red_idx_ptr + b_e * stride_red_e + b_dest * stride_red_r, mask=m_hit, other=0)
    b_local = tl.where(b_dest == b_home, b_e - b_home * P, P + b_red)
    b_slot = tl.load(offsets_ptr + b_dest * stride_off_r + b_local * stride_off_l, mask=m_hit, other=0) + b_pos
    return b_dest, b_slot


@triton.jit
def place_hits_kernel(
    expert_ptr,
    occ_ptr,
    weight_ptr,
    keep_ptr,
    ovf_start_ptr,
    spare_start_ptr,
    spare_end_ptr,
    red_idx_ptr,
    offsets_ptr,
    recv_ptr,
    slot_src_ptr,
    weights_ptr,
    T,
    rank,
    stride_red_e,
    stride_red_r,
    stride_off_r,
    stride_off_l,
    E: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
):
    # The steps of `plan._place` for BT hits, then the hits this rank computes are written into the handle.
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_e = tl.load(expert_ptr + o_t, mask=m_t, other=E)  # [BT]
    m_hit = m_t & (b_e < E)
    b_e = tl.where(m_hit, b_e, 0)
    b_j = tl.load(occ_ptr + o_t, mask=m_hit, other=0)
    b_dest, b_slot = place_hit(
        b_e, b_j, m_hit, keep_ptr, ovf_start_ptr, spare_start_ptr, spare_end_ptr, red_idx_ptr, offsets_ptr,
        stride_red_e, stride_red_r, stride_off_r, stride_off_l, P, R,
    )  # fmt: skip
    m_mine = m_hit & (b_dest == rank)
    tl.store(recv_ptr + o_t, tl.where(m_mine, b_slot, -1), mask=m_t)
    b_slot = tl.where(m_mine, b_slot, 0)
    tl.store(slot_src_ptr + b_slot, o_t // K, mask=m_mine)
    tl.store(weights_ptr + b_slot, tl.load(weight_ptr + o_t, mask=m_mine, other=0.0), mask=m_mine)


def place_hits_triton(
    plan, rank: int, expert_T: torch.Tensor, occ_T: torch.Tensor, weight_T: torch.Tensor, C: int, K: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(recv_T, slot_src_C, weights_C)`` as `moonep.layout.Layout.handle` computes them with torch ops."""
    T = expert_T.numel()
    R, E = plan.num_ranks, plan.num_experts
    recv = torch.empty(T, dtype=torch.long, device=expert_T.device)
    slot_src = torch.full((C,), T // K, dtype=torch.long, device=expert_T.device)
    weights = torch.zeros(C, dtype=torch.float32, device=expert_T.device)
    if T == 0:
        return recv, slot_src, weights
    red, offsets = plan.redundant_idx_ER, plan.local_offsets_RL
    BT = 1024
    place_hits_kernel[(triton.cdiv(T, BT),)](
        expert_T.contiguous(), occ_T.contiguous(), weight_T.contiguous(), plan.keep_E.contiguous(),
        plan.ovf_start_E.contiguous(), plan.spare_start_R.contiguous(), plan.spare_end_R.contiguous(), red,
        offsets, recv, slot_src, weights, T, rank, red.stride(0), red.stride(1), offsets.stride(0),
        offsets.stride(1), E=E, P=E // R, R=R, K=K, BT=BT, num_warps=4,
    )  # fmt: skip
    return recv, slot_src, weights
