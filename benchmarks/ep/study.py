"""Simulated planner study on the CPU: redundant experts per rank needed for exact balance at EP = 8/16/64.

Each rank's histogram is drawn as ``Multinomial(s*K, popularity)`` under each skew model of
`moonep.skew` (hits drawn with replacement: at E = 896, K = 16 this differs little from distinct top-k
draws, and it avoids materialising ``[R*s, E]`` Gumbel noise). The plan is computed by `compute_plan` on
the CPU and timed; its quality is reported against home-only placement.
"""

from __future__ import annotations

import torch

from benchmarks.harness import Row, time_fn
from moonep import compute_plan
from moonep.skew import expert_popularity

STUDY_SKEWS = ("uniform", "lognormal1", "lognormal2", "hot_rank", "one_expert")


def simulated_counts(skew: str, ranks: int, tokens: int, top_k: int, num_experts: int, seed: int = 0) -> torch.Tensor:
    """``[R, E]`` int64 hits per (rank, expert)."""
    pop = expert_popularity(skew, num_experts, ranks, seed)
    torch.manual_seed(seed)
    dist = torch.distributions.Multinomial(total_count=tokens * top_k, probs=pop)
    return dist.sample((ranks,)).long()


def planner_study(*, tokens: int, top_k: int, num_experts: int, ranks: tuple[int, ...] = (8, 16, 64)) -> list[Row]:
    rows = []
    for R in [r for r in ranks if num_experts % r == 0]:
        for skew in STUDY_SKEWS:
            counts = simulated_counts(skew, R, tokens, top_k, num_experts)
            plan = compute_plan(counts)
            stats = plan.stats()
            t = time_fn(lambda c=counts: compute_plan(c), warmup=1, rep=5)
            rows.append(
                Row(
                    case=f"study-EP{R}-{skew}",
                    baseline="home placement (no redundant experts)",
                    baseline_ms=None,
                    ours_ms=t.median_ms,
                    params={"R": R, "S": tokens, "K": top_k, "E": num_experts, "skew": skew},
                    extra={
                        "load max/mean": stats["max_over_mean"],
                        "unbal. max/mean": stats["unbalanced_max_over_mean"],
                        "redundant max": stats["max_redundant"],
                        "redundant mean": stats["mean_redundant"],
                        "moved fraction": stats["moved_fraction"],
                    },
                    note="CPU planner study; ours ms = compute_plan on the CPU; no baseline timing",
                )
            )
    return rows
