"""SFT then GRPO on the seeded code-word tasks, several seeds, on CPU: held-out success after SFT only and
after GRPO, the scripted solver's ceiling, environment share of GRPO iteration time, and a leak check.

    python -m benchmarks.rl.posttrain --seeds 3 --out /tmp/posttrain-runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from agentenv.posttrain import ByteTokenizer, TrainConfig, run, tiny_model, write_view
from agentenv.rl import LocalProvider
from benchmarks.harness import Row, write_results


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="posttrain-"))
    parser.add_argument("--sft-steps", type=int, default=80)
    parser.add_argument("--sft-tasks", type=int, default=8)
    parser.add_argument("--grpo-iters", type=int, default=25)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    rows, results = [], []
    t0 = time.perf_counter()
    with LocalProvider() as provider:
        for seed in range(args.seeds):
            cfg = TrainConfig(seed=seed, sft_steps=args.sft_steps, sft_tasks=args.sft_tasks, grpo_iters=args.grpo_iters,
                              temperature=args.temperature)
            run_dir = Path(args.out) / f"seed{seed}"
            res = asyncio.run(run(run_dir, provider, tiny_model(seed=seed), ByteTokenizer(), cfg))
            write_view(run_dir)
            results.append(res)
            print(json.dumps({"seed": seed, **res}), flush=True)
            rows.append(Row(case=f"seed{seed}", baseline="SFT only (held-out success)", baseline_ms=None,
                            ours_ms=res["seconds"] * 1e3, params=vars(cfg) | {"run_dir": str(run_dir)},
                            extra=res, note="ours_ms: wall time of the seed's whole SFT + GRPO run"))
        leftover = [i.id for i in provider.backend.list() if i.kind == "sandbox" and i.alive] \
            if hasattr(provider, "backend") else None
    gain = [r["grpo"] - r["sft"] for r in results]
    summary = {"sft_mean": statistics.mean(r["sft"] for r in results),
               "grpo_mean": statistics.mean(r["grpo"] for r in results),
               "gain_mean": statistics.mean(gain), "gain_min": min(gain), "gain_max": max(gain),
               "solver_mean": statistics.mean(r["solver"] for r in results),
               "env_share_mean": statistics.mean(r["env_share"] for r in results),
               "total_s": time.perf_counter() - t0, "leftover_sandboxes": leftover}
    print(json.dumps(summary), flush=True)
    rows.append(Row(case="mean", baseline="SFT only", baseline_ms=None, ours_ms=summary["total_s"] * 1e3,
                    extra=summary, note=f"CPU, torch threads={args.threads}"))
    with tempfile.TemporaryDirectory() as scratch:
        return write_results("posttrain", rows, markdown=Path(scratch) / "BENCH.md")


if __name__ == "__main__":
    print(main())
