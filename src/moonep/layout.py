"""The layout exchange: one all-gather of every rank's routing, from which every rank plans and places.

Shape suffixes used in this module:
    R  ranks      S  max tokens per rank     s  tokens this call (<= S)      K  top-k      E  routed experts
    T  hits of all ranks (``R*S*K``, flat in (source rank, token, k) order)   C  slots this rank computes

Each rank sends one int32 row ``[status, topk_idx (S*K, -1 padded), topk_weights' fp32 bits (S*K, 0
padded)]``. From the gathered ``[R, 1 + 2*S*K]`` every rank computes the expert histogram of every source,
the same `Plan`, and, for the hits it computes itself, their slots and gate weights: no second exchange
of per-hit metadata is needed, so the token rows can start moving right after this one small collective.

Two equivalent paths compute them (`Layout`'s ``planner``): torch ops (`counts_and_occurrence`,
`compute_plan`, `route_received`; on CUDA ~115 launches) and `moonep.fused_plan` (one sort and five Triton
kernels, ~16 launches: 0.24 → 0.08 ms at S=4096, E=896, K=16, EP=2 on an H200).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moonep.plan import Plan, compute_plan, counts_and_occurrence, route_received

if TYPE_CHECKING:  # triton is imported only on the fused path
    from moonep.fused_plan import SortedHits

STATUS_OK, STATUS_TOO_MANY, STATUS_SHAPE, STATUS_DTYPE, STATUS_IDS, STATUS_PLAN = 0, 1, 2, 3, 4, 5
STATUS_TEXT = {
    STATUS_PLAN: "passed topk_idx/topk_weights other than the tensors its plan was made from (Buffer.plan)",
    STATUS_TOO_MANY: "passed more tokens than max_tokens_per_rank",
    STATUS_SHAPE: "passed x/topk_idx/topk_weights with wrong shapes",
    STATUS_DTYPE: "passed tensors of the wrong dtype or device",
    STATUS_IDS: "passed expert ids outside [-1, num_experts)",
}
DUPLICATE_TEXT = "passed topk_idx with the same expert twice within one token (each token's ids must be distinct)"


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """Everything combine (and the backward passes) need; produced by `Buffer.dispatch`, never edited."""

    plan: Plan
    rank: int
    num_tokens: int
    """``s``: tokens this rank dispatched."""
    slot_src_C: torch.Tensor
    """``[C]`` int64 received-row index (``src*S + t``) of each slot; ``R*S`` (a zero row) if unused."""
    recv_slots_TK: torch.Tensor
    """``[R*S, K]`` int64 slot on this rank of each received (src, token, k); -1 if computed elsewhere."""
    weights_C: torch.Tensor
    """``[C]`` fp32 gate weight per slot (0 if unused); differentiable w.r.t. ``topk_weights``."""
    local_counts_L: torch.Tensor
    """``[L]`` int64 slots per local expert on this rank (home experts, then redundant table entries)."""


def layout_row(topk_idx: torch.Tensor, topk_weights: torch.Tensor, S: int, E: int) -> torch.Tensor:
    """``[1 + 2*S*K]`` int32 row of a rank whose input passed the local checks (status OK).

    Ids are clamped to ``[-2, E]`` first so that int32 keeps out-of-range ids out of range.
    """
    K = topk_idx.shape[1]
    idx = topk_idx.reshape(-1).clamp(-2, E).to(torch.int32)
    w = topk_weights.detach().reshape(-1).to(torch.float32).view(torch.int32)
    pad = S * K - idx.numel()
    status_1 = idx.new_full((1,), STATUS_OK)
    return torch.cat([status_1, idx, idx.new_full((pad,), -1), w, w.new_zeros(pad)])


def empty_row(status: int, S: int, K: int, device: torch.device) -> torch.Tensor:
    """The row of a rank whose input was rejected: its status, no hits."""
    row = torch.full((1 + 2 * S * K,), -1, dtype=torch.int32, device=device)
    row[0] = status
    row[1 + S * K :] = 0
    return row


def problems(gathered_RX: torch.Tensor, S: int, K: int, E: int) -> list[str]:
    """What each rank did wrong, from the gathered rows (one host synchronisation); empty if nothing."""
    idx_RT = gathered_RX[:, 1 : 1 + S * K]
    bad_R = ((idx_RT < -1) | (idx_RT >= E)).any(1)
    sorted_RSK = idx_RT.view(-1, S, K).sort(dim=2).values
    dup_R = ((sorted_RSK[:, :, 1:] == sorted_RSK[:, :, :-1]) & (sorted_RSK[:, :, 1:] >= 0)).flatten(1).any(1)
    flags = torch.stack([gathered_RX[:, 0].long(), bad_R.long(), dup_R.long()], 1).cpu().tolist()
    found = []
    for r, (code, bad, dup) in enumerate(flags):
        if code:
            found.append(f"rank {r} {STATUS_TEXT[code]}")
        elif bad:
            found.append(f"rank {r} {STATUS_TEXT[STATUS_IDS]}")
        elif dup:
            found.append(f"rank {r} {DUPLICATE_TEXT}")
    return found


@dataclass(frozen=True)
class FlatHits:
    """Every hit in flat (source rank, token, k) order, as the torch path leaves them for `Layout.handle`."""

    expert_T: torch.Tensor
    """``[T]`` int64 expert id (``E``: no hit)."""
    weight_T: torch.Tensor
    """``[T]`` fp32 gate weight."""
    occ_T: torch.Tensor
    """``[T]`` int64 position among the hits of the same expert (flat order)."""


PLANNERS = ("auto", "fused", "torch")


class Layout:
    """Turns the gathered rows into the plan and this rank's handle (static shapes, no host sync).

    Args:
        R, S, K, E: ranks, max tokens per rank, top-k, routed experts.
        rank: this rank.
        capacity: ``C``, slot rows of this rank.
        balanced: as in `compute_plan`.
        device: where the gathered rows live.
        planner: ``"fused"``: `moonep.fused_plan` (a sort and four Triton kernels; on CPU tensors only under
            ``TRITON_INTERPRET=1``); ``"torch"``: `counts_and_occurrence` + `compute_plan` (torch ops) and,
            on CUDA, `moonep.kernels.place_hits_triton`; ``"auto"``: fused on CUDA where
            `moonep.fused_plan.fits`, else torch. Both give the same plan and handle.
    """

    def __init__(
        self,
        R: int,
        S: int,
        K: int,
        E: int,
        rank: int,
        capacity: int,
        balanced: bool,
        device: torch.device,
        planner: str = "auto",
    ) -> None:
        if planner not in PLANNERS:
            raise ValueError(f"planner must be one of {PLANNERS}, got {planner!r}")
        self.R, self.S, self.K, self.E, self.rank, self.C, self.balanced = R, S, K, E, rank, capacity, balanced
        self.rows_T = torch.arange(R * S, device=device).repeat_interleave(K)
        if planner == "auto":
            fused = False
            if torch.device(device).type == "cuda":
                from moonep.fused_plan import fits

                fused = fits(R, E, R * S * K)
            planner = "fused" if fused else "torch"
        # No hits at all (S = 0): nothing for the kernels to do; the torch path handles the empty shapes.
        self.planner = planner if R * S * K else "torch"

    def row(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's layout row (`layout_row`; one kernel on the fused path)."""
        if self.planner == "fused" and topk_idx.numel():
            from moonep.fused_plan import layout_row as fused_layout_row

            return fused_layout_row(topk_idx, topk_weights, self.S, self.E)
        return layout_row(topk_idx, topk_weights, self.S, self.E)

    def plan(self, gathered_RX: torch.Tensor) -> tuple[Plan, FlatHits | SortedHits]:
        """``(plan, hits)``: the plan, and every hit's expert, weight and order for `handle`."""
        S, K, E = self.S, self.K, self.E
        if self.planner == "fused":
            from moonep.fused_plan import plan_sorted

            return plan_sorted(gathered_RX, S, K, E, balanced=self.balanced)
        idx_T = gathered_RX[:, 1 : 1 + S * K].reshape(-1).long()
        weight_T = gathered_RX[:, 1 + S * K :].contiguous().view(torch.float32).reshape(-1)
        expert_T = torch.where((idx_T >= 0) & (idx_T < E), idx_T, E)
        counts_RE, occ_T = counts_and_occurrence(expert_T, self.R, E)
        return compute_plan(counts_RE, balanced=self.balanced), FlatHits(expert_T, weight_T, occ_T)

    def handle(self, plan: Plan, hits: FlatHits | SortedHits, num_tokens: int) -> DispatchHandle:
        """This rank's `DispatchHandle`: the slot of each hit it computes, each slot's source row and weight."""
        R, S, K, C = self.R, self.S, self.K, self.C
        if not isinstance(hits, FlatHits):
            from moonep.fused_plan import place_sorted

            recv_T, slot_src_C, weights_C = place_sorted(plan, hits, self.rank, S, K, C)
        elif hits.expert_T.is_cuda:
            from moonep.kernels import place_hits_triton

            recv_T, slot_src_C, weights_C = place_hits_triton(
                plan, self.rank, hits.expert_T, hits.occ_T, hits.weight_T, C, K
            )
        else:
            recv_T = route_received(plan, self.rank, hits.expert_T, hits.occ_T)
            valid = recv_T >= 0
            target = torch.where(valid, recv_T, C)
            slot_src = torch.full((C + 1,), R * S, dtype=torch.long, device=recv_T.device)
            slot_src_C = slot_src.scatter_(0, target, self.rows_T)[:C]
            weights = torch.zeros(C + 1, dtype=torch.float32, device=recv_T.device)
            weights_C = weights.scatter_(0, target, torch.where(valid, hits.weight_T, 0.0))[:C]
        return DispatchHandle(
            plan=plan,
            rank=self.rank,
            num_tokens=num_tokens,
            slot_src_C=slot_src_C,
            recv_slots_TK=recv_T.view(R * S, K),
            weights_C=weights_C,
            local_counts_L=plan.local_counts_RL[self.rank],
        )
