"""The Triton combine reduction equals the torch reduction (Triton's interpreter on CPU; real kernel on GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moonep.ops import reduce_slots, scatter_rows, sum_ranks

pytest.importorskip("triton")

CASES = [
    # (T, K, C, H, weighted, dtype)
    pytest.param(7, 3, 9, 5, True, torch.float32, id="T7-K3-C9-H5-w-fp32"),
    pytest.param(12, 4, 20, 33, False, torch.float32, id="T12-K4-C20-H33-fp32"),
    pytest.param(5, 2, 6, 40, True, torch.bfloat16, id="T5-K2-C6-H40-w-bf16"),
    pytest.param(0, 2, 4, 8, True, torch.float32, id="T0-empty"),
]


def _case(T: int, K: int, C: int, H: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(T * 31 + H)
    y = torch.randn(C, H, generator=gen).to(dtype)
    w = torch.rand(C, generator=gen)
    slots = torch.randint(-1, C, (T, K), generator=gen)  # -1: the hit is on another rank
    return y.to(device), slots.to(device), w.to(device)


@pytest.mark.parametrize(("T", "K", "C", "H", "weighted", "dtype"), CASES)
def test_triton_reduce_slots_matches_torch(T, K, C, H, weighted, dtype, device) -> None:
    from moonep.kernels import reduce_slots_triton

    y, slots, w = _case(T, K, C, H, dtype, device)
    got = reduce_slots_triton(y, slots, w if weighted else None, dtype)
    want = reduce_slots(y.cpu(), slots.cpu(), w.cpu() if weighted else None, dtype)
    # fp32: the GPU contracts w*y+acc into one FMA, so allow an ulp.
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 1e-2)


SCATTER_CASES = [
    # (n, T, K, C, H, dtype)
    pytest.param(5, 9, 3, 14, 7, torch.float32, id="n5-T9-K3-C14-H7-fp32"),
    pytest.param(4, 4, 2, 8, 40, torch.bfloat16, id="n4-T4-K2-C8-H40-bf16"),
    pytest.param(0, 3, 2, 4, 8, torch.float32, id="n0-empty"),
]


def _scatter_case(n: int, T: int, K: int, C: int, H: int, dtype: torch.dtype):
    """Source rows, their received-row ids (-1: skipped) and a slot table where every slot is hit at most once."""
    gen = torch.Generator().manual_seed(n * 17 + C)
    src = torch.randn(n, H, generator=gen).to(dtype)
    rows = torch.randperm(T, generator=gen)[:n]
    rows[::3] = -1  # rows of this rank's own tokens are skipped in a gathered chunk
    flat = torch.full((T * K,), -1, dtype=torch.long)
    hits = torch.randperm(T * K, generator=gen)[: min(C, T * K)]
    flat[hits] = torch.randperm(C, generator=gen)[: hits.numel()]
    return src, rows, flat.view(T, K)


@pytest.mark.parametrize(("n", "T", "K", "C", "H", "dtype"), SCATTER_CASES)
def test_triton_scatter_rows_matches_torch(n, T, K, C, H, dtype, device) -> None:
    from moonep.kernels import scatter_rows_triton, zero_rows_from_triton

    src, rows, slots = _scatter_case(n, T, K, C, H, dtype)
    want = torch.zeros(C, H, dtype=dtype)
    scatter_rows(want, src, rows, slots)
    got = torch.full((C, H), 7.0, dtype=dtype, device=device)
    scatter_rows_triton(got, src.to(device), rows.to(device), slots.to(device))
    hit = slots[rows[rows >= 0]]
    written = torch.zeros(C, dtype=torch.bool)
    written[hit[hit >= 0]] = True
    assert torch.equal(got.cpu()[written], want[written])
    assert bool((got.cpu()[~written] == 7).all()), "a slot no row hits was written"
    used = C // 2  # rows from `used` on are zeroed, the others kept
    zero_rows_from_triton(got, torch.tensor(used, device=device))
    assert bool((got.cpu()[used:] == 0).all())
    assert torch.equal(got.cpu()[:used][written[:used]], want[:used][written[:used]])


@pytest.mark.parametrize(
    ("R", "n", "m", "H", "dtype"),
    [
        pytest.param(2, 5, 5, 9, torch.float32, id="R2-n5-m5-H9-fp32"),
        pytest.param(4, 6, 3, 33, torch.bfloat16, id="R4-n6-m3-H33-bf16"),
        pytest.param(3, 2, 0, 8, torch.float32, id="m0-empty"),
    ],
)
def test_triton_sum_ranks_matches_torch(R, n, m, H, dtype, device) -> None:
    from moonep.kernels import sum_ranks_triton

    gen = torch.Generator().manual_seed(R * 7 + n)
    src = torch.randn(R, n, H, generator=gen).to(dtype)
    want = torch.empty(m, H, dtype=dtype)
    sum_ranks(src, want)
    got = torch.empty(m, H, dtype=dtype, device=device)
    sum_ranks_triton(src.to(device), got)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)


@pytest.mark.parametrize(
    ("R", "rank", "n", "m", "H", "weighted", "dtype"),
    [
        pytest.param(2, 0, 5, 5, 9, True, torch.float32, id="R2-rank0-n5-H9-w-fp32"),
        pytest.param(2, 1, 4, 3, 40, True, torch.bfloat16, id="R2-rank1-n4-m3-H40-w-bf16"),
        pytest.param(4, 2, 6, 6, 33, False, torch.bfloat16, id="R4-rank2-n6-H33-bf16"),
        pytest.param(3, 2, 3, 0, 8, True, torch.float32, id="m0-empty"),
    ],
)
def test_reduce_own_and_sum_equals_reduce_then_sum_ranks(R, rank, n, m, H, weighted, dtype, device) -> None:
    """The remote-only combine's fused step gives the same bits as the all-to-all path's two steps, for the
    torch fallback against the torch ops and for the Triton kernel against the two Triton kernels."""
    from moonep.kernels import reduce_own_and_sum_triton, reduce_slots_triton, sum_ranks_triton
    from moonep.ops import reduce_own_and_sum

    K, C = 3, 11
    y, slots, w = _case(n, K, C, H, dtype, device)
    w = w if weighted else None
    gen = torch.Generator().manual_seed(R + n)
    recv = torch.randn(R - 1, n, H, generator=gen).to(dtype).to(device)
    for fused, reduce, summed in (
        (reduce_own_and_sum, reduce_slots, sum_ranks),
        (reduce_own_and_sum_triton, reduce_slots_triton, sum_ranks_triton),
    ):
        on = "cpu" if reduce is reduce_slots else device  # the torch ops on CPU, the kernels on `device`
        y_, slots_, w_, recv_ = (None if t is None else t.to(on) for t in (y, slots, w, recv))
        # All-to-all path: own partial in the wire dtype at this rank's block, then the rank-order sum.
        own = reduce(y_, slots_, w_, dtype)
        want = torch.empty(m, H, dtype=dtype, device=on)
        summed(torch.cat([recv_[:rank], own[None], recv_[rank:]]), want)
        got = torch.empty(m, H, dtype=dtype, device=on)
        fused(y_, slots_, w_, recv_, rank, got)
        assert torch.equal(got, want), f"{fused.__name__}: differs by {(got.float() - want.float()).abs().max()}"


@pytest.mark.parametrize(
    ("R", "S", "K", "P", "balanced"),
    [
        pytest.param(3, 5, 3, 2, True, id="R3-S5-K3-P2-bal"),
        pytest.param(2, 7, 2, 3, False, id="R2-S7-K2-P3-unbal"),
        pytest.param(4, 4, 4, 1, True, id="R4-S4-K4-P1-bal"),
    ],
)
def test_triton_place_hits_matches_torch_handle(R, S, K, P, balanced, device) -> None:
    from moonep.kernels import place_hits_triton
    from moonep.layout import FlatHits, Layout
    from moonep.plan import compute_plan, histogram, occurrence_index

    E = R * P
    gen = torch.Generator().manual_seed(R * 100 + S)
    hot = torch.randint(0, E, (R * S * K,), generator=gen) % max(1, E // 3)  # skewed towards low ids
    expert_T = torch.where(torch.rand(R * S * K, generator=gen) < 0.15, E, hot)  # E: no hit
    weight_T = torch.rand(R * S * K, generator=gen)
    bins = torch.arange(R).repeat_interleave(S * K) * (E + 1) + expert_T
    counts = histogram(bins, R * (E + 1)).view(R, E + 1)[:, :E]
    plan = compute_plan(counts, balanced=balanced)
    C = S * K * (1 if balanced else R)
    occ = occurrence_index(expert_T, E)
    for rank in range(R):
        layout = Layout(R, S, K, E, rank, C, balanced, torch.device("cpu"))
        want = layout.handle(plan, FlatHits(expert_T, weight_T, occ), S)
        on = {k: v.to(device) for k, v in {"e": expert_T, "o": occ, "w": weight_T}.items()}
        dev_plan = compute_plan(counts.to(device), balanced=balanced)
        recv, slot_src, weights = place_hits_triton(dev_plan, rank, on["e"], on["o"], on["w"], C, K)
        assert torch.equal(recv.cpu().view(R * S, K), want.recv_slots_TK), f"rank {rank}: slots"
        assert torch.equal(slot_src.cpu(), want.slot_src_C), f"rank {rank}: slot sources"
        assert torch.equal(weights.cpu(), want.weights_C), f"rank {rank}: weights"


FUSED_CASES = [
    # (R, S, K, P, balanced, routing): routing "skew" sends ~2/3 of hits to the lowest third of the experts
    pytest.param(2, 6, 4, 3, True, "skew", id="R2-S6-K4-P3-bal-skew"),
    pytest.param(3, 5, 3, 2, True, "one", id="R3-S5-K3-P2-bal-one-expert"),
    pytest.param(4, 4, 2, 3, True, "uniform", id="R4-S4-K2-P3-bal-uniform"),
    pytest.param(2, 7, 2, 5, False, "skew", id="R2-S7-K2-P5-unbal-skew"),
    pytest.param(3, 3, 5, 1, True, "skew", id="R3-S3-K5-P1-bal-repeats"),
    pytest.param(1, 5, 3, 4, True, "skew", id="R1-S5-K3-P4-one-rank"),
]


def _gathered(R: int, S: int, K: int, E: int, routing: str, seed: int) -> tuple[torch.Tensor, list]:
    """Layout rows of R ranks (torch `layout_row`), each with fewer tokens than S, some -1 ids."""
    from moonep.layout import layout_row

    gen = torch.Generator().manual_seed(seed)
    rows, routes = [], []
    for r in range(R):
        s = S - r % 2
        if routing == "one":
            idx = torch.full((s, K), E - 1, dtype=torch.long)
        elif routing == "skew":
            idx = torch.where(torch.rand(s, K, generator=gen) < 0.66, torch.randint(0, max(1, E // 3), (s, K)), -1)
            idx = torch.where(idx < 0, torch.randint(-1, E, (s, K), generator=gen), idx)
        else:
            idx = torch.randint(0, E, (s, K), generator=gen)
        w = torch.rand(s, K, generator=gen)
        routes.append((idx, w))
        rows.append(layout_row(idx, w, S, E))
    return torch.stack(rows), routes


@pytest.mark.parametrize(("R", "S", "K", "P", "balanced", "routing"), FUSED_CASES)
def test_fused_planner_equals_torch_planner_and_handle(R, S, K, P, balanced, routing, device) -> None:
    from moonep.fused_plan import layout_row as fused_layout_row
    from moonep.layout import Layout, layout_row
    from moonep.reference import reference_plan

    E = R * P
    gathered, routes = _gathered(R, S, K, E, routing, seed=R * 10 + S)
    for idx, w in routes:  # the one-kernel row equals the torch row
        assert torch.equal(fused_layout_row(idx.to(device), w.to(device), S, E).cpu(), layout_row(idx, w, S, E))
    C = S * K * (1 if balanced else R)
    for rank in range(R):
        torch_layout = Layout(R, S, K, E, rank, C, balanced, torch.device("cpu"), planner="torch")
        fused_layout = Layout(R, S, K, E, rank, C, balanced, torch.device(device), planner="fused")
        want_plan, want_hits = torch_layout.plan(gathered)
        got_plan, got_hits = fused_layout.plan(gathered.to(device))
        for name in [f.name for f in dataclasses.fields(want_plan)]:
            want, got = getattr(want_plan, name), getattr(got_plan, name)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got.cpu(), want), f"rank {rank}: plan.{name}"
            else:
                assert got == want, f"rank {rank}: plan.{name}"
        for name, value in reference_plan(want_plan.counts_RE, balanced=balanced).items():
            assert torch.equal(got_plan.__getattribute__(name).cpu(), value), f"rank {rank}: reference {name}"
        want = torch_layout.handle(want_plan, want_hits, S)
        got = fused_layout.handle(got_plan, got_hits, S)
        for name in ("recv_slots_TK", "slot_src_C", "weights_C", "local_counts_L"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), f"rank {rank}: handle.{name}"
