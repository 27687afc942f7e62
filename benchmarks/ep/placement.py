"""Placement report: max/mean expert-rank load under Zipf(1.2) router drift, history-aware placement
(`moonep.placement`, recomputed every N steps from an exponential load average) against the per-micro-batch
plan alone (`moonep.compute_plan` on home placement), on the CPU, no communication.

Each step draws ``tokens`` tokens per rank, each picking ``top_k`` distinct experts from a Zipf(1.2)
popularity whose expert order drifts (a few random swaps of neighbours in the popularity order per step).
Columns per case: home placement alone (no movement), placement alone (static copies, no per-step
movement), the plan alone and placement + plan (max/mean of slots per rank and redundant experts whose
weights the plan moves per rank per step), and the replica memory against the budget.

Usage: python -m benchmarks.ep.placement [--steps 200] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import Row, machine_info, write_results
from moonep import compute_plan
from moonep.placement import compute_placement, replica_budget

ZIPF_S = 1.2


def popularity(order_E: torch.Tensor) -> torch.Tensor:
    """Zipf(1.2) probabilities, the ``i``-th most popular expert being ``order_E[i]``."""
    p = 1.0 / torch.arange(1, order_E.numel() + 1, dtype=torch.float64) ** ZIPF_S
    out = torch.empty_like(p)
    out[order_E] = p / p.sum()
    return out


def counts(idx_sK: torch.Tensor, num_ranks: int, num_experts: int) -> torch.Tensor:
    """``[R, X]`` hits per (source rank, expert); tokens are split evenly over source ranks in order."""
    src = torch.arange(idx_sK.shape[0]).repeat_interleave(idx_sK.shape[1]) * num_ranks // idx_sK.shape[0]
    flat = src * num_experts + idx_sK.reshape(-1)
    return torch.bincount(flat, minlength=num_ranks * num_experts).view(num_ranks, num_experts)


def run_case(E: int, R: int, K: int, tokens: int, extra: int, steps: int, every: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(E, generator=gen)
    slots = E // R + extra
    H, Fi = 2048, 1024
    expert_bytes = 3 * H * Fi * 2  # three bf16 matrices per SwiGLU expert
    budget = R * extra * expert_bytes  # the configured replica budget: `extra` expert copies per rank
    replicas = replica_budget(E, R, slots, expert_bytes, budget)
    history = torch.full((E,), float(tokens * R * K) / E, dtype=torch.float64)
    placement = compute_placement(history, R, slots)
    sums = dict.fromkeys(("home", "placed", "plan", "placed_plan", "plan_moved", "placed_plan_moved"), 0.0)
    plan_s = placed_s = 0.0
    for step in range(steps):
        for _ in range(max(1, E // 32)):
            i = int(torch.randint(0, E - 1, (1,), generator=gen))
            order[[i, i + 1]] = order[[i + 1, i]]
        idx = torch.multinomial(popularity(order).expand(tokens * R, E), K, replacement=False, generator=gen)
        t0 = time.perf_counter()
        plan = compute_plan(counts(idx, R, E)).stats()
        plan_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if step and step % every == 0:
            placement = compute_placement(history, R, slots)
        placed = compute_plan(counts(placement.map_routing(idx), R, placement.num_physical)).stats()
        placed_s += time.perf_counter() - t0
        history = 0.9 * history + 0.1 * torch.bincount(idx.reshape(-1), minlength=E).double()
        sums["home"] += plan["unbalanced_max_over_mean"]
        sums["plan"] += plan["max_over_mean"]
        sums["plan_moved"] += plan["mean_redundant"]
        sums["placed"] += placed["unbalanced_max_over_mean"]
        sums["placed_plan"] += placed["max_over_mean"]
        sums["placed_plan_moved"] += placed["mean_redundant"]
    means = {k: round(v / steps, 4) for k, v in sums.items()}
    return {
        "mean_over_steps": means,
        "replicas": replicas,
        "replica_bytes_per_rank": extra * expert_bytes,
        "replica_bytes": replicas * expert_bytes,
        "budget_bytes": budget,
        "plan_ms_per_step": 1e3 * plan_s / steps,
        "placed_ms_per_step": 1e3 * placed_s / steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="steps between placement updates")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for E, R, K, tokens, extra in ((64, 8, 6, 512, 2), (256, 16, 8, 256, 2), (896, 32, 16, 128, 4)):
        result = run_case(E, R, K, tokens, extra, args.steps, args.every, seed=E)
        m = result["mean_over_steps"]
        print(
            f"E{E}-R{R}-K{K}: home {m['home']:.3f}  placement {m['placed']:.3f}  plan {m['plan']:.3f} "
            f"(moves {m['plan_moved']:.2f}/rank)  placement+plan {m['placed_plan']:.3f} "
            f"(moves {m['placed_plan_moved']:.2f}/rank)  replicas {result['replica_bytes']}/{result['budget_bytes']} B"
        )
        assert result["replica_bytes"] <= result["budget_bytes"]
        rows.append(
            Row(
                f"E{E}-R{R}-K{K}-zipf{ZIPF_S}",
                "per-micro-batch plan alone (home placement), host time per step",
                result["plan_ms_per_step"],
                result["placed_ms_per_step"],
                {"E": E, "R": R, "K": K, "tokens_per_rank": tokens, "replica_slots_per_rank": extra,
                 "steps": args.steps, "placement_every": args.every},
                result,
                "max/mean of slots per rank averaged over steps; times include the mapping (CPU, torch ops)",
            )
        )  # fmt: skip
    if not args.no_write:
        # JSON only: BENCHMARKS.md tables are not rewritten from here.
        with tempfile.TemporaryDirectory() as tmp:
            path = write_results("ep-placement", rows, markdown=Path(tmp) / "unused.md", info=machine_info())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
