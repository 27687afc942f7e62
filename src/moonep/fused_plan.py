"""The planner and the hit placement of one dispatch in a few Triton kernels (CUDA; Triton's interpreter on CPU).

Shape suffixes: R ranks, S max tokens per rank, K top-k, E routed experts, P experts per rank, T = R*S*K
hits (flat in (source rank, token, k) order), X = 1 + 2*S*K words of a gathered layout row, C slots here.

The torch path of `moonep.layout` (`counts_and_occurrence`, `compute_plan`, `place_hits_triton`) issues
about 80 small kernels between the layout all-gather and the first slot store; each costs a few
microseconds on the critical path of dispatch whatever its size (run A/B profiles: ~0.25 ms in all).
Here the same results come from:

1. `hit_keys_kernel`: every hit's expert id from the gathered rows, as a 16-bit sort key (``E`` for none);
2. one stable ``torch.sort`` of those keys (a radix sort: 2 passes over 16-bit keys). Flat order is
   source-major, so the sorted order is (expert, source rank, token, k): the slot order of `moonep.plan`;
3. `group_bounds_kernel`: where each (expert, source) group starts and ends in the sorted order, so
   ``counts_RE`` needs no atomics (a histogram by atomics serialises when every hit goes to one expert);
4. `plan_kernel`: the whole `compute_plan` in one program (E <= 4096: one block of experts; the home
   layout's "smallest expert first" order is a block sort of (home, load, expert) keys);
5. `place_sorted_kernel`: per sorted hit, its position inside its expert is its distance to the group's
   first hit, so the occurrence index needs no second pass; placement as `moonep.kernels.place_hit`, and
   the handle's per-slot tables written in the same kernel (unused slots included).

The plan equals `compute_plan`'s field by field and the handle equals the torch path's
(`tests/moonep/test_kernels.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moonep.kernels import place_hit
from moonep.plan import Plan

MAX_PLAN_BLOCK = 8192
"""Largest ``next_pow2(E) * next_pow2(R)`` `plan_kernel` takes in one program (its [E, R] tiles live in
registers); larger groups plan with the torch path."""


def fits(R: int, E: int, T: int) -> bool:
    """Whether the fused path handles ``R`` ranks, ``E`` experts and ``T`` hits (else: the torch path)."""
    return T > 0 and E < 2**15 and triton.next_power_of_2(E) * triton.next_power_of_2(R) <= MAX_PLAN_BLOCK


@dataclass(frozen=True)
class SortedHits:
    """Every hit in slot order, as the fused planner leaves them for `place_sorted`."""

    sorted_T: torch.Tensor
    """``[T]`` int16 expert id of each hit in sorted order (``E``: no hit, sorted last)."""
    perm_T: torch.Tensor
    """``[T]`` int64 flat index (``(src*S + t)*K + k``) of each sorted hit."""
    first_E: torch.Tensor
    """``[E]`` int64 position of each expert's first hit in sorted order."""
    rows_RX: torch.Tensor
    """``[R, X]`` int32 gathered layout rows (the gate weights are read from them)."""


