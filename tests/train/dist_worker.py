"""Entry point of one rank of a spawned gloo run (`torch.multiprocessing.spawn`)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def run_rank(rank: int, world_size: int, port: int, cfg_kwargs: dict, result_file: str, factory_name: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    from k3infra.train import TrainConfig, train

    factory = None
    if factory_name == "tiny":
        from tests.train.tiny_lm import tiny_factory as factory
    result = train(TrainConfig(**cfg_kwargs), factory)
    if rank == 0:
        Path(result_file).write_text(json.dumps(result.history))


def spawn_run(world_size: int, cfg_kwargs: dict, result_file: Path, factory_name: str = "tiny") -> list[dict]:
    """Run `train` on ``world_size`` gloo processes; returns rank 0's history."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(run_rank, args=(world_size, port, cfg_kwargs, str(result_file), factory_name), nprocs=world_size,
             join=True)
    return json.loads(result_file.read_text())
