"""Dispatch and combine over gloo with 2 and 4 ranks, checked exactly against the single-process reference.

Payloads encode (source rank, token): row ``t`` of rank ``src`` is ``[src, t, src*1000 + t, ...]``; the
reference says which (src, t, k) each slot must hold. One process group per world size runs every case.
"""

from __future__ import annotations

import pytest
import torch

from k3infra.testing import run_ranks
from moonep import Buffer
from moonep.reference import reference_dispatch, reference_plan
from moonep.skew import SKEWS, make_routing

pytestmark = pytest.mark.multiproc

H = 6
CASES = [
    # (id, skew, S, s per rank (None: S), K, experts per rank, balanced)
    *[(f"{skew}-S12-K3-bal", skew, 12, None, 3, 3, True) for skew in SKEWS],
    *[(f"{skew}-S9-K2-unbal", skew, 9, None, 2, 2, False) for skew in ("uniform", "lognormal2", "one_expert")],
    ("s0-all-ranks", "uniform", 8, [0, 0, 0, 0], 2, 2, True),
    ("s-varies-per-rank", "lognormal1", 10, [10, 0, 3, 7], 3, 2, True),
]


def _payload(src: int, s: int) -> torch.Tensor:
    t = torch.arange(s, dtype=torch.float32)
    x = torch.stack([torch.full((s,), float(src)), t, src * 1000 + t], dim=1)
    return torch.cat([x, x[:, :1] * 0 + 7, x[:, 1:2] * 3, x[:, :1] - x[:, 1:2]], dim=1)


def _expert_id_of_slots(plan, rank: int, counts_L: torch.Tensor) -> torch.Tensor:
    P = plan.experts_per_rank
    ids_L = torch.cat([torch.arange(P) + rank * P, plan.redundant_ids_RN[rank].cpu()])
    return ids_L.repeat_interleave(counts_L)


HIERARCHICAL_CASES = ("uniform-S12-K3-bal", "hot_rank-S12-K3-bal", "repeated-S12-K3-bal", "s-varies-per-rank")


