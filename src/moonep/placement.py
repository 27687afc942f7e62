"""History-aware expert placement (EPLB-style): replicate the hottest experts, pack copies onto ranks by load.

The per-micro-batch plan (`moonep.compute_plan`) balances each micro-batch by moving redundant experts'
weights every time. A `Placement`, recomputed every few hundred steps from the load history, lays out
*physical* experts so that the usual load is balanced already: hot logical experts get several physical
copies (within a replica-memory budget) and copies are packed onto ranks heaviest first. Routing is mapped
logical → physical with `Placement.map_routing` (a token's hit on a replicated expert goes to one of its
copies, spread round-robin), and a `moonep.Buffer` over ``num_physical`` experts serves it unchanged
(physical expert ``p`` lives on rank ``p // slots_per_rank``); the per-micro-batch plan then only fixes
what the history did not predict.

Shape suffixes: E logical experts, X physical experts (``R * slots_per_rank``), R ranks, s tokens, K top-k.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where each logical expert's physical copies live."""

    num_ranks: int
    slots_per_rank: int
    logical_of_X: torch.Tensor
    """``[X]`` int64 logical expert of each physical expert (rank ``x // slots_per_rank`` holds it)."""
    copies_E: torch.Tensor
    """``[E]`` int64 physical copies of each logical expert (>= 1)."""
    table_EM: torch.Tensor
    """``[E, M]`` int64 physical ids of each logical expert's copies, cycled to fill ``M = copies_E.max()``."""

    @property
    def num_physical(self) -> int:
        return self.logical_of_X.numel()

    @property
    def num_replicas(self) -> int:
        """Physical experts beyond one per logical expert."""
        return self.num_physical - self.copies_E.numel()

    def map_routing(self, topk_idx_sK: torch.Tensor) -> torch.Tensor:
        """Logical ``[s, K]`` expert ids (-1: none) → physical ids; copies taken round-robin over hits."""
        valid = topk_idx_sK >= 0
        ids = topk_idx_sK.clamp(min=0)
        order = torch.arange(ids.numel(), device=ids.device).view_as(ids)
        pick = order % self.copies_E.to(ids.device)[ids]
        physical = self.table_EM.to(ids.device)[ids, pick]
        return torch.where(valid, physical, topk_idx_sK)

    def rank_load(self, load_E: torch.Tensor) -> torch.Tensor:
        """``[R]`` expected load per rank when each expert's load is split evenly over its copies."""
        per_copy_X = load_E.double()[self.logical_of_X] / self.copies_E.double()[self.logical_of_X]
        return per_copy_X.view(self.num_ranks, self.slots_per_rank).sum(1)


def replica_budget(num_experts: int, num_ranks: int, slots_per_rank: int, expert_bytes: int, budget_bytes: int) -> int:
    """Replicas the layout needs (``R*slots - E``), checked against the replica memory budget.

    Raises:
        ValueError: fewer slots than experts, or the replicas' weights exceed ``budget_bytes``.
    """
    replicas = num_ranks * slots_per_rank - num_experts
    if replicas < 0:
        raise ValueError(f"slots_per_rank ({slots_per_rank}) x num_ranks ({num_ranks}) < num_experts ({num_experts})")
    if replicas * expert_bytes > budget_bytes:
        raise ValueError(
            f"{replicas} replicas x expert_bytes ({expert_bytes}) exceed budget_bytes ({budget_bytes}); "
            f"use slots_per_rank <= {(num_experts + budget_bytes // max(expert_bytes, 1)) // num_ranks}"
        )
    return replicas


def compute_placement(load_E: torch.Tensor, num_ranks: int, slots_per_rank: int) -> Placement:
    """Replicate and pack: every rank gets ``slots_per_rank`` physical experts.

    1. Replicas go one at a time to the expert with the largest load per copy.
    2. Copies, heaviest per-copy load first, go to the least-loaded rank with a free slot that does not hold
       that expert yet (if every rank with a free slot holds it, to the least-loaded of those).

    Args:
        load_E: ``[E]`` non-negative load history (e.g. an exponential average of hits per expert).
        num_ranks: ``R``.
        slots_per_rank: physical experts per rank (``>= E / R``; the excess are replicas).

    Returns:
        The `Placement`.
    """
    if load_E.dim() != 1 or bool((load_E < 0).any()):
        raise ValueError(f"load_E must be a 1-D non-negative tensor, got shape {tuple(load_E.shape)}")
    if num_ranks < 1 or slots_per_rank < 1:
        raise ValueError(f"num_ranks and slots_per_rank must be >= 1, got {num_ranks}, {slots_per_rank}")
    E = load_E.numel()
    replicas = num_ranks * slots_per_rank - E
    if replicas < 0:
        raise ValueError(f"slots_per_rank ({slots_per_rank}) x num_ranks ({num_ranks}) < num_experts ({E})")
    load = load_E.double().tolist()
    copies = [1] * E
    heap = [(-load[e], e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(replicas):
        _, e = heapq.heappop(heap)
        copies[e] += 1
        heapq.heappush(heap, (-load[e] / copies[e], e))
    items = sorted(((load[e] / copies[e], e) for e in range(E) for _ in range(copies[e])), key=lambda t: (-t[0], t[1]))
    rank_load, free = [0.0] * num_ranks, [slots_per_rank] * num_ranks
    held: list[set[int]] = [set() for _ in range(num_ranks)]
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    for share, e in items:
        open_ranks = [r for r in range(num_ranks) if free[r]]
        fresh = [r for r in open_ranks if e not in held[r]] or open_ranks
        r = min(fresh, key=lambda q: (rank_load[q], q))
        rank_load[r] += share
        free[r] -= 1
        held[r].add(e)
        slots[r].append(e)
    return placement_from_layout([e for rank_slots in slots for e in rank_slots], num_ranks, slots_per_rank)


def placement_from_layout(logical_of_X: list[int] | torch.Tensor, num_ranks: int, slots_per_rank: int) -> Placement:
    """The `Placement` of a given layout: ``logical_of_X[x]`` is the logical expert of physical expert ``x``.

    Raises:
        ValueError: the layout does not have ``num_ranks * slots_per_rank`` entries, or some expert
            ``0..max`` has no copy.
    """
    ids = [int(e) for e in (logical_of_X.tolist() if torch.is_tensor(logical_of_X) else logical_of_X)]
    if len(ids) != num_ranks * slots_per_rank:
        raise ValueError(f"logical_of_X has {len(ids)} entries, expected num_ranks * slots_per_rank = "
                         f"{num_ranks} * {slots_per_rank}")
    E = max(ids) + 1 if ids else 0
    table = [[] for _ in range(E)]
    for x, e in enumerate(ids):
        if e < 0:
            raise ValueError(f"logical_of_X holds a negative expert id {e}")
        table[e].append(x)
    if any(not copies for copies in table):
        raise ValueError(f"logical_of_X leaves experts {[e for e in range(E) if not table[e]]} without a copy")
    M = max(len(copies) for copies in table)
    return Placement(
        num_ranks=num_ranks,
        slots_per_rank=slots_per_rank,
        logical_of_X=torch.tensor(ids, dtype=torch.long),
        copies_E=torch.tensor([len(copies) for copies in table], dtype=torch.long),
        table_EM=torch.tensor([[copies[j % len(copies)] for j in range(M)] for copies in table], dtype=torch.long),
    )
