"""Checkpoint shards of an expert-parallel model: replicated tensors once, routed experts by logical id.

Routed experts live in modules with ``w1_PFH``/``w2_PHF`` parameters (`moonep.MoELayer`,
`moonep.elastic.PlacedMoELayer`): ``[P, ...]`` rows, one per physical expert of this rank. A module's
*layout* names the logical expert of every physical expert of the group (`layout_of`): the home layout
``0..E-1`` for a `MoELayer`, the placement for a `PlacedMoELayer`. Each rank writes the rows (weights and
the optimizer's per-row state, `moonep.elastic.rows`) of the logical experts whose first copy it holds, so
a group of any size and any placement can load its own rows back. Rank 0 writes the replicated tensors, the
replicated parameters' optimizer state and the scalar state of the expert parameters.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from moonep.elastic.rows import pack_rows, scalar_state, unpack_rows
from moonep.placement import compute_placement

EXPERT_KEYS = ("w1_PFH", "w2_PHF")


def is_expert_key(name: str) -> bool:
    """Whether state-dict entry ``name`` holds routed experts' rows (one per physical expert on dim 0)."""
    return name.rsplit(".", 1)[-1] in EXPERT_KEYS


def expert_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules holding routed experts, by name (``""`` for ``model`` itself)."""
    return {name: m for name, m in model.named_modules() if isinstance(getattr(m, "w1_PFH", None), torch.nn.Parameter)}


def expert_params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [getattr(module, key) for key in EXPERT_KEYS]


def layout_of(module: torch.nn.Module, world: int) -> list[int]:
    """Logical expert of each physical expert of the group (``world * P`` entries, rank-major)."""
    placement = getattr(module, "placement", None)
    if placement is not None:
        return placement.logical_of_X.tolist()
    return list(range(world * module.w1_PFH.shape[0]))


def replan(module: torch.nn.Module, world: int) -> None:
    """Give a placed module the placement of its load history for the current group (no-op for home layouts)."""
    if getattr(module, "placement", None) is not None:
        module.placement = compute_placement(module.load_E.cpu(), world, module.w1_PFH.shape[0])


def replicated_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if not is_expert_key(n)}


def _save(obj: object, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_shard(
    directory: Path,
    model: torch.nn.Module,
    rank: int,
    member_id: str,
    world: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Write this rank's expert rows (every rank) and the replicated state (rank 0) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    experts: dict[str, dict] = {}
    scalars: dict[str, list] = {}
    for name, module in expert_modules(model).items():
        params = expert_params(module)
        P = params[0].shape[0]
        rows, keys = pack_rows(params, optimizer)
        layout = layout_of(module, world)
        first = {}
        for x, e in enumerate(layout):
            first.setdefault(e, x)
        mine = {e: rows[x - rank * P].clone() for e, x in first.items() if x // P == rank}
        experts[name] = {"keys": keys, "rows": mine}
        scalars[name] = [scalar_state(p, optimizer) for p in params]
    _save(experts, directory / f"experts-{member_id}.pt")
    if rank == 0:
        params = replicated_params(model)
        optim = {} if optimizer is None else {n: copy.deepcopy(optimizer.state.get(p, {})) for n, p in params.items()}
        state = {n: t.detach().clone() for n, t in model.state_dict().items() if not is_expert_key(n)}
        _save({"state": state, "optim": optim, "scalars": scalars}, directory / "replicated.pt")


def read_rows(directory: Path, module_name: str, ids: list[int]) -> tuple[torch.Tensor, list[list[str]]]:
    """Rows of logical experts ``ids`` of module ``module_name`` from any shard: ``([len(ids), N], keys)``.

    Raises:
        FileNotFoundError: an expert is in no shard of ``directory``.
    """
    found: dict[int, torch.Tensor] = {}
    keys: list[list[str]] = []
    for path in sorted(directory.glob("experts-*.pt")):
        entry = torch.load(path, weights_only=True).get(module_name, {"rows": {}, "keys": []})
        found.update({e: row for e, row in entry["rows"].items() if e in ids})
        keys = entry["keys"] or keys
    missing = [e for e in ids if e not in found]
    if missing:
        raise FileNotFoundError(f"experts {missing} of {module_name!r} are in no checkpoint shard under {directory}")
    return torch.stack([found[e] for e in ids]), keys


def load_shards(
    directory: Path, model: torch.nn.Module, rank: int, world: int, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, list[int]]:
    """Load the replicated state and this rank's experts (from any former holder's shard) into ``model``.

    A placed module gets the placement of its loaded load history for ``world`` ranks first.

    Returns:
        Per expert module, the logical ids of the rows loaded, in slot order.
    """
    saved = torch.load(directory / "replicated.pt", weights_only=True)
    missing, unexpected = model.load_state_dict(saved["state"], strict=False)
    if unexpected or any(not is_expert_key(n) for n in missing):
        raise RuntimeError(f"checkpoint under {directory} does not match the model: {missing=} {unexpected=}")
    if optimizer is not None:
        for name, param in replicated_params(model).items():
            if saved["optim"].get(name):
                optimizer.state[param] = copy.deepcopy(saved["optim"][name])
    loaded: dict[str, list[int]] = {}
    for name, module in expert_modules(model).items():
        replan(module, world)
        params = expert_params(module)
        P = params[0].shape[0]
        ids = layout_of(module, world)[rank * P : rank * P + P]
        rows, keys = read_rows(directory, name, ids)
        unpack_rows(params, optimizer, rows, keys, saved["scalars"].get(name))
        loaded[name] = ids
    return loaded
