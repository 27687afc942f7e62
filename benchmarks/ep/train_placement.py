"""`k3infra train --ep R --rebalance-every N` against the same run whose experts stay at home (gloo, local CPU).

Both runs train k3-debug from the same seed on the same data with ``R`` processes (EP = R, FSDP2 over all); the
home run has the placement callback in measuring mode (``rebalance_every = steps``: it never moves an expert but
records the real max/mean routed tokens per EP rank of each step). Reports both loss curves and the max/mean load
per EP rank, mean over the steps after the first rebalance.

Usage: python -m benchmarks.ep.train_placement [--ranks 4] [--steps 40] [--every 5] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def _rank(rank: int, world: int, port: int, cfg_kwargs: dict, result_file: str) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    from k3infra.train import TrainConfig, train

    result = train(TrainConfig(**cfg_kwargs))
    if rank == 0:
        Path(result_file).write_text(json.dumps(result.history))


def run(world: int, cfg_kwargs: dict, result_file: Path) -> list[dict]:
    """`k3infra.train.train` on ``world`` spawned gloo processes; rank 0's history."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(world, port, cfg_kwargs, str(result_file)), nprocs=world, join=True)
    return json.loads(result_file.read_text())


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness import Row, machine_info, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="steps between placement updates")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    out: dict[str, list[dict]] = {}
    walls = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = dict(preset="k3-debug", steps=args.steps, seq_len=64, batch_size=8, lr=2e-2, optimizer=args.optimizer,
                    ep=args.ranks, max_corpus_bytes=MiB, cache_dir=str(Path(tmp) / "cache"), progress=False,
                    tensorboard=False, plot=False)
        for mode, every in (("home", args.steps), ("rebalanced", args.every)):
            t0 = time.perf_counter()
            out[mode] = run(args.ranks, {**base, "out": str(Path(tmp) / mode), "rebalance_every": every},
                            Path(tmp) / f"{mode}.json")
            walls[mode] = time.perf_counter() - t0
    home, placed = out["home"], out["rebalanced"]
    after = slice(args.every, None)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    moves = [h["rebalance"] for h in placed if "rebalance" in h]
    summary = {
        "home_max_over_mean": mean([h["ep_max_over_mean"] for h in home][after]),
        "rebalanced_max_over_mean": mean([h["ep_max_over_mean"] for h in placed][after]),
        "max_abs_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in zip(home, placed, strict=True)),
        "final_loss_home": home[-1]["loss"],
        "final_loss_rebalanced": placed[-1]["loss"],
        "rebalances": len(moves),
        "rows_moved_total": sum(m["rows_moved"] for m in moves),
        "rebalance_s_rank0_total": sum(m["seconds"] for m in moves),
        "step_s_mean_home": mean([8 * 64 / h["tokens_per_s"] for h in home]),
        "step_s_mean_rebalanced": mean([8 * 64 / h["tokens_per_s"] for h in placed]),
        "wall_s": walls,
    }
    print(json.dumps(summary, indent=1))
    if not args.no_write:
        row = Row(
            f"k3-debug-train-ep{args.ranks}-every{args.every}-{args.optimizer}",
            "experts at home (max/mean routed tokens per EP rank, mean over steps after the first rebalance)",
            summary["home_max_over_mean"],
            summary["rebalanced_max_over_mean"],
            {"ranks": args.ranks, "steps": args.steps, "every": args.every, "optimizer": args.optimizer,
             "seq_len": 64, "batch_size": 8},
            {**summary, "home": home, "rebalanced": placed},
            "gloo on local CPU processes; the numbers are max/mean ratios, not times",
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = write_results("ep-train-placement", [row], markdown=Path(tmp) / "unused.md", info=machine_info())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
