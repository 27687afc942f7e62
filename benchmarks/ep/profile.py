"""Where the time of one MoonEP dispatch+combine goes: GPU kernel times on 2 GPUs (NCCL), rank 0's view.

Usage (device machine): python -m benchmarks.ep.profile [--tokens 4096] [--hidden 7168] [--skew uniform]
    [--combine-path remote_only] [--preplanned]
Prints the kernels sorted by total CUDA time over ``--steps`` eager steps (after warm-up). ``--preplanned``:
the plan is made once by `Buffer.plan` before the profiled steps, which then run ``dispatch(plan=...)``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moonep import Buffer
from moonep.skew import make_routing


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120), device_id=torch.device(device)
    )
    try:
        S, H, K, E = args.tokens, args.hidden, args.topk, args.experts
        idx, w = (t.to(device) for t in make_routing(args.skew, S, K, E, world, rank=rank, seed=1))
        x = torch.randn(S, H, device=device).to(torch.bfloat16)
        buffer = Buffer(None, S, H, K, E, device=device, validate=False, combine_path=args.combine_path)
        planned = buffer.plan(idx, w) if args.preplanned else None

        def step() -> None:
            o = buffer.dispatch(x, idx, w, plan=planned)
            buffer.combine(o.x_CH, o.handle, o.weights_C)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        if rank == 0:
            how = f"combine_path={args.combine_path}, preplanned={args.preplanned}"
            print(f"S={S} H={H} K={K} E={E} skew={args.skew}, {how}, {args.steps} steps, totals over all steps:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
        buffer.destroy()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--skew", default="uniform")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--combine-path", default="all_to_all", choices=["all_to_all", "remote_only"])
    p.add_argument("--preplanned", action="store_true", help="plan once with Buffer.plan, then dispatch(plan=)")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA devices")
        return 2
    from k3infra.testing import free_port

    mp.spawn(_worker, args=(2, free_port(), args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
