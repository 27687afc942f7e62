"""History-aware placement: copies fill every slot, hot experts get the replicas, packing beats home
placement on skewed load, routing maps onto copies of the same expert, the replica budget is enforced."""

from __future__ import annotations

import pytest
import torch

from moonep.placement import compute_placement, replica_budget


def _zipf(E: int, s: float = 1.2, seed: int = 0) -> torch.Tensor:
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed))
    return (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s)[perm] * 1e4


@pytest.mark.parametrize(("E", "R", "slots"), [(16, 4, 4), (16, 4, 6), (24, 3, 10), (32, 8, 5)])
def test_placement_properties(E: int, R: int, slots: int) -> None:
    load = _zipf(E, seed=E + R)
    placement = compute_placement(load, R, slots)
    assert placement.num_physical == R * slots and placement.num_replicas == R * slots - E
    assert torch.equal(torch.bincount(placement.logical_of_X, minlength=E), placement.copies_E)
    assert int(placement.copies_E.min()) >= 1
    # replicas go to the hottest experts: copies never decrease with load
    order = load.argsort(descending=True)
    assert bool((placement.copies_E[order][:-1] >= placement.copies_E[order][1:]).all())
    # no rank holds two copies of one expert while a rank without it had room
    per_rank = placement.logical_of_X.view(R, slots)
    for r in range(R):
        assert len(set(per_rank[r].tolist())) == slots or int(placement.copies_E.max()) > R
    balanced = placement.rank_load(load)
    home = load.view(R, -1).sum(1)
    assert float(balanced.max()) <= float(home.max()) + 1e-9
    total = float(load.sum())
    assert float(balanced.max()) <= total / R + float((load / placement.copies_E).max()) + 1e-9  # greedy bound
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(50)])
    idx[3, 1] = -1
    physical = placement.map_routing(idx)
    assert physical[3, 1] == -1
    valid = idx >= 0
    assert torch.equal(placement.logical_of_X[physical[valid]], idx[valid])


def test_replica_budget_is_enforced() -> None:
    assert replica_budget(16, 4, 5, expert_bytes=1000, budget_bytes=4000) == 4
    with pytest.raises(ValueError, match="exceed budget_bytes"):
        replica_budget(16, 4, 6, expert_bytes=1000, budget_bytes=4000)
    with pytest.raises(ValueError, match="load_E must be"):
        compute_placement(torch.tensor([-1.0, 1.0]), 2, 1)
    with pytest.raises(ValueError, match="< num_experts"):
        compute_placement(torch.ones(8), 2, 3)
