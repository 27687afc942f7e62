"""`PlacedMoELayer`: a `moonep.MoELayer` over *physical* experts laid out by a history-aware `Placement`.

The router scores ``E`` logical experts; each hit is mapped to one physical copy (`Placement.map_routing`)
and a `moonep.Buffer` over ``X = R * slots_per_rank`` physical experts dispatches it (physical expert ``x``
lives on rank ``x // slots_per_rank``). A replicated expert has one row per copy in ``w1_PFH``/``w2_PHF``;
the copies stay equal because `sync_replica_grads` gives every copy the sum of all copies' gradients (the
logical expert's gradient), so any deterministic optimizer applies the same update to each. `rebalance`
recomputes the placement from the load history and moves weights and optimizer state to their new slots
without stopping the job (`moonep.elastic.rows`).

Shape suffixes: E logical experts, X physical experts, P physical slots on this rank, H hidden, F width.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moonep.buffer import Buffer, PlannedDispatch
from moonep.elastic.rows import exchange_rows, holders_of, pack_rows, unpack_rows
from moonep.layer import MoELayer, MoEOutput, Router
from moonep.placement import Placement, compute_placement, replica_budget


class PlacedMoELayer(MoELayer):
    """`moonep.MoELayer` whose routed experts follow a `Placement` (replicas of hot experts, packed by load).

    Args:
        buffer: built over ``num_physical = R * slots_per_rank`` experts (its ``P`` is ``slots_per_rank``);
            ``balanced=False`` lets the placement alone balance the load (no per-step weight movement).
        intermediate: ``F``.
        num_experts: ``E`` logical experts (any number ``<= R * slots_per_rank``, no multiple of ``R`` needed).
        placement: the initial layout (default: `compute_placement` of a uniform load).
        history_decay: the load history ``load_E`` decays by this factor per training forward before the
            step's hits are added (an exponential average; identical on every rank, it counts the group's hits).
        replica_budget_bytes: if given, the replicas' weights over the group (``X - E`` experts) must fit in
            it (`moonep.placement.replica_budget`, ValueError otherwise).
        num_shared, route_scale, dtype: as `moonep.MoELayer`.
    """

    def __init__(
        self,
        buffer: Buffer,
        intermediate: int,
        num_experts: int,
        *,
        placement: Placement | None = None,
        history_decay: float = 0.9,
        replica_budget_bytes: int | None = None,
        num_shared: int = 2,
        route_scale: float = 1.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(num_experts, int) or not buffer.K <= num_experts <= buffer.E:
            raise ValueError(
                f"num_experts must be an int in [top_k={buffer.K}, num_physical={buffer.E}], got {num_experts!r}"
            )
        if not 0.0 <= history_decay < 1.0:
            raise ValueError(f"history_decay must be in [0, 1), got {history_decay}")
        super().__init__(buffer, intermediate, num_shared=num_shared, route_scale=route_scale, dtype=dtype)
        if replica_budget_bytes is not None:
            expert_bytes = sum(p[0].numel() * p.element_size() for p in (self.w1_PFH, self.w2_PHF))
            replica_budget(num_experts, buffer.num_ranks, buffer.P, expert_bytes, replica_budget_bytes)
        self.num_logical, self.history_decay = num_experts, history_decay
        self.router = Router(buffer.H, num_experts, buffer.K, route_scale).to(buffer.device)
        self.register_buffer("load_E", torch.zeros(num_experts, dtype=torch.float64, device=buffer.device))
        self.placement = placement or compute_placement(torch.ones(num_experts), buffer.num_ranks, buffer.P)
        self._check(self.placement)

    def _check(self, placement: Placement) -> None:
        if (placement.num_ranks, placement.slots_per_rank) != (self.buffer.num_ranks, self.buffer.P):
            raise ValueError(
                f"placement is for {placement.num_ranks} ranks x {placement.slots_per_rank} slots; the buffer has "
                f"{self.buffer.num_ranks} x {self.buffer.P}"
            )
        if placement.copies_E.numel() != self.num_logical:
            raise ValueError(f"placement has {placement.copies_E.numel()} logical experts, expected {self.num_logical}")

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.buffer.transport.group

    def logical_ids(self) -> list[int]:
        """Logical expert of each of this rank's ``P`` rows."""
        P, rank = self.buffer.P, self.buffer.rank
        return self.placement.logical_of_X[rank * P : rank * P + P].tolist()

    def logical_load(self, tokens_per_expert_X: torch.Tensor) -> torch.Tensor:
        """``[X]`` hits per physical expert → ``[E]`` float64 hits per logical expert."""
        load = torch.zeros(self.num_logical, dtype=torch.float64, device=tokens_per_expert_X.device)
        return load.index_add_(0, self.placement.logical_of_X.to(load.device), tokens_per_expert_X.double())

    def plan_ahead(self, x_sH: torch.Tensor) -> PlannedDispatch:
        """Route ``x_sH`` over logical experts, map each hit to a physical copy and plan the dispatch."""
        idx_sK, weights_sK = self.router(x_sH)
        return self.buffer.plan(self.placement.map_routing(idx_sK), weights_sK, async_finish=True)

    def forward(self, x_sH: torch.Tensor, planned: PlannedDispatch | None = None) -> MoEOutput:
        """As `moonep.MoELayer.forward`; ``tokens_per_expert_E`` is per *physical* expert (``[X]``).
        In training mode the load history is updated with the step's logical hits."""
        output = super().forward(x_sH, self.plan_ahead(x_sH) if planned is None else planned)
        if self.training:
            with torch.no_grad():
                self.load_E.mul_(self.history_decay).add_(self.logical_load(output.tokens_per_expert_E))
        return output

    @torch.no_grad()
    def sync_replica_grads(self) -> None:
        """Give every copy of a replicated expert the sum of its copies' gradients (collective, after backward).

        One all-reduce over the group of ``[replicated experts, *W]`` per expert weight; nothing when no expert
        has a second copy. Call it before the optimizer step, on every rank.
        """
        replicated = (self.placement.copies_E > 1).nonzero().flatten().tolist()
        if not replicated:
            return
        index = {e: i for i, e in enumerate(replicated)}
        local = [(p, index[e]) for p, e in enumerate(self.logical_ids()) if e in index]
        for param in (self.w1_PFH, self.w2_PHF):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            total = param.grad.new_zeros(len(replicated), *param.shape[1:])
            for p, i in local:
                total[i] += param.grad[p]
            dist.all_reduce(total, group=self.group)
            for p, i in local:
                param.grad[p] = total[i]

    @torch.no_grad()
    def rebalance(self, optimizer: torch.optim.Optimizer | None = None, placement: Placement | None = None) -> int:
        """Switch to ``placement`` (default: `compute_placement` of ``load_E``) in place (collective).

        Weights and the optimizer's per-row state of ``w1_PFH``/``w2_PHF`` (tensors shaped like the
        parameter: AdamW moments, momentum buffers) move to their new slots by point-to-point sends from a
        current holder of each expert; parameters keep their objects and shapes, so the optimizer goes on.

        Returns:
            The number of rows this rank received from other ranks.
        """
        new = placement or compute_placement(self.load_E.cpu(), self.buffer.num_ranks, self.buffer.P)
        self._check(new)
        params = [self.w1_PFH, self.w2_PHF]
        rows, keys = pack_rows(params, optimizer)
        holders = holders_of(self.placement.logical_of_X.tolist(), self.buffer.P, list(range(self.buffer.num_ranks)))
        moved, received, missing = exchange_rows(rows, holders, new.logical_of_X.tolist(), self.buffer.rank, self.group)
        if missing:
            raise RuntimeError(f"experts of slots {missing} have no holder; the old placement was not complete")
        unpack_rows(params, optimizer, moved, keys)
        self.placement = new
        return received
