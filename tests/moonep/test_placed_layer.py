"""`PlacedMoELayer` pieces on 2 gloo ranks: argument checks, replica gradients summed over copies, a
rebalance moves every expert's weights and AdamW state to its new slots, and a checkpoint written under one
placement loads into another (weights and optimizer state by logical expert)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from k3infra.testing import run_ranks

pytestmark = pytest.mark.multiproc

E, H, F, K, S = 5, 8, 6, 2, 8


def _by_logical(layer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """Every copy of every logical expert over the group: ``{e: [copies, N]}`` (weights, then AdamW moments)."""
    from moonep.elastic.rows import pack_rows

    rows, _ = pack_rows([layer.w1_PFH, layer.w2_PHF], optimizer)
    gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, rows)
    every = torch.cat(gathered)
    out: dict[int, list] = {}
    for x, e in enumerate(layer.placement.logical_of_X.tolist()):
        out.setdefault(e, []).append(every[x])
    return {e: torch.stack(copies) for e, copies in out.items()}


def _case(rank: int, world: int, tmp: str) -> None:
    from moonep import Buffer
    from moonep.elastic import PlacedMoELayer
    from moonep.elastic.checkpoint import load_shards, save_shard
    from moonep.placement import compute_placement

    torch.manual_seed(0)
    buffer = Buffer(None, S, H, K, 2 * world, dtype=torch.float32, balanced=False)  # 2 slots per rank: X=4
    with pytest.raises(ValueError, match="num_experts must be"):
        PlacedMoELayer(buffer, F, E)
    with pytest.raises(ValueError, match="placement is for"):
        PlacedMoELayer(buffer, F, 3, placement=compute_placement(torch.ones(3), world, 3))
    buffer.destroy()
    buffer = Buffer(None, S, H, K, 4 * world, dtype=torch.float32, balanced=False)  # X=8: 3 replicas
    expert_bytes = 2 * F * H * 4
    with pytest.raises(ValueError, match="exceed budget_bytes"):
        PlacedMoELayer(buffer, F, E, replica_budget_bytes=3 * expert_bytes - 1)
    PlacedMoELayer(buffer, F, E, replica_budget_bytes=3 * expert_bytes)
    layer = PlacedMoELayer(buffer, F, E, num_shared=1)
    torch.manual_seed(1)  # same weights for every copy of an expert, on every rank
    w1, w2 = torch.randn(E, F, H), torch.randn(E, H, F)
    with torch.no_grad():
        layer.w1_PFH.copy_(w1[layer.logical_ids()])
        layer.w2_PHF.copy_(w2[layer.logical_ids()])
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(S, H, generator=torch.Generator().manual_seed(10 * step + rank))
        optimizer.zero_grad()
        layer(x).out_sH.square().sum().backward()
        for name, param in layer.named_parameters():
            if name not in ("w1_PFH", "w2_PHF"):
                dist.all_reduce(param.grad)
        own = layer.w1_PFH.grad.clone()
        layer.sync_replica_grads()
        gathered = [torch.empty_like(own) for _ in range(world)]
        dist.all_gather(gathered, own)
        logical_grad = torch.zeros(E, F, H).index_add_(0, layer.placement.logical_of_X, torch.cat(gathered))
        for p, e in enumerate(layer.logical_ids()):  # every copy holds the logical expert's gradient
            torch.testing.assert_close(layer.w1_PFH.grad[p], logical_grad[e])
        optimizer.step()
    before = _by_logical(layer, optimizer)
    for rows in before.values():  # copies stay equal
        torch.testing.assert_close(rows, rows[:1].expand_as(rows), rtol=0, atol=0)
    assert float(layer.load_E.sum()) > 0
    # a different placement: every expert's weights and moments follow it
    skewed = torch.tensor([100.0, 1.0, 1.0, 1.0, 50.0])
    received = layer.rebalance(optimizer, compute_placement(skewed, world, 4))
    after = _by_logical(layer, optimizer)
    assert received >= 0 and int(layer.placement.copies_E[0]) >= 2
    for e in range(E):
        torch.testing.assert_close(after[e], before[e][:1].expand_as(after[e]), rtol=0, atol=0)
    # checkpoint under this placement, load under the load history's placement into a fresh layer
    save_shard(Path(tmp), layer, rank, str(rank), world, optimizer)
    dist.barrier()
    fresh = PlacedMoELayer(buffer, F, E, num_shared=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    load_shards(Path(tmp), fresh, rank, world, fresh_optimizer)
    torch.testing.assert_close(fresh.load_E, layer.load_E)
    loaded = _by_logical(fresh, fresh_optimizer)
    for e in range(E):
        torch.testing.assert_close(loaded[e], before[e][:1].expand_as(loaded[e]), rtol=0, atol=0)
    assert int(fresh_optimizer.state[fresh.w1_PFH]["step"]) == 2
    buffer.destroy()


def test_placed_layer_pieces(tmp_path: Path) -> None:
    run_ranks(_case, 2, str(tmp_path), timeout_s=120)