def _run_cases(
    rank: int,
    world: int,
    device: str = "cpu",
    ranks_per_node: int | None = None,
    only: tuple[str, ...] = (),
    planner: str = "auto",
    preplanned: bool = False,
    combine_path: str = "all_to_all",
) -> list[str]:
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    checked = []
    buffers: dict[tuple, Buffer] = {}  # one Buffer per size configuration, reused across cases
    for case_id, skew, S, s_list, K, P, balanced in CASES:
        if only and case_id not in only:
            continue
        E = P * world
        if K > E:  # a token's K experts are distinct: the case needs more experts than this group has
            continue
        s_all = [S] * world if s_list is None else s_list[:world]
        routes = [make_routing(skew, s_all[r], K, E, world, rank=r, seed=3) for r in range(world)]
        idx, w = routes[rank]
        x = _payload(rank, s_all[rank])
        transport = {"transport": "hierarchical", "ranks_per_node": ranks_per_node} if ranks_per_node else {}
        # Token chunks of the all-gather and of combine's all-to-all: uneven (S=5: 2,1,1,1), three, or one.
        chunks = 1 if case_id == "s0-all-ranks" else (4 if balanced else 3)
        key = (S, K, E, balanced, chunks)
        if key not in buffers:
            buffers[key] = Buffer(
                None, S, H, K, E, dtype=torch.float32, balanced=balanced, device=device, num_chunks=chunks,
                planner=planner, combine_path=combine_path, **transport,
            )  # fmt: skip
        buffer = buffers[key]
        x_d, idx_d, w_d = x.to(device), idx.to(device), w.to(device)
        if preplanned:  # planned ahead (as for the next micro-batch), then dispatched twice with that plan
            planned = buffer.plan(idx_d, w_d, async_finish=True)
            out = buffer.dispatch(x_d, idx_d, w_d, plan=planned)
            again = buffer.dispatch(x_d * 2, idx_d, w_d, plan=planned)
            assert torch.equal(again.x_CH, out.x_CH * 2), f"{case_id}: a reused plan placed rows differently"
            assert torch.equal(out.handle.recv_slots_TK, planned.handle.recv_slots_TK)
            layout_plan = buffer.get_dispatch_layout(idx_d, w_d)  # the plan alone (no handle)
            for name in ("local_counts_RL", "redundant_ids_RN", "load_R"):
                assert torch.equal(getattr(layout_plan, name), getattr(planned.plan, name)), f"{case_id}: {name}"
        else:
            out = buffer.dispatch(x_d, idx_d, w_d)
        out_x, out_w = out.x_CH.cpu(), out.weights_C.cpu()
        plan = out.handle.plan
        counts = torch.stack([torch.bincount(i.view(-1), minlength=E) for i, _ in routes])
        ref = reference_plan(counts, balanced=balanced)
        for key, value in ref.items():
            assert torch.equal(getattr(plan, key).cpu(), value), f"{case_id}: plan.{key} differs from the reference"
        expected = reference_dispatch([i for i, _ in routes], ref)[rank]
        assert out_x.shape == (buffer.capacity, H)
        assert int(out.counts_L.sum()) == len([e for e in expected if e[0] >= 0])
        for c, (src, t, k) in enumerate(expected):
            if src < 0:
                assert not out_x[c].any() and out_w[c] == 0, f"{case_id}: unused slot {c} not zero"
                continue
            assert torch.equal(out_x[c], _payload(src, s_all[src])[t]), f"{case_id}: slot {c} != {(src, t, k)}"
            assert out_w[c] == routes[src][1][t, k], f"{case_id}: weight of slot {c}"
        if balanced:
            total = int(counts.sum())
            loads = plan.load_R.tolist()
            assert max(loads) - min(loads) <= 1 and sum(loads) == total, f"{case_id}: loads {loads}"
            if s_list is None:
                assert loads == [S * K] * world, f"{case_id}: not exactly S*K per rank: {loads}"
        # Expert "f_e(x) = (e + 1) * x" shows which expert each slot was computed with.
        used = len([e for e in expected if e[0] >= 0])
        scale = torch.zeros(buffer.capacity)
        scale[:used] = _expert_id_of_slots(plan, rank, out.counts_L.cpu()).float() + 1
        y_CH = out.x_CH * scale[:, None].to(device)
        combined, _ = buffer.combine(y_CH, out.handle, out.weights_C)
        combined = combined.cpu()
        want = x * ((idx.float() + 1) * w).sum(1, keepdim=True) if s_all[rank] else x
        assert torch.equal(combined, want), f"{case_id}: combine differs by {(combined - want).abs().max()}"
        assert torch.equal(buffer.combine(y_CH, out.handle)[0].cpu(), combined), "handle's weights differ"
        plain = buffer.combine(y_CH, out.handle, apply_weights=False)[0].cpu()
        want_plain = x * (idx.float() + 1).clamp(min=0).sum(1, keepdim=True) if s_all[rank] else x
        assert torch.equal(plain, want_plain), f"{case_id}: unweighted combine"
        checked.append(case_id)
    for buffer in buffers.values():
        buffer.destroy()
    return checked


@pytest.mark.parametrize(
    ("world", "ranks_per_node", "planner", "preplanned"),
    [
        (1, None, "auto", False),
        (2, None, "auto", False),
        (4, None, "auto", False),
        (4, 2, "auto", False),
        (2, None, "fused", False),
        (1, None, "auto", True),
        (2, None, "auto", True),
        (4, None, "auto", True),
    ],
    ids=[
        "R1-local", "R2", "R4", "R4-hierarchical-2x2", "R2-fused-planner",
        "R1-preplanned-remote-combine", "R2-preplanned-remote-combine", "R4-preplanned-remote-combine",
    ],
)  # fmt: skip
def test_dispatch_and_combine_place_every_slot_exactly(
    world: int, ranks_per_node: int | None, planner: str, preplanned: bool
) -> None:
    # The hierarchical transport builds node and rail groups per Buffer: a subset of cases keeps CI short.
    # planner="fused" runs the Triton planner kernels in Triton's interpreter (CPU) or on the GPU.
    # preplanned: Buffer.plan ahead of dispatch(plan=...), and combine_path="remote_only" (own rows never
    # travel), checked against the same exact payloads.
    only = HIERARCHICAL_CASES if ranks_per_node else ()
    path = "remote_only" if preplanned else "all_to_all"
    results = run_ranks(_run_cases, world, "cpu", ranks_per_node, only, planner, preplanned, path, timeout_s=240)
    expected = [c[0] for c in CASES if (not only or c[0] in only) and c[4] <= c[5] * len(results)]
    assert all(r == expected for r in results)
