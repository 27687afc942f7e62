"""Test helpers shared by the three libraries: local multi-process groups on the gloo backend.

`run_ranks(fn, world_size)` starts `world_size` processes, joins them into one torch.distributed group and
calls `fn(rank, world_size, *args)` in each. Results come back in rank order; the first failure is re-raised
in the parent with the child's traceback; a hung rank is killed after `timeout_s` and reported.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


class RankFailure(RuntimeError):
    """A rank raised, died or hung; the message carries its traceback or exit code."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    args: tuple,
    results: mp.Queue,
    pg_timeout_s: float,
) -> None:
    import torch.distributed as dist

    # before the group exists: imported later (the first AdamW does, through torch._dynamo) it binds the group as a
    # default argument and keeps it alive past destroy_process_group, into interpreter exit
    import torch.distributed.nn.functional  # noqa: F401

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure may fail too
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    allow_failures: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes sharing one process group.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes, >= 1.
        backend: torch.distributed backend (``gloo`` on CPU).
        timeout_s: wall-clock limit for the whole group; ranks still alive then are killed.
        pg_timeout_s: the process group's own collective timeout.
        allow_failures: return `RankFailure` objects in place of failed ranks' results instead of raising.

    Returns:
        The value each rank returned, in rank order (must be picklable).

    Raises:
        RankFailure: a rank raised, exited without a result, or did not finish within `timeout_s`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, backend, args, results, pg_timeout_s))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(outcome) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
                outcome[rank] = (ok, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, (deadline - datetime.datetime.now()).total_seconds())))
            if p.is_alive():
                p.kill()
                p.join()
    values: list[Any] = []
    first_error: RankFailure | None = None
    for rank, p in enumerate(procs):
        if rank in outcome and outcome[rank][0]:
            values.append(outcome[rank][1])
            continue
        if rank in outcome:
            error = RankFailure(f"rank {rank} raised:\n{outcome[rank][1]}")
        else:
            error = RankFailure(f"rank {rank} gave no result within {timeout_s} s (exit code {p.exitcode})")
        first_error = first_error or error
        values.append(error)
    if first_error is not None and not allow_failures:
        raise first_error
    return values
