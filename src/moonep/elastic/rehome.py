"""Re-homing a lost rank's experts from the survivors' memory, the checkpoint only for what no survivor holds.

After a shrink, the survivors hold the old model and optimizer in memory, all after the same step when the
failed step died before its optimizer step (the usual case: the optimizer step follows every collective).
Then each expert of the new layout (the placement recomputed for the new group size from the load history)
is copied from a survivor holding it, with its optimizer state, by point-to-point sends; replicated weights
and their optimizer state are every survivor's own. Only experts with no surviving copy come from the last
committed checkpoint, which is possible only when that checkpoint is of the same step.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from moonep.elastic.checkpoint import (
    expert_modules,
    expert_params,
    is_expert_key,
    layout_of,
    read_rows,
    replan,
    replicated_params,
)
from moonep.elastic.rows import exchange_rows, holders_of, pack_rows, scalar_state, unpack_rows

logger = logging.getLogger(__name__)


def _same_everywhere(value: int) -> bool:
    """Whether every rank of the default group passed the same ``value`` (collective)."""
    mine = torch.tensor([value, -value], dtype=torch.long)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine[0]) == value and int(mine[1]) == -value


def rehome_live(
    old_model: torch.nn.Module,
    old_optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_of_old: list[int | None],
    applied: int,
    directory: Path,
    committed: int,
    timeout_s: float,
) -> dict | None:
    """Fill ``model``/``optimizer`` (just built for the new default group) from the survivors (collective).

    Args:
        old_model, old_optimizer: this survivor's state from the previous generation.
        rank_of_old: new rank of each old rank, None for the lost ones.
        applied: the last step whose optimizer step ran on this survivor.
        directory, committed: the last committed checkpoint and its step.

    Returns:
        ``{"source": "live", "checkpoint_experts": {module: [ids]}, "received": rows}``, or None (nothing
        changed) when the survivors are not all after the same step, or an expert with no surviving copy is
        needed and the checkpoint is of another step: then load everything from the checkpoint.
    """
    if not _same_everywhere(applied):
        logger.warning("survivors are not all after step %d: re-homing from the checkpoint", applied)
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    old_modules, new_modules = expert_modules(old_model), expert_modules(model)
    state = {n: t for n, t in old_model.state_dict().items() if not is_expert_key(n)}
    model.load_state_dict(state, strict=False)
    plans = {}
    for name, module in new_modules.items():
        old = old_modules[name]
        if getattr(module, "placement", None) is not None:
            load = old.load_E.detach().clone()
            dist.broadcast(load, 0)  # survivors may have counted the failed step's forward or not
            module.load_E.copy_(load)
            replan(module, world)
        holders = holders_of(layout_of(old, len(rank_of_old)), old.w1_PFH.shape[0], rank_of_old)
        layout = layout_of(module, world)
        plans[name] = (holders, layout, sorted({e for e in layout if e not in holders}))
    if any(missing for _, _, missing in plans.values()) and committed != applied:
        logger.warning("experts lost with no copy and the checkpoint is of step %d, not %d", committed, applied)
        return None
    old_params = replicated_params(old_model)
    for name, param in replicated_params(model).items():
        if old_params[name] in old_optimizer.state:
            optimizer.state[param] = copy.deepcopy(old_optimizer.state[old_params[name]])
    received = 0
    for name, (holders, layout, _) in plans.items():
        params, old_expert = expert_params(new_modules[name]), expert_params(old_modules[name])
        rows, keys = pack_rows(old_expert, old_optimizer)
        moved, got, empty = exchange_rows(rows, holders, layout, rank, None, timeout_s)
        received += got
        if empty:
            P = params[0].shape[0]
            saved, saved_keys = read_rows(directory, name, [layout[rank * P + j] for j in empty])
            if saved_keys != keys or saved.shape[1] != moved.shape[1]:
                raise RuntimeError(f"checkpoint rows of {name!r} hold state {saved_keys}, the optimizer has {keys}")
            moved[empty] = saved
        unpack_rows(params, optimizer, moved, keys, [scalar_state(p, old_optimizer) for p in old_expert])
    return {
        "source": "live",
        "checkpoint_experts": {name: missing for name, (_, _, missing) in plans.items() if missing},
        "received": received,
    }
