"""`ShardedMuon` over gloo ranks: each block's Newton–Schulz runs on one rank only, and the parameters follow a
single process's Muon on the whole tensors. Row-sharded DTensors: the shard's own blocks where the shards hold them
whole, otherwise one owner per matrix. Expert stacks every rank holds alike (EP-sharded experts over their
data-parallel replicas): each rank orthogonalises its chunk of the slices."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from k3infra.testing import run_ranks
from k3infra.train.optim import ShardedMuon

pytestmark = pytest.mark.multiproc

SHAPES = {"plain": (13, 10), "wide": (7, 30), "tall": (30, 7), "experts": (5, 6, 4), "heads": (16, 12)}
"""Uneven and empty shards over 3 and 4 ranks; the experts and, over 4 ranks, the heads (blocks of 4 rows) are
held whole by the shards, the rest needs an owner."""


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _muon(params: dict[str, nn.Parameter], replica_group=None) -> ShardedMuon:
    """The expert stack is marked replicated over ``replica_group`` when one is given."""
    return ShardedMuon([{"params": [params[n] for n in ("plain", "wide", "tall")]},
                        {"params": [params["experts"]], "replicated": replica_group is not None},
                        {"params": [params["heads"]], "head_rows": (4,)}],
                       lr=0.1, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", replica_group=replica_group)


def _counted_steps(opt: ShardedMuon, params: dict[str, nn.Parameter],
                   as_grad: Callable[[torch.Tensor], torch.Tensor] = lambda grad: grad) -> list[int]:
    """Three steps on fresh gradients; the FLOPs torch counts in each."""
    flops = []
    for step in range(3):
        for name, grad in _tensors(step + 1).items():
            params[name].grad = as_grad(grad)
        with FlopCounterMode(display=False) as counter:
            opt.step()
        flops.append(counter.get_total_flops())
    return flops


def _one_process_matches(results: list[dict]) -> ShardedMuon:
    """Every rank's parameters equal one process's Muon over the same steps; returns that process's optimizer."""
    params = {n: nn.Parameter(t) for n, t in _tensors(0).items()}
    opt = _muon(params)
    _counted_steps(opt, params)
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(torch.tensor(value), params[name].detach(), rtol=0, atol=1e-6, msg=name)
    return opt


def _sharded_steps(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    params = {n: nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for n, t in _tensors(0).items()}
    flops = _counted_steps(_muon(params), params, lambda grad: distribute_tensor(grad, mesh, [Shard(0)]))
    return {"params": {n: p.full_tensor().tolist() for n, p in params.items()}, "flops": flops}


@pytest.mark.parametrize("world", [3, 4])
def test_sharded_muon_computes_each_block_once_and_matches_one_process(world):
    results = run_ranks(_sharded_steps, world, timeout_s=240)
    total = _one_process_matches(results).newton_schulz_flops()
    for step in range(3):
        per_rank = [r["flops"][step] for r in results]
        assert sum(per_rank) == total  # every block orthogonalised exactly once
        assert max(per_rank) < 0.75 * total, per_rank  # and spread over the ranks


def _replicated_steps(rank: int, world: int) -> dict:
    import torch.distributed as dist

    params = {n: nn.Parameter(t) for n, t in _tensors(0).items()}  # every rank holds the same whole tensors
    flops = _counted_steps(_muon(params, dist.group.WORLD), params)
    return {"params": {n: p.tolist() for n, p in params.items()}, "flops": flops}


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_expert_stacks_split_their_slices_over_the_replicas(world):
    results = run_ranks(_replicated_steps, world, timeout_s=240)
    opt = _one_process_matches(results)
    experts = SHAPES["experts"][0]
    stack = ShardedMuon([{"params": [nn.Parameter(torch.zeros(SHAPES["experts"]))]}]).newton_schulz_flops()
    others = opt.newton_schulz_flops() - stack  # orthogonalised whole on every rank
    counts = [len(c) for c in torch.arange(experts).chunk(world)]
    expected = sorted(stack // experts * n for n in counts + [0] * (world - len(counts)))  # 5 slices: 3+2, 2+2+1+0
    for step in range(3):
        assert sorted(r["flops"][step] - others for r in results) == expected
