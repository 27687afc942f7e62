"""The device planner equals the loop reference on random histograms, balances exactly, and routes every
hit to a distinct slot (single process, property-based)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep import compute_plan, route_tokens
from moonep.plan import counts_and_occurrence, route_received
from moonep.reference import reference_plan


@st.composite
def routings(draw) -> tuple[list[torch.Tensor], torch.Tensor]:
    R = draw(st.integers(1, 6))
    P = draw(st.integers(1, 4))
    K = draw(st.integers(1, 4))
    E = R * P
    tokens = [draw(st.integers(0, 6)) for _ in range(R)]
    hot = draw(st.integers(0, E - 1))
    idx = []
    for s in tokens:
        flat = draw(st.lists(st.one_of(st.just(hot), st.integers(-1, E - 1)), min_size=s * K, max_size=s * K))
        idx.append(torch.tensor(flat, dtype=torch.long).view(s, K))
    counts = torch.stack([torch.bincount(i[i >= 0].view(-1), minlength=E) for i in idx])
    return idx, counts


@settings(max_examples=150, deadline=None)
@given(routings(), st.booleans())
def test_plan_equals_reference_balances_and_routes_bijectively(routing, balanced: bool) -> None:
    idx, counts = routing
    plan = compute_plan(counts, balanced=balanced)
    for key, value in reference_plan(counts, balanced=balanced).items():
        assert torch.equal(getattr(plan, key), value), key
    total = int(counts.sum())
    R = counts.shape[0]
    if balanced:
        assert sorted(plan.load_R.tolist()) == sorted([total // R + (r < total % R) for r in range(R)])
    assert torch.equal(plan.assign_ER.sum(1), counts.sum(0))  # every hit computed exactly once
    taken: set[tuple[int, int]] = set()
    for src, i in enumerate(idx):
        dest, slot = route_tokens(plan, src, i)
        assert torch.equal(dest < 0, i < 0) and torch.equal(slot < 0, i < 0)
        for d, c in zip(dest[i >= 0].tolist(), slot[i >= 0].tolist()):
            assert 0 <= c < int(plan.load_R[d]) and (d, c) not in taken
            taken.add((d, c))
    assert len(taken) == total
    # Each destination places the hits it computes from everyone's routing, as the sources route them.
    S = max(i.shape[0] for i in idx)
    E = counts.shape[1]
    K = idx[0].shape[1] if idx[0].dim() == 2 else 1
    padded = [torch.cat([i.view(-1, K), torch.full((S - i.shape[0], K), -1, dtype=torch.long)]) for i in idx]
    expert_T = torch.cat([torch.where(i >= 0, i, E).view(-1) for i in padded])
    routes = [route_tokens(plan, src, i) for src, i in enumerate(padded)]
    for d in range(R):
        want = torch.cat([torch.where(dest == d, slot, -1).view(-1) for dest, slot in routes])
        assert torch.equal(route_received(plan, d, expert_T), want), f"destination {d}"
    counts_RE, occ_T = counts_and_occurrence(expert_T, R, E)  # sort-based, as the buffer plans
    assert torch.equal(counts_RE, counts), "sorted counts differ from bincount"
    for d in range(R):
        assert torch.equal(route_received(plan, d, expert_T, occ_T), route_received(plan, d, expert_T))
