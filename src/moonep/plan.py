"""The balanced planner: which rank computes which slots of which expert, on the device, with static shapes.

Shape suffixes used in this module:
    R  ranks of the expert-parallel group      E  routed experts (global ids)
    P  experts per rank (home experts, E / R)  N  redundant-expert table width (E - P)
    L  local expert slots on a rank (P + N)    S  max tokens per rank        K  top-k

A *slot* is one (token, k) hit. Every rank's routing is all-gathered, and its histogram (``counts_RE``,
`counts_and_occurrence`) gives every rank the same `Plan`, computed with torch ops only (no host
synchronisation, static shapes):

1. The slots of an expert are ordered by source rank, then by (token, k) inside a source rank.
2. Each rank's target is an equal share of all slots (``total // R``, the first ``total % R`` ranks one
   more); when every rank has ``s`` tokens with ``K`` hits each, that is exactly ``s*K``.
3. On an over-loaded rank, home experts are laid out smallest load first; the slots past the target
   (so those of the largest experts) overflow. Overflow of all ranks, in rank order, is one line; the
   spare capacity of the under-loaded ranks, in rank order, is another line of the same length; the two
   lines are matched position by position. Where an expert's overflow meets a rank's spare interval,
   that rank holds a *redundant* copy of the expert and computes those slots.
4. Taking the largest experts first keeps the number of redundant copies small: a rank holds at most
   one partial expert per overflow interval it meets.

`route_tokens` then maps one source rank's ``topk_idx`` to (destination rank, destination slot) per hit.
`reference.reference_plan` computes the same plan with plain Python loops, and `moonep.fused_plan` with a
sort and a few Triton kernels (the path `Buffer` takes on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Where every expert's slots are computed, for one micro-batch. Identical on every rank.

    All tensors are int64 on the device the plan was computed on. A plan can be reused: the backward of
    combine is a dispatch with the saved plan.
    """

    num_ranks: int
    num_experts: int
    balanced: bool
    counts_RE: torch.Tensor
    """``[R, E]`` hits of each expert from each source rank."""
    assign_ER: torch.Tensor
    """``[E, R]`` slots of expert ``e`` computed on rank ``r``."""
    keep_E: torch.Tensor
    """``[E]`` slots an expert keeps on its home rank (its first ``keep_E[e]`` slots)."""
    ovf_start_E: torch.Tensor
    """``[E]`` where the expert's overflow starts on the global overflow line."""
    spare_start_R: torch.Tensor
    """``[R]`` start of each rank's spare interval on the overflow line."""
    spare_end_R: torch.Tensor
    """``[R]`` end (exclusive) of each rank's spare interval."""
    src_prefix_RE: torch.Tensor
    """``[R, E]`` slots of expert ``e`` from ranks before ``r`` (where rank ``r``'s hits start)."""
    redundant_ids_RN: torch.Tensor
    """``[R, N]`` global id of each redundant expert a rank holds, in ascending id order; -1 pads."""
    redundant_idx_ER: torch.Tensor
    """``[E, R]`` position of expert ``e`` in rank ``r``'s redundant table (valid where ``assign_ER > 0``
    and ``r`` is not ``e``'s home)."""
    num_redundant_R: torch.Tensor
    """``[R]`` redundant experts each rank holds."""
    local_counts_RL: torch.Tensor
    """``[R, L]`` slots per local expert: home experts ``0..P-1`` then redundant table entries."""
    local_offsets_RL: torch.Tensor
    """``[R, L]`` first slot of each local expert (exclusive cumsum of ``local_counts_RL``)."""
    load_R: torch.Tensor
    """``[R]`` slots computed on each rank."""

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    def home_of(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Home rank of each expert id (``e // P``)."""
        return torch.div(expert_ids, self.experts_per_rank, rounding_mode="floor")

    def stats(self) -> dict[str, float]:
        """Plan quality (one host synchronisation): max/mean load, against the optimum, redundant copies.

        Returns:
            ``max_over_mean`` of slots per rank, ``optimum_max_over_mean`` (``ceil(total/R)/(total/R)``,
            1.0 when the total divides evenly), ``unbalanced_max_over_mean`` (home placement only),
            ``max_redundant`` and ``mean_redundant`` experts per rank, ``moved_fraction`` of slots
            computed away from home.
        """
        load = self.load_R.double()
        total = float(load.sum())
        mean = total / self.num_ranks if self.num_ranks else 0.0
        home_load = self.counts_RE.sum(0).view(self.num_ranks, -1).sum(1).double()
        best = -(-int(total) // self.num_ranks)
        moved = float(self.assign_ER.sum() - self.keep_E.sum())
        return {
            "max_over_mean": float(load.max()) / mean if mean else 1.0,
            "optimum_max_over_mean": best / mean if mean else 1.0,
            "unbalanced_max_over_mean": float(home_load.max()) / mean if mean else 1.0,
            "max_redundant": float(self.num_redundant_R.max()),
            "mean_redundant": float(self.num_redundant_R.double().mean()),
            "moved_fraction": moved / total if total else 0.0,
        }


def _exclusive_cumsum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    # CUDA scans along an outer dim of a short tensor run one thread per column (~40 us at [2, 896]);
    # scanning a transposed contiguous copy along its last dim is one fast inner scan.
    if dim in (-1, x.dim() - 1):
        return x.cumsum(-1) - x
    inner = x.transpose(dim, -1).contiguous()
    return (inner.cumsum(-1) - inner).transpose(dim, -1)


def compute_plan(counts_RE: torch.Tensor, *, balanced: bool = True) -> Plan:
    """Plan one micro-batch from every rank's routing histogram, with torch ops only.

    Args:
        counts_RE: ``[R, E]`` integer, hits of each expert from each source rank (the all-gathered
            ``bincount`` of every rank's ``topk_idx``). ``E`` must be a multiple of ``R``.
        balanced: plan redundant experts so every rank computes an equal share of slots; False places
            every slot on its expert's home rank (plain dedup'd expert parallelism).

    Returns:
        The `Plan`, on ``counts_RE``'s device.

    Examples::

        counts_RE = torch.tensor([[6, 0, 0, 0], [2, 0, 0, 0]])   # R=2, E=4: expert 0 is hot
        plan = compute_plan(counts_RE)
        plan.load_R            # tensor([4, 4])
        plan.assign_ER[0]      # tensor([4, 4]): rank 1 holds a redundant copy of expert 0
    """
    if counts_RE.dim() != 2:
        raise ValueError(f"counts_RE must be [R, E], got shape {tuple(counts_RE.shape)}")
    R, E = counts_RE.shape
    if R < 1 or E % R != 0:
        raise ValueError(f"counts_RE's experts ({E}) must be a positive multiple of its ranks ({R})")
    P, N = E // R, E - E // R
    device = counts_RE.device
    counts = counts_RE.long()
    ranks_R = torch.arange(R, device=device)
    experts_E = torch.arange(E, device=device)
    home_E = torch.div(experts_E, P, rounding_mode="floor")

    load_E = counts.sum(0)
    src_prefix_RE = _exclusive_cumsum(counts, 0)
    rank_load_R = load_E.view(R, P).sum(1)
    total = load_E.sum()
    if balanced:
        target_R = torch.div(total, R, rounding_mode="floor") + (ranks_R < total % R).long()
    else:
        target_R = rank_load_R

    # Home-local layout, smallest expert first, so the slots past the target belong to the largest
    # experts: fewer experts overflow, so fewer redundant copies (and fewer weights to prefetch).
    # Expert q precedes p on their home rank when (load_q, q) < (load_p, p); p starts after the loads of
    # all its predecessors. One [R, P, P] comparison instead of a segmented sort, gather and scatter.
    load_RP = load_E.view(R, P)
    experts_P = torch.arange(P, device=device)
    before_PP = experts_P[None, :] < experts_P[:, None]  # [p, q]: q < p
    smaller_RPP = load_RP[:, None, :] < load_RP[:, :, None]
    precedes_RPP = smaller_RPP | ((load_RP[:, None, :] == load_RP[:, :, None]) & before_PP[None])
    start_E = (precedes_RPP * load_RP[:, None, :]).sum(-1).view(E)
    target_E = target_R[home_E]
    keep_E = torch.minimum((target_E - start_E).clamp(min=0), load_E)
    over_E = load_E - keep_E
    ovf_R = (rank_load_R - target_R).clamp(min=0)
    ovf_start_E = _exclusive_cumsum(ovf_R)[home_E] + (start_E + keep_E - target_E).clamp(min=0)

    spare_R = (target_R - rank_load_R).clamp(min=0)
    spare_end_R = spare_R.cumsum(0)
    spare_start_R = spare_end_R - spare_R
    lo_ER = torch.maximum(ovf_start_E[:, None], spare_start_R[None, :])
    hi_ER = torch.minimum((ovf_start_E + over_E)[:, None], spare_end_R[None, :])
    overlap_ER = (hi_ER - lo_ER).clamp(min=0)
    is_home_ER = home_E[:, None] == ranks_R[None, :]
    assign_ER = overlap_ER + keep_E[:, None] * is_home_ER.long()

    # A rank with spare never overflows, so overlap is never on an expert's home rank.
    redundant_ER = overlap_ER > 0
    redundant_idx_ER = _exclusive_cumsum(redundant_ER.long(), 0)
    num_redundant_R = redundant_ER.long().sum(0)
    column_ER = torch.where(redundant_ER, redundant_idx_ER, torch.full_like(redundant_idx_ER, N))
    redundant_ids = torch.full((R, N + 1), -1, dtype=torch.long, device=device)
    redundant_ids.scatter_(1, column_ER.t(), experts_E[None, :].expand(R, E).where(redundant_ER.t(), -1))
    redundant_ids_RN = redundant_ids[:, :N].contiguous()

    L = P + N
    local_counts = torch.zeros((R, L + 1), dtype=torch.long, device=device)
    local_counts[:, :P] = keep_E.view(R, P)
    local_counts.scatter_add_(1, (column_ER + P).where(redundant_ER, L).t(), overlap_ER.t().contiguous())
    local_counts_RL = local_counts[:, :L].contiguous()
    return Plan(
        num_ranks=R,
        num_experts=E,
        balanced=balanced,
        counts_RE=counts,
        assign_ER=assign_ER,
        keep_E=keep_E,
        ovf_start_E=ovf_start_E,
        spare_start_R=spare_start_R,
        spare_end_R=spare_end_R,
        src_prefix_RE=src_prefix_RE,
        redundant_ids_RN=redundant_ids_RN,
        redundant_idx_ER=redundant_idx_ER,
        num_redundant_R=num_redundant_R,
        local_counts_RL=local_counts_RL,
        local_offsets_RL=_exclusive_cumsum(local_counts_RL, 1),
        load_R=assign_ER.sum(0),
    )


def histogram(ids_T: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]`` int64 count of each value in ``ids_T`` (values in ``[0, size)``).

    Unlike ``torch.bincount`` on CUDA, this needs no host synchronisation (the output size is static).
    """
    return torch.zeros(size, dtype=torch.long, device=ids_T.device).scatter_add_(0, ids_T, torch.ones_like(ids_T))


def occurrence_index(expert_T: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each hit, how many earlier hits (in flat order) went to the same expert.

    Args:
        expert_T: ``[T]`` int64 expert ids, ``num_experts`` for "no hit" (those get arbitrary values).

    Returns:
        ``[T]`` int64.
    """
    return counts_and_occurrence(expert_T, 1, num_experts)[1]


def counts_and_occurrence(
    expert_T: torch.Tensor, num_ranks: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hits per (source rank, expert) and the occurrence index of every hit, from one stable sort.

    No atomics: a histogram by ``scatter_add_`` serialises on one address when every hit goes to one
    expert. A stable sort by expert keeps flat order inside an expert, and flat order is source-major, so
    the sorted ``(expert, source)`` pairs are sorted too; binary searches then find every group's start.

    Args:
        expert_T: ``[T]`` int64 expert ids in (source rank, ...) flat order, ``T`` a multiple of
            ``num_ranks``; ``num_experts`` for "no hit".

    Returns:
        ``(counts_RE, occ_T)``: ``[R, E]`` int64 hits of each expert from each source; ``[T]`` int64
        hits of the same expert before each hit in flat order (arbitrary for "no hit").
    """
    T, R, E = expert_T.numel(), num_ranks, num_experts
    device = expert_T.device
    if T == 0:
        return torch.zeros((R, E), dtype=torch.long, device=device), torch.zeros(0, dtype=torch.long, device=device)
    # Radix sort passes scale with the key width: 16-bit keys take 2 passes where int64 takes 8.
    narrow = torch.int16 if E < 2**15 else torch.int32
    sorted_T, perm_T = torch.sort(expert_T.to(narrow), stable=True)
    sorted_T = sorted_T.long()
    key_T = sorted_T * R + torch.div(perm_T, T // R, rounding_mode="floor")
    starts = torch.searchsorted(key_T, torch.arange((E + 1) * R + 1, device=device))
    counts_RE = (starts[1:] - starts[:-1]).view(E + 1, R)[:E].t().contiguous()
    occ_sorted = torch.arange(T, device=device) - starts[sorted_T * R]
    return counts_RE, torch.empty_like(occ_sorted).scatter_(0, perm_T, occ_sorted)


def route_tokens(plan: Plan, rank: int, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination rank and slot of every hit of one source rank, following the plan.

    Args:
        plan: the micro-batch's plan.
        rank: the source rank that owns ``topk_idx``.
        topk_idx: ``[s, K]`` int64 expert ids, -1 for "no selection" (padding).

    Returns:
        ``(dest_sK, slot_sK)``: int64 ``[s, K]``; the destination rank and the slot index on it, both -1
        where ``topk_idx`` is -1.
    """
    E = plan.num_experts
    flat = topk_idx.reshape(-1).long()
    valid = flat >= 0
    e = flat.clamp(min=0)
    j = plan.src_prefix_RE[rank, e] + occurrence_index(torch.where(valid, e, E), E)
    dest, slot = _place(plan, e, j)
    minus_one = torch.full_like(flat, -1)
    return torch.where(valid, dest, minus_one).view_as(topk_idx), torch.where(valid, slot, minus_one).view_as(topk_idx)


def route_received(plan: Plan, rank: int, expert_T: torch.Tensor, occ_T: torch.Tensor | None = None) -> torch.Tensor:
    """Slot on ``rank`` of every hit of every source rank (-1 where computed elsewhere or no hit).

    Every rank knows every rank's ``topk_idx`` (the layout exchange gathers them), so it can place the
    hits it computes without being told. Hits in flat ``(source rank, token, k)`` order are exactly an
    expert's slot order, so the occurrence index over all sources is the position inside the expert.

    Args:
        plan: the micro-batch's plan.
        rank: the destination rank.
        expert_T: ``[R*S*K]`` int64 expert id of each hit in ``(source, token, k)`` order; ``num_experts``
            where there is no hit.
        occ_T: `occurrence_index` of ``expert_T`` when already known.

    Returns:
        ``[R*S*K]`` int64 slot on ``rank``, or -1.
    """
    E = plan.num_experts
    valid = expert_T < E
    e = torch.where(valid, expert_T, 0)
    dest, slot = _place(plan, e, occurrence_index(expert_T, E) if occ_T is None else occ_T)
    return torch.where(valid & (dest == rank), slot, -1)


def _place(plan: Plan, e: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination rank, slot) of the ``j``-th slot of expert ``e`` (both ``[T]`` int64, ``e`` valid)."""
    P = plan.experts_per_rank
    home = torch.div(e, P, rounding_mode="floor")
    keep = plan.keep_E[e]
    in_home = j < keep
    q = plan.ovf_start_E[e] + (j - keep)
    spare_dest = torch.searchsorted(plan.spare_end_R, q, right=True).clamp(max=plan.num_ranks - 1)
    dest = torch.where(in_home, home, spare_dest)
    pos = torch.where(in_home, j, q - torch.maximum(plan.ovf_start_E[e], plan.spare_start_R[dest]))
    local = torch.where(dest == home, e - home * P, P + plan.redundant_idx_ER[e, dest])
    return dest, plan.local_offsets_RL[dest, local] + pos
