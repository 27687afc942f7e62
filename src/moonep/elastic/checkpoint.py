"""Checkpoint shards of an expert-parallel model: replicated tensors once, routed experts by global id.

Routed-expert tensors are the state-dict entries named by `EXPERT_KEYS` (`moonep.MoELayer`'s ``w1_PFH`` and
``w2_PHF``): ``[P, ...]`` rows of the home experts ``rank*P .. rank*P+P-1``. Each rank writes its rows keyed
by global expert id, so a group of any size (``E`` a multiple of it) can load its own home rows back.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

EXPERT_KEYS = ("w1_PFH", "w2_PHF")


def is_expert_key(name: str) -> bool:
    """Whether state-dict entry ``name`` holds routed experts' rows (sharded by home rank on dim 0)."""
    return name.rsplit(".", 1)[-1] in EXPERT_KEYS


def _save(obj: object, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_shard(directory: Path, module: torch.nn.Module, rank: int, member_id: str) -> None:
    """Write this rank's expert rows (every rank) and the replicated tensors (rank 0) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    replicated: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict().items():
        if is_expert_key(name):
            P = tensor.shape[0]
            experts[name] = {rank * P + p: tensor[p].detach().clone() for p in range(P)}
        else:
            replicated[name] = tensor.detach().clone()
    _save(experts, directory / f"experts-{member_id}.pt")
    if rank == 0:
        _save(replicated, directory / "replicated.pt")


def load_shards(directory: Path, module: torch.nn.Module, rank: int) -> list[int]:
    """Load the replicated tensors and this rank's home experts (any former owner's shard) into ``module``.

    Returns:
        The global ids of the experts loaded, in home order.

    Raises:
        FileNotFoundError: a needed expert is in no shard of ``directory``.
    """
    found: dict[str, dict[int, torch.Tensor]] = {}
    for path in sorted(directory.glob("experts-*.pt")):
        for name, rows in torch.load(path, weights_only=True).items():
            found.setdefault(name, {}).update(rows)
    state = torch.load(directory / "replicated.pt", weights_only=True)
    loaded: list[int] = []
    for name, tensor in module.state_dict().items():
        if not is_expert_key(name):
            continue
        P = tensor.shape[0]
        ids = list(range(rank * P, rank * P + P))
        missing = [e for e in ids if e not in found.get(name, {})]
        if missing:
            raise FileNotFoundError(f"experts {missing} of {name!r} are in no checkpoint shard under {directory}")
        state[name] = torch.stack([found[name][e] for e in ids])
        loaded = ids
    module.load_state_dict(state)
    return loaded
