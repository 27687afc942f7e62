"""DCP checkpoints with exact resume.

A checkpoint folder ``<out>/checkpoints/step_<N>`` holds:

- the `torch.distributed.checkpoint` shards of the model (parameters and buffers, so the Quantile Balancing bias
  comes back), every optimizer's state and every LR scheduler's state;
- ``rng_rank<r>.pt``: each rank's CPU (and CUDA) generator state;
- ``trainer.json``: the step (which is the data position: batches depend only on seed and step), the loss
  history and the run's settings.

EP-sharded expert tensors hold different data under the same name on the ranks of an ep group; they are saved
under ``<name>@ep<rank>`` keys so DCP keeps one copy per shard instead of treating them as replicated.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

logger = logging.getLogger(__name__)

TRAINER_FILE = "trainer.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _tag_experts(flat: dict[str, Any], expert_names: set[str], ep_rank: int, *, tag: bool) -> dict[str, Any]:
    """Rename state-dict keys that mention an expert parameter (add or strip the ``@ep<rank>`` suffix)."""
    if not expert_names:
        return flat
    out = {}
    suffix = f"@ep{ep_rank}"
    for key, value in flat.items():
        # model entries map a name to a tensor, optimizer entries a name to a dict of state tensors
        if tag and key in expert_names:
            out[key + suffix] = value
        elif not tag and key.endswith(suffix) and key[: -len(suffix)] in expert_names:
            out[key[: -len(suffix)]] = value
        else:
            out[key] = value
    return out


def _app_state(model, optimizers, schedulers, expert_names, ep_rank):
    model_sd, optim_sd = get_state_dict(model, optimizers)
    # optimizer state keys are "state" → {fqn: {...}} and "param_groups" → [{"params": [fqn, ...]}]
    return {
        "model": _tag_experts(model_sd, expert_names, ep_rank, tag=True),
        "optim": {"state": _tag_experts(optim_sd["state"], expert_names, ep_rank, tag=True),
                  "param_groups": optim_sd["param_groups"]},
        "schedulers": [s.state_dict() for s in schedulers],
    }


def save_checkpoint(
    path: Path,
    *,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list,
    trainer_state: dict[str, Any],
    expert_names: set[str],
    ep_rank: int,
) -> Path:
    """Write a checkpoint (collective: every rank calls it)."""
    path.mkdir(parents=True, exist_ok=True)
    state = _app_state(model, optimizers, schedulers, expert_names, ep_rank)
    dcp.save(state, checkpoint_id=str(path))
    rank = dist.get_rank()
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, path / f"rng_rank{rank}.pt")
    if rank == 0:
        (path / TRAINER_FILE).write_text(json.dumps(trainer_state, indent=1))
    dist.barrier()
    logger.info("checkpoint written to %s", path)
    return path


def resolve_checkpoint(path: str | Path, *, option: str = "--resume") -> Path:
    """A checkpoint folder, or the newest ``step_<N>`` under a run folder or its ``checkpoints/``.

    Raises:
        FileNotFoundError: the path does not exist or holds no checkpoint (the message names ``--resume``).
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{option} {str(root)!r} does not exist")
    if (root / TRAINER_FILE).is_file():
        return root
    for folder in (root, root / "checkpoints"):
        steps = [(int(m.group(1)), p) for p in folder.glob("step_*") if (m := _STEP_DIR.match(p.name))
                 and (p / TRAINER_FILE).is_file()] if folder.is_dir() else []
        if steps:
            return max(steps)[1]
    raise FileNotFoundError(f"{option} {str(root)!r} holds no checkpoint (expected {TRAINER_FILE} in it or in "
                            "checkpoints/step_<N>/)")


def _drop_unsaved_optimizer_state(optim_state: dict[str, dict[str, Any]], metadata: Metadata) -> None:
    """Remove from the state to load the optimizer entries the checkpoint does not hold.

    ``get_state_dict`` gives a fresh optimizer state for every parameter, but at save time a parameter that never
    had a gradient (AdamW and Muon skip it) had none: it resumes without state, as it was.
    """
    saved = set(metadata.state_dict_metadata)
    for fqn in list(optim_state):
        entry = optim_state[fqn]
        for key in [k for k in entry if f"optim.state.{fqn}.{k}" not in saved]:
            del entry[key]
        if not entry:
            del optim_state[fqn]


def load_checkpoint(
    path: Path,
    *,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list,
    expert_names: set[str],
    ep_rank: int,
) -> dict[str, Any]:
    """Restore model, optimizers, schedulers and RNG from ``path`` (collective). Returns ``trainer.json``."""
    trainer_state = json.loads((path / TRAINER_FILE).read_text())
    state = _app_state(model, optimizers, schedulers, expert_names, ep_rank)
    reader = dcp.FileSystemReader(str(path))
    _drop_unsaved_optimizer_state(state["optim"]["state"], reader.read_metadata())
    dcp.load(state, storage_reader=reader)
    model_sd = _tag_experts(state["model"], expert_names, ep_rank, tag=False)
    optim_sd = {"state": _tag_experts(state["optim"]["state"], expert_names, ep_rank, tag=False),
                "param_groups": state["optim"]["param_groups"]}
    # not strict: parameters without saved optimizer state (see above); missing model keys fail in dcp.load
    set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(strict=False))
    for scheduler, sd in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(sd)
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return trainer_state


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model entries of a checkpoint into an unsharded, non-EP ``model`` (``--init-from``).

    Raises:
        ValueError: the checkpoint was written with expert parallelism (its expert shards are per rank).
    """
    state = {"model": model.state_dict()}
    trainer_state = json.loads((path / TRAINER_FILE).read_text())
    if trainer_state.get("config", {}).get("ep", 1) != 1:
        raise ValueError(f"--init-from {str(path)!r} was written with --ep {trainer_state['config']['ep']}; "
                         "initialise from a checkpoint written with --ep 1")
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
