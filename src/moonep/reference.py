"""Pure-Python/torch single-process references: the planner with loops, dispatch/combine, and the MoE math.

Shape suffixes: R ranks, E experts, P experts per rank, S tokens, K top-k, H hidden, F expert width.

These are oracles for tests and the benchmark's correctness gate; they favour obviousness over speed.
"""

from __future__ import annotations

import torch


def reference_plan(counts_RE: torch.Tensor, *, balanced: bool = True) -> dict[str, torch.Tensor]:
    """The planner of `moonep.plan.compute_plan`, written with explicit loops over ranks and experts.

    Args:
        counts_RE: ``[R, E]`` hits per (source rank, expert).
        balanced: as in `compute_plan`.

    Returns:
        ``assign_ER``, ``local_counts_RL``, ``redundant_ids_RN``, ``load_R`` as CPU int64 tensors.
    """
    counts = [[int(v) for v in row] for row in counts_RE.tolist()]
    R, E = len(counts), len(counts[0])
    P, N = E // R, E - E // R
    load = [sum(counts[r][e] for r in range(R)) for e in range(E)]
    total = sum(load)
    rank_load = [sum(load[h * P : (h + 1) * P]) for h in range(R)]
    target = [total // R + (1 if r < total % R else 0) for r in range(R)] if balanced else rank_load[:]
    assign = [[0] * R for _ in range(E)]
    overflow: list[tuple[int, int]] = []  # (expert, slots) in overflow-line order
    for h in range(R):
        placed = 0
        for e in sorted(range(h * P, (h + 1) * P), key=lambda e: (load[e], e)):
            keep = max(0, min(load[e], target[h] - placed))
            assign[e][h] = keep
            if load[e] > keep:
                overflow.append((e, load[e] - keep))
            placed += load[e]
    spare = [max(0, target[r] - rank_load[r]) for r in range(R)]
    r = 0
    for e, amount in overflow:
        while amount > 0:
            while spare[r] == 0:
                r += 1
            take = min(amount, spare[r])
            assign[e][r] += take
            spare[r] -= take
            amount -= take
    redundant_ids = [[-1] * N for _ in range(R)]
    local_counts = [[0] * (P + N) for _ in range(R)]
    for r in range(R):
        n = 0
        for e in range(E):
            if e // P == r:
                local_counts[r][e - r * P] = assign[e][r]
            elif assign[e][r] > 0:
                redundant_ids[r][n] = e
                local_counts[r][P + n] = assign[e][r]
                n += 1
    return {
        "assign_ER": torch.tensor(assign, dtype=torch.long).view(E, R),
        "local_counts_RL": torch.tensor(local_counts, dtype=torch.long).view(R, P + N),
        "redundant_ids_RN": torch.tensor(redundant_ids, dtype=torch.long).view(R, N),
        "load_R": torch.tensor([sum(assign[e][r] for e in range(E)) for r in range(R)], dtype=torch.long),
    }


def reference_dispatch(
    topk_idx_per_rank: list[torch.Tensor], plan: dict[str, torch.Tensor]
) -> list[list[tuple[int, int, int]]]:
    """Which (source rank, token, k) each slot of each rank holds, from a `reference_plan`.

    Slots of expert ``e`` are taken in (source rank, token, k) order; the first ``assign[e][home]`` go
    home, the rest to the redundant holders in the planner's overflow order (ascending rank).

    Returns:
        Per destination rank, a list indexed by slot of ``(src, token, k)``; ``(-1, -1, -1)`` for unused.
    """
    assign, local_counts = plan["assign_ER"].tolist(), plan["local_counts_RL"].tolist()
    redundant_ids = plan["redundant_ids_RN"].tolist()
    R, E = len(topk_idx_per_rank), len(assign)
    P = E // R
    offsets = [[sum(row[:i]) for i in range(len(row))] for row in local_counts]
    hits: list[list[tuple[int, int, int]]] = [[] for _ in range(E)]
    for src, idx in enumerate(topk_idx_per_rank):
        for t, row in enumerate(idx.tolist()):
            for k, e in enumerate(row):
                if e >= 0:
                    hits[e].append((src, t, k))
    capacity = max([sum(row) for row in local_counts] + [0])
    out = [[(-1, -1, -1)] * capacity for _ in range(R)]
    for e in range(E):
        home = e // P
        order = [home] + [r for r in range(R) if r != home]
        j = 0
        for r in order:
            local = e - home * P if r == home else P + redundant_ids[r].index(e) if assign[e][r] else None
            for pos in range(assign[e][r]):
                out[r][offsets[r][local] + pos] = hits[e][j]
                j += 1
    return out


def reference_moe(
    x_SH: torch.Tensor,
    topk_idx_SK: torch.Tensor,
    topk_weights_SK: torch.Tensor,
    w1_EFH: torch.Tensor,
    w2_EHF: torch.Tensor,
) -> torch.Tensor:
    """Routed-expert output ``sum_k w_k * expert_{idx_k}(x)`` with SiLU-MLP experts, token by token.

    Args:
        x_SH: ``[S, H]`` tokens.
        topk_idx_SK: ``[S, K]`` int64 expert ids, -1 for no selection.
        topk_weights_SK: ``[S, K]`` gate weights.
        w1_EFH: ``[E, F, H]`` up projections.
        w2_EHF: ``[E, H, F]`` down projections.

    Returns:
        ``[S, H]`` in ``x_SH``'s dtype (accumulated in fp32).
    """
    out = torch.zeros(x_SH.shape, dtype=torch.float32, device=x_SH.device)
    for k in range(topk_idx_SK.shape[1]):
        idx = topk_idx_SK[:, k]
        for e in idx.unique().tolist():
            if e < 0:
                continue
            rows = (idx == e).nonzero().squeeze(1)
            h = torch.nn.functional.silu(x_SH[rows] @ w1_EFH[e].t()) @ w2_EHF[e].t()
            out = out.index_add(0, rows, h.float() * topk_weights_SK[rows, k, None].float())
    return out.to(x_SH.dtype)