@triton.jit
def layout_row_kernel(idx_ptr, w_ptr, row_ptr, n, E, SK: tl.constexpr, BT: tl.constexpr):
    # Row = [status 0, ids clamped to [-2, E] (-1 past n), fp32 weight bits (0 past n)].
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < SK
    m_n = o_t < n
    b_idx = tl.load(idx_ptr + o_t, mask=m_n, other=-1).to(tl.int64)
    b_idx = tl.minimum(tl.maximum(b_idx, -2), E).to(tl.int32)
    b_w = tl.load(w_ptr + o_t, mask=m_n, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    tl.store(row_ptr + 1 + o_t, b_idx, mask=m_t)
    tl.store(row_ptr + 1 + SK + o_t, b_w, mask=m_t)
    tl.store(row_ptr + o_t, tl.zeros_like(b_idx), mask=o_t == 0)


def layout_row(topk_idx: torch.Tensor, topk_weights: torch.Tensor, S: int, E: int) -> torch.Tensor:
    """`moonep.layout.layout_row` in one kernel: ``[1 + 2*S*K]`` int32."""
    s, K = topk_idx.shape
    row = torch.empty(1 + 2 * S * K, dtype=torch.int32, device=topk_idx.device)
    BT = 1024
    layout_row_kernel[(triton.cdiv(max(S * K, 1), BT),)](
        topk_idx.contiguous(), topk_weights.detach().contiguous(), row, s * K, E, SK=S * K, BT=BT, num_warps=4
    )
    return row


@triton.jit
def hit_keys_kernel(rows_ptr, key_ptr, T, X, E, SK: tl.constexpr, BT: tl.constexpr):
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_idx = tl.load(rows_ptr + (o_t // SK) * X + 1 + o_t % SK, mask=m_t, other=-1)  # [BT] int32
    b_key = tl.where((b_idx >= 0) & (b_idx < E), b_idx, E)
    tl.store(key_ptr + o_t, b_key.to(key_ptr.dtype.element_ty), mask=m_t)


@triton.jit
def group_bounds_kernel(sorted_ptr, perm_ptr, bounds_ptr, T, NB, R: tl.constexpr, SK: tl.constexpr, BT: tl.constexpr):
    # Group key (expert, source) = e*R + src; bounds[0, key] = first sorted position, bounds[1, key] = last + 1.
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_key = tl.load(sorted_ptr + o_t, mask=m_t, other=0).to(tl.int64) * R + tl.load(perm_ptr + o_t, mask=m_t) // SK
    m_prev = m_t & (o_t > 0)
    b_prev = tl.load(sorted_ptr + o_t - 1, mask=m_prev, other=0).to(tl.int64) * R
    b_prev = tl.where(m_prev, b_prev + tl.load(perm_ptr + o_t - 1, mask=m_prev, other=0) // SK, -1)
    m_next = (o_t + 1) < T
    b_next = tl.load(sorted_ptr + o_t + 1, mask=m_next, other=0).to(tl.int64) * R
    b_next = tl.where(m_next, b_next + tl.load(perm_ptr + o_t + 1, mask=m_next, other=0) // SK, -1)
    tl.store(bounds_ptr + b_key, o_t.to(tl.int32), mask=m_t & (b_prev != b_key))
    tl.store(bounds_ptr + NB + b_key, (o_t + 1).to(tl.int32), mask=m_t & (b_next != b_key))


@triton.jit
def plan_kernel(
    bounds_ptr,
    counts_ptr,
    src_prefix_ptr,
    assign_ptr,
    keep_ptr,
    ovf_start_ptr,
    spare_start_ptr,
    spare_end_ptr,
    red_ids_ptr,
    red_idx_ptr,
    num_red_ptr,
    local_counts_ptr,
    local_offsets_ptr,
    load_ptr,
    first_ptr,
    scratch_ptr,
    E: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    BALANCED: tl.constexpr,
    BE: tl.constexpr,
    BR: tl.constexpr,
):
    # `plan.compute_plan`, step by step, in one program: rows of the [BE, BR] tiles are experts, columns ranks.
    NB: tl.constexpr = (E + 1) * R
    N: tl.constexpr = E - P
    L: tl.constexpr = E
    o_e = tl.arange(0, BE).to(tl.int64)
    o_r = tl.arange(0, BR).to(tl.int64)
    m_e = o_e < E
    m_r = o_r < R
    m_er = m_e[:, None] & m_r[None, :]  # [BE, BR]
    o_er = o_r[None, :] * E + o_e[:, None]  # [BE, BR]: offset of (e, r) in an [R, E] output
    o_key = o_e[:, None] * R + o_r[None, :]
    b_cnt = tl.load(bounds_ptr + NB + o_key, mask=m_er, other=0) - tl.load(bounds_ptr + o_key, mask=m_er, other=0)
    b_cnt = b_cnt.to(tl.int64)  # [BE, BR] hits of expert e from source r
    tl.store(counts_ptr + o_er, b_cnt, mask=m_er)
    tl.store(src_prefix_ptr + o_er, tl.cumsum(b_cnt, axis=1) - b_cnt, mask=m_er)
    b_load = tl.sum(b_cnt, axis=1)  # [BE]
    tl.store(first_ptr + o_e, tl.cumsum(b_load, axis=0) - b_load, mask=m_e)
    b_home = o_e // P  # [BE]; padding rows get homes >= R
    m_home = b_home[:, None] == o_r[None, :]  # [BE, BR]
    b_rank_load = tl.sum(tl.where(m_home, b_load[:, None], 0), axis=0)  # [BR]
    b_total = tl.sum(b_load, axis=0)
    if BALANCED:
        b_target = b_total // R + (o_r < b_total % R).to(tl.int64)
    else:
        b_target = b_rank_load
    b_target = tl.where(m_r, b_target, 0)

    # -- home layout, smallest expert first: sort (home, load, expert) keys; a home's experts are contiguous
    # in that order, so an expert starts after the loads before it minus the loads of the homes before.
    b_sorted = tl.sort((tl.minimum(b_home, R) << 50) | (b_load << 16) | o_e)  # [BE] (loads < 2**34, E < 2**16)
    s_e = b_sorted & 0xFFFF
    s_load = (b_sorted >> 16) & 0x3FFFFFFFF
    s_home = b_sorted >> 50
    b_home_first = tl.cumsum(b_rank_load, axis=0) - b_rank_load  # [BR]
    s_base = tl.sum(tl.where(s_home[:, None] == o_r[None, :], b_home_first[None, :], 0), axis=1)
    tl.store(scratch_ptr + s_e, tl.cumsum(s_load, axis=0) - s_load - s_base, mask=s_e < E)
    tl.debug_barrier()  # the scratch is written in sorted order and read back in expert order
    b_start = tl.load(scratch_ptr + o_e, mask=m_e, other=0, volatile=True)  # [BE]

    b_target_e = tl.sum(tl.where(m_home, b_target[None, :], 0), axis=1)  # [BE]
    b_keep = tl.minimum(tl.maximum(b_target_e - b_start, 0), b_load)
    b_over = b_load - b_keep
    b_ovf_R = tl.maximum(b_rank_load - b_target, 0)
    b_ovf_first = tl.sum(tl.where(m_home, (tl.cumsum(b_ovf_R, axis=0) - b_ovf_R)[None, :], 0), axis=1)
    b_ovf_start = b_ovf_first + tl.maximum(b_start + b_keep - b_target_e, 0)
    b_spare = tl.maximum(b_target - b_rank_load, 0)  # [BR]
    b_spare_end = tl.cumsum(b_spare, axis=0)
    b_spare_start = b_spare_end - b_spare
    b_lo = tl.maximum(b_ovf_start[:, None], b_spare_start[None, :])
    b_hi = tl.minimum((b_ovf_start + b_over)[:, None], b_spare_end[None, :])
    b_overlap = tl.where(m_er, tl.maximum(b_hi - b_lo, 0), 0)  # [BE, BR] slots of e on redundant holder r
    b_assign = b_overlap + tl.where(m_home, b_keep[:, None], 0)
    b_load_R = tl.sum(b_assign, axis=0)  # [BR]
    tl.store(keep_ptr + o_e, b_keep, mask=m_e)
    tl.store(ovf_start_ptr + o_e, b_ovf_start, mask=m_e)
    tl.store(spare_start_ptr + o_r, b_spare_start, mask=m_r)
    tl.store(spare_end_ptr + o_r, b_spare_end, mask=m_r)
    tl.store(assign_ptr + o_e[:, None] * R + o_r[None, :], b_assign, mask=m_er)
    tl.store(load_ptr + o_r, b_load_R, mask=m_r)

    # -- redundant tables: rank r's copies in ascending expert id
    b_red = (b_overlap > 0).to(tl.int64)
    b_red_idx = tl.cumsum(b_red, axis=0) - b_red  # [BE, BR]
    b_num_red = tl.sum(b_red, axis=0)  # [BR]
    tl.store(red_idx_ptr + o_e[:, None] * R + o_r[None, :], b_red_idx, mask=m_er)
    tl.store(num_red_ptr + o_r, b_num_red, mask=m_r)
    m_red = m_er & (b_red > 0)
    m_tail = m_r[None, :] & (o_e[:, None] < N) & (o_e[:, None] >= b_num_red[None, :])  # rows = table entries n
    o_rn = o_r[None, :] * N
    tl.store(red_ids_ptr + o_rn + b_red_idx, o_e[:, None] + 0 * o_r[None, :], mask=m_red)
    tl.store(red_ids_ptr + o_rn + o_e[:, None], tl.full([BE, BR], -1, tl.int64), mask=m_tail)

    # -- local experts of each rank: home experts 0..P-1, then the redundant table
    b_keep_R = tl.sum(tl.where(m_home, b_keep[:, None], 0), axis=0)  # [BR]
    b_keep_first = tl.sum(tl.where(m_home, (tl.cumsum(b_keep_R, axis=0) - b_keep_R)[None, :], 0), axis=1)
    b_home_off = tl.cumsum(b_keep, axis=0) - b_keep - b_keep_first  # [BE]
    o_rl = o_r[None, :] * L
    m_mine = m_er & m_home
    o_home = o_rl + o_e[:, None] - o_r[None, :] * P
    tl.store(local_counts_ptr + o_home, tl.where(m_home, b_keep[:, None], 0), mask=m_mine)
    tl.store(local_offsets_ptr + o_home, tl.where(m_home, b_home_off[:, None], 0), mask=m_mine)
    b_red_off = b_keep_R[None, :] + tl.cumsum(b_overlap, axis=0) - b_overlap  # [BE, BR]
    tl.store(local_counts_ptr + o_rl + P + b_red_idx, b_overlap, mask=m_red)
    tl.store(local_offsets_ptr + o_rl + P + b_red_idx, b_red_off, mask=m_red)
    tl.store(local_counts_ptr + o_rl + P + o_e[:, None], tl.zeros([BE, BR], tl.int64), mask=m_tail)
    tl.store(local_offsets_ptr + o_rl + P + o_e[:, None], b_load_R[None, :] + 0 * o_e[:, None], mask=m_tail)


@triton.jit
def place_sorted_kernel(
    sorted_ptr,
    perm_ptr,
    rows_ptr,
    first_ptr,
    keep_ptr,
    ovf_start_ptr,
    spare_start_ptr,
    spare_end_ptr,
    red_idx_ptr,
    offsets_ptr,
    load_ptr,
    recv_ptr,
    slot_src_ptr,
    weights_ptr,
    T,
    C,
    X,
    rank,
    E: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    K: tl.constexpr,
    SK: tl.constexpr,
    BT: tl.constexpr,
):
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)  # sorted positions
    m_t = o_t < T
    b_e = tl.load(sorted_ptr + o_t, mask=m_t, other=E).to(tl.int64)
    m_hit = m_t & (b_e < E)
    b_e = tl.where(m_hit, b_e, 0)
    b_f = tl.load(perm_ptr + o_t, mask=m_t, other=0)  # flat index of the hit
    b_j = o_t - tl.load(first_ptr + b_e, mask=m_hit, other=0)  # its position among its expert's slots
    b_dest, b_slot = place_hit(
        b_e, b_j, m_hit, keep_ptr, ovf_start_ptr, spare_start_ptr, spare_end_ptr, red_idx_ptr, offsets_ptr,
        R, 1, E, 1, P, R,
    )  # fmt: skip
    m_mine = m_hit & (b_dest == rank)
    tl.store(recv_ptr + b_f, tl.where(m_mine, b_slot, -1), mask=m_t)
    b_slot = tl.where(m_mine, b_slot, 0)
    tl.store(slot_src_ptr + b_slot, b_f // K, mask=m_mine)
    b_w = tl.load(rows_ptr + (b_f // SK) * X + 1 + SK + b_f % SK, mask=m_mine, other=0)
    tl.store(weights_ptr + b_slot, b_w.to(tl.float32, bitcast=True), mask=m_mine)
    # Slots past the used count (never placed above): a zero row and weight 0.
    m_free = (o_t < C) & (o_t >= tl.load(load_ptr + rank))
    tl.store(slot_src_ptr + o_t, tl.zeros_like(o_t) + T // K, mask=m_free)
    tl.store(weights_ptr + o_t, tl.zeros([BT], tl.float32), mask=m_free)


def plan_sorted(rows_RX: torch.Tensor, S: int, K: int, E: int, *, balanced: bool) -> tuple[Plan, SortedHits]:
    """The `Plan` from the gathered layout rows, and the sorted hits for `place_sorted` (no host sync).

    Args:
        rows_RX: ``[R, 1 + 2*S*K]`` int32 gathered rows (`moonep.layout.layout_row`).
        S, K, E: max tokens per rank, top-k, routed experts; `fits` must hold.
        balanced: as in `moonep.plan.compute_plan`.

    Returns:
        ``(plan, hits)``; the plan equals ``compute_plan(counts_RE, balanced=balanced)``.
    """
    R, X = rows_RX.shape
    T, P, device = R * S * K, E // R, rows_RX.device
    BT = 1024
    keys = torch.empty(T, dtype=torch.int16, device=device)
    hit_keys_kernel[(triton.cdiv(T, BT),)](rows_RX, keys, T, X, E, SK=S * K, BT=BT, num_warps=4)
    sorted_T, perm_T = torch.sort(keys, stable=True)
    NB = (E + 1) * R
    bounds = torch.zeros(2 * NB, dtype=torch.int32, device=device)
    group_bounds_kernel[(triton.cdiv(T, BT),)](sorted_T, perm_T, bounds, T, NB, R=R, SK=S * K, BT=BT, num_warps=4)

    def new(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.long, device=device)

    out = {
        "counts_RE": new(R, E), "src_prefix_RE": new(R, E), "assign_ER": new(E, R), "keep_E": new(E),
        "ovf_start_E": new(E), "spare_start_R": new(R), "spare_end_R": new(R), "redundant_ids_RN": new(R, E - P),
        "redundant_idx_ER": new(E, R), "num_redundant_R": new(R), "local_counts_RL": new(R, E),
        "local_offsets_RL": new(R, E), "load_R": new(R),
    }  # fmt: skip
    first_E, scratch = new(E), new(triton.next_power_of_2(E))
    BE, BR = triton.next_power_of_2(E), triton.next_power_of_2(R)
    plan_kernel[(1,)](
        bounds, *out.values(), first_E, scratch, E=E, R=R, P=P, BALANCED=balanced, BE=BE, BR=BR,
        num_warps=8 if BE * BR >= 2048 else 4,
    )  # fmt: skip
    plan = Plan(num_ranks=R, num_experts=E, balanced=balanced, **out)
    return plan, SortedHits(sorted_T, perm_T, first_E, rows_RX)


def place_sorted(
    plan: Plan, hits: SortedHits, rank: int, S: int, K: int, C: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(recv_T, slot_src_C, weights_C)`` of this rank's handle, as the torch path of `moonep.layout` gives them."""
    R, E = plan.num_ranks, plan.num_experts
    T = R * S * K
    device = hits.sorted_T.device
    recv = torch.empty(T, dtype=torch.long, device=device)
    slot_src = torch.empty(C, dtype=torch.long, device=device)
    weights = torch.empty(C, dtype=torch.float32, device=device)
    BT = 1024
    place_sorted_kernel[(triton.cdiv(max(T, C), BT),)](
        hits.sorted_T, hits.perm_T, hits.rows_RX, hits.first_E, plan.keep_E, plan.ovf_start_E, plan.spare_start_R,
        plan.spare_end_R, plan.redundant_idx_ER, plan.local_offsets_RL, plan.load_R, recv, slot_src, weights,
        T, C, hits.rows_RX.shape[1], rank, E=E, P=E // R, R=R, K=K, SK=S * K, BT=BT, num_warps=4,
    )  # fmt: skip
    return recv, slot_src, weights
