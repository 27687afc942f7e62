"""`ElasticMoE`: history-aware expert placement for the trainer's expert-parallel MoE layers (a callback).

With ``--ep R`` every MoE layer keeps ``P = E / R`` routed experts per rank, first its home experts
``[r·P, (r+1)·P)``. This callback lays them out by load instead (`moonep.placement.compute_placement` with ``P``
slots per rank: no replicas, the heaviest experts spread over the ranks first):

- a forward hook on each layer's router counts the step's logical hits and returns them mapped to the
  *physical* slots of the current placement, so the MoonEP buffer sends each token to the rank that holds its
  expert now (slot ``x`` is row ``x % P`` of rank ``x // P``);
- after every step the hits are summed over all ranks (one all-reduce of ``[layers, E]`` integers) into an
  exponentially decayed load history (identical on every rank) and the step's max/mean load per EP rank is
  added to the history entry (``ep_max_over_mean``, the mean over the layers);
- every ``rebalance_every`` steps each layer gets the placement of its history and the rows of its expert
  weights that change rank move by point-to-point sends over the EP group, with their optimizer state
  (`moonep.elastic.rows`: AdamW moments, Muon momentum); parameters keep their objects, so the optimizers go on.

A step computes the same thing under any layout (each expert is applied once to the same tokens), so the loss
curve equals a run that never rebalances up to summation order. The placement and the history are saved in the
checkpoint's ``trainer.json`` and restored on ``--resume`` (the expert rows are saved in their slots).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from k3infra.train.callbacks import TrainerCallback
from k3infra.train.parallel import EXPERT_WEIGHTS

logger = logging.getLogger(__name__)


@dataclass
class _Layer:
    """One MoE layer under placement: its expert rows (``[P, ...]`` each), their optimizer and the layout."""

    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    placement: Any
    load_E: torch.Tensor
    """``[E]`` float64 decayed hits over the whole job (same on every rank)."""
    hits_E: torch.Tensor
    """``[E]`` int64 this rank's hits since the last step end (on the routing's device)."""


def _owner(param: nn.Parameter, optimizers: list[torch.optim.Optimizer]) -> torch.optim.Optimizer | None:
    for optimizer in optimizers:
        if any(p is param for group in optimizer.param_groups for p in group["params"]):
            return optimizer
    return None


def _max_over_mean(load_R: torch.Tensor) -> float:
    mean = float(load_R.mean())
    return float(load_R.max()) / mean if mean > 0 else 1.0


class ElasticMoE(TrainerCallback):
    """Placement of the routed experts recomputed from the load history every ``rebalance_every`` steps.

    Args:
        rebalance_every: steps between placement updates (>= 1).
        history_decay: the load history decays by this factor per step before the step's hits are added.

    The model's MoE layers (``model.moe_layers()``) must route through a router module returning
    ``(topk_idx_sK, topk_weights_sK)``, hold their experts as stacked ``w1``/``w2``/``w3`` rows after
    ``enable_expert_parallel`` and expose ``num_experts`` and ``ep_buffer`` (`k3infra.model.moe.K3MoE` does).
    """

    def __init__(self, rebalance_every: int, *, history_decay: float = 0.9) -> None:
        if not isinstance(rebalance_every, int) or rebalance_every < 1:
            raise ValueError(f"rebalance_every must be a positive int, got {rebalance_every!r}")
        if not 0.0 <= history_decay < 1.0:
            raise ValueError(f"history_decay must be in [0, 1), got {history_decay}")
        self.rebalance_every, self.history_decay = rebalance_every, history_decay
        self.layers: list[_Layer] = []
        self.rebalances = 0
        self._hooks: list[Any] = []
        """The router hooks; they stay after the run, so the model keeps routing to the moved experts."""

    # -- trainer hooks ---------------------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        from moonep.placement import placement_from_layout

        cfg, state = trainer.cfg, trainer.state
        if cfg.ep < 2:
            raise ValueError(f"--rebalance-every needs expert parallelism (--ep > 1), got --ep {cfg.ep}")
        if cfg.lora:
            raise ValueError("--rebalance-every does not apply with --lora (the experts are frozen)")
        self.group, self.ep_rank, self.ep = state.ep_group, state.ep_rank, cfg.ep
        layers = [m for m in trainer.moe_layers if getattr(m, "ep_buffer", None) is not None]
        if not layers:
            raise ValueError("--rebalance-every found no expert-parallel MoE layer in the model")
        for moe in layers:
            params = [getattr(moe, n) for n in EXPERT_WEIGHTS if isinstance(getattr(moe, n, None), nn.Parameter)]
            P, E = params[0].shape[0], moe.num_experts
            layer = _Layer(params, _owner(params[0], trainer.optimizers), placement_from_layout(range(E), self.ep, P),
                           torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.long))
            self.layers.append(layer)
            self._hooks.append(moe.router.register_forward_hook(self._router_hook(layer)))

    def on_step_end(self, trainer: Any, step: int, entry: dict) -> None:
        hits = torch.stack([layer.hits_E for layer in self.layers])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(hits)  # every rank's tokens, every data-parallel row: the same history everywhere
        balance = []
        hits = hits.cpu()
        for layer, hits_E in zip(self.layers, hits, strict=True):
            layer.load_E.mul_(self.history_decay).add_(hits_E.double())
            layer.hits_E.zero_()
            balance.append(_max_over_mean(layer.placement.rank_load(hits_E)))
        entry["ep_max_over_mean"] = sum(balance) / len(balance)
        done = step + 1
        if done % self.rebalance_every == 0 and done < trainer.cfg.steps:
            entry["rebalance"] = self.rebalance()

    def state_dict(self) -> dict[str, Any]:
        return {"rebalances": self.rebalances,
                "layers": [{"logical_of_X": layer.placement.logical_of_X.tolist(), "load_E": layer.load_E.tolist()}
                           for layer in self.layers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved layouts as they are (the checkpoint's expert rows are in those slots)."""
        from moonep.placement import placement_from_layout

        saved = state.get("layers", [])
        if len(saved) != len(self.layers):
            raise ValueError(f"the checkpoint's placement has {len(saved)} MoE layers, the model {len(self.layers)}")
        for layer, entry in zip(self.layers, saved, strict=True):
            layer.placement = placement_from_layout(entry["logical_of_X"], self.ep, layer.params[0].shape[0])
            layer.load_E = torch.tensor(entry["load_E"], dtype=torch.float64)
        self.rebalances = int(state.get("rebalances", 0))

    # -- placement -------------------------------------------------------------------------------------------

    def _router_hook(self, layer: _Layer):
        def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]):
            idx_sK, weights_sK = output
            if module.training:  # counted on the routing's device: no host sync per forward
                if layer.hits_E.device != idx_sK.device:
                    layer.hits_E = layer.hits_E.to(idx_sK.device)
                layer.hits_E += torch.bincount(idx_sK.flatten(), minlength=layer.hits_E.numel())
            return layer.placement.map_routing(idx_sK), weights_sK

        return hook

    @torch.no_grad()
    def rebalance(self) -> dict[str, Any]:
        """Move every layer to the placement of its load history (collective over the EP group).

        Returns:
            ``{"rows_received": rows this rank received, "rows_moved": rows moved over the EP group,
            "predicted_before"/"predicted_after": max/mean load per EP rank of the history under the old/new
            layouts (mean over layers), "seconds"}``.
        """
        import time

        from moonep.elastic.rows import exchange_rows, holders_of, pack_rows, unpack_rows
        from moonep.placement import compute_placement

        t0 = time.perf_counter()
        received, before, after = 0, [], []
        for layer in self.layers:
            P = layer.params[0].shape[0]
            new = compute_placement(layer.load_E, self.ep, P)
            before.append(_max_over_mean(layer.placement.rank_load(layer.load_E)))
            after.append(_max_over_mean(new.rank_load(layer.load_E)))
            rows, keys = pack_rows(layer.params, layer.optimizer)
            holders = holders_of(layer.placement.logical_of_X.tolist(), P, list(range(self.ep)))
            moved, got, missing = exchange_rows(rows, holders, new.logical_of_X.tolist(), self.ep_rank, self.group)
            if missing:
                raise RuntimeError(f"experts of slots {missing} have no holder; the layout was not complete")
            unpack_rows(layer.params, layer.optimizer, moved, keys)
            layer.placement = new
            received += got
        self.rebalances += 1
        moved = torch.tensor([received])
        dist.all_reduce(moved, group=self.group)
        seconds = time.perf_counter() - t0
        logger.info("expert placement %d: %d rows moved, predicted max/mean %.3f -> %.3f in %.3f s",
                    self.rebalances, int(moved), sum(before) / len(before), sum(after) / len(after), seconds)
        return {"rows_received": received, "rows_moved": int(moved), "predicted_before": sum(before) / len(before),
                "predicted_after": sum(after) / len(after), "seconds": seconds}
