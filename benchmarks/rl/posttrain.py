"""SFT then GRPO on the seeded tool tasks, several seeds, on CPU: held-out success after SFT only and after
GRPO (greedy, and sampled with ``--eval-samples``), the scripted solver's ceiling, environment share of GRPO
iteration time, and a leak check. ``--tasks`` picks the family (`agentenv.posttrain.tasks.FAMILIES`).

    python -m benchmarks.rl.posttrain --seeds 3 --out /tmp/posttrain-runs
    python -m benchmarks.rl.posttrain --seeds 3 --jobs 3 --tasks chain --copy-head --sft-tasks 16 --sft-steps 60 \
        --train-tasks 2000 --grpo-iters 100 --grpo-epochs 2 --eval-tasks 64

Each seed runs on its own AgentEnv data directory (no lock or record scan shared with another seed), which is
checked after the run and removed: no record, mount, cgroup or tool-server process may be left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from agentenv.posttrain import ByteTokenizer, TrainConfig, WordTokenizer, run, tiny_model, write_view
from agentenv.posttrain.tasks import vocabulary
from agentenv.rl import LocalProvider
from benchmarks.harness import Row, write_results


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="posttrain-"))
    parser.add_argument("--tasks", choices=("code", "chain"), default="code",
                        help="task family (agentenv.posttrain.tasks.FAMILIES)")
    parser.add_argument("--train-tasks", type=int, default=64)
    parser.add_argument("--eval-tasks", type=int, default=32)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--tokenizer", choices=("word", "byte"), default="word")
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--sft-tasks", type=int, default=8)
    parser.add_argument("--grpo-iters", type=int, default=30)
    parser.add_argument("--groups-per-iter", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--grpo-lr", type=float, default=5e-4)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--grpo-epochs", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--copy-head", action=argparse.BooleanOptionalAction, default=False,
                        help="word-level policy with a pointer (copy) head (`PointerLM`)")
    parser.add_argument("--n-layer", type=int, default=2, help="word-level policy: GPT-2 layers")
    parser.add_argument("--n-embd", type=int, default=96, help="word-level policy: GPT-2 width")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=0,
                        help="also score the sampling policy on held-out tasks: samples per task")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once, each in its own process")
    parser.add_argument("--home-root", default=None,
                        help="where each seed's AgentEnv data directory goes (default: under --out)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            done = list(ex.map(_one_seed, [vars(args)] * len(seeds), seeds))
    else:
        done = [_one_seed(vars(args), seed) for seed in seeds]
    rows, results = [], []
    for seed, (res, params, leftover) in zip(seeds, done):
        leftover = leftover if any(leftover.values()) else []
        results.append(res | {"leftover_sandboxes": leftover})
        rows.append(Row(case=f"seed{seed}", baseline="SFT only (held-out success)", baseline_ms=None,
                        ours_ms=res["seconds"] * 1e3, params=params, extra=res | {"leftover_sandboxes": leftover},
                        note="ours_ms: wall time of the seed's whole SFT + GRPO run"))
    gain = [r["grpo"] - r["sft"] for r in results]
    summary = {"sft_mean": statistics.mean(r["sft"] for r in results),
               "grpo_mean": statistics.mean(r["grpo"] for r in results),
               "gain_mean": statistics.mean(gain), "gain_min": min(gain), "gain_max": max(gain),
               "gain_stdev": statistics.stdev(gain) if len(gain) > 1 else 0.0,
               "solver_mean": statistics.mean(r["solver"] for r in results),
               "env_share_mean": statistics.mean(r["env_share"] for r in results),
               "max_seed_s": max(r["seconds"] for r in results), "total_s": time.perf_counter() - t0,
               "seed_minutes": [r["seconds"] / 60 for r in results],
               "leftover_sandboxes": [r["leftover_sandboxes"] for r in results if r["leftover_sandboxes"]],
               "jobs": args.jobs, "load_before": load_before, "load_after": os.getloadavg()}
    if all("sft_sampled" in r for r in results):
        sampled = [r["grpo_sampled"] - r["sft_sampled"] for r in results]
        summary |= {"sft_sampled_mean": statistics.mean(r["sft_sampled"] for r in results),
                    "grpo_sampled_mean": statistics.mean(r["grpo_sampled"] for r in results),
                    "gain_sampled_mean": statistics.mean(sampled), "gain_sampled_min": min(sampled),
                    "gain_sampled_max": max(sampled),
                    "gain_sampled_stdev": statistics.stdev(sampled) if len(sampled) > 1 else 0.0}
    print(json.dumps(summary), flush=True)
    rows.append(Row(case="mean", baseline="SFT only", baseline_ms=None, ours_ms=summary["total_s"] * 1e3,
                    extra=summary, note=f"CPU, torch threads={args.threads} per seed, {args.jobs} seed(s) at once"))
    with tempfile.TemporaryDirectory() as scratch:
        return write_results("posttrain", rows, markdown=Path(scratch) / "BENCH.md")


def leftovers(home: str) -> dict[str, list]:
    """What the AgentEnv data directory `home` left on the host: records, mounts, cgroups, processes."""
    from agentenv.runtime import cgroups

    records = sorted(p.name for p in (Path(home) / "sandboxes").glob("*.json"))
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(home.rstrip("/") + "/")]
    groups = cgroups.leftover_groups(cgroups.group_for(home))
    group_dirs = [str(cgroups.CGROUP_ROOT / c / cgroups.group_for(home)) for c in cgroups.CONTROLLERS
                  if (cgroups.CGROUP_ROOT / c / cgroups.group_for(home)).exists()]
    procs = sorted({int(pid) for d in group_dirs for f in Path(d).rglob("cgroup.procs")
                    for pid in f.read_text().split()})
    return {"records": records, "mounts": mounts, "cgroups": sorted(n for v in groups.values() for n in v) + group_dirs,
            "processes": procs}


def _one_seed(args: dict, seed: int) -> tuple[dict, dict, dict]:
    """One seed's SFT + GRPO run with its own sandbox provider and data directory; returns (result, config,
    what was left on the host after the provider closed)."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args["threads"])
    cfg = TrainConfig(seed=seed, sft_steps=args["sft_steps"], sft_tasks=args["sft_tasks"],
                      grpo_iters=args["grpo_iters"], groups_per_iter=args["groups_per_iter"],
                      group_size=args["group_size"], grpo_lr=args["grpo_lr"], beta=args["beta"],
                      grpo_epochs=args["grpo_epochs"], temperature=args["temperature"],
                      eval_samples=args["eval_samples"], task_family=args["tasks"], train_tasks=args["train_tasks"],
                      eval_tasks=args["eval_tasks"], sft_lr=args["sft_lr"])
    run_dir = Path(args["out"]) / f"seed{seed}"
    home = os.path.join(args["home_root"] or os.path.join(args["out"], "homes"), f"seed{seed}")
    if args["tokenizer"] == "word":
        cfg.max_action_tokens = 8
        tok = WordTokenizer(vocabulary(args["tasks"]))
        model = tiny_model(tok.vocab_size, seed=seed, n_positions=256, eos_token_id=tok.eos_token_id,
                           copy_head=args["copy_head"], n_layer=args["n_layer"], n_embd=args["n_embd"])
    else:
        tok, model = ByteTokenizer(), tiny_model(seed=seed)
    with LocalProvider(home=home) as provider:
        res = asyncio.run(run(run_dir, provider, model, tok, cfg))
        alive = [i.id for i in provider.backend.list() if i.kind == "sandbox" and i.alive]
    leftover = leftovers(home) | {"sandboxes_at_end": alive}
    if not any(leftover.values()):
        shutil.rmtree(home, ignore_errors=True)
    write_view(run_dir)
    print(json.dumps({"seed": seed, **res}), flush=True)
    return res, vars(cfg) | {"run_dir": str(run_dir), "tokenizer": args["tokenizer"], "copy_head": args["copy_head"],
                             "n_layer": args["n_layer"], "n_embd": args["n_embd"]}, leftover


if __name__ == "__main__":
    print(main())
