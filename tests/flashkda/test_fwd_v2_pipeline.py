"""The segmented v2 forward (K1 of a segment overlapped with K2 of the previous one): the segment plan, and the
orchestration with the torch emulation standing in for the kernels against the unsegmented emulation (CPU); the
Gluon kernels segmented against one segment (``gpu``)."""

import random

import pytest
import torch

from flashkda.fwd.v2 import pipeline
from flashkda.fwd.v2.chunk_fwd import _plan
from flashkda.fwd.v2.emulate import emulate_chunk_kda, emulate_prepare, emulate_recurrence
from flashkda.fwd.v2.emulate32 import emulate_chunk_kda32, emulate_prepare32
from flashkda.fwd.v2.pipeline import (
    auto_segments,
    build_segment_plan,
    cached_segment_plan,
    default_segments,
    plan_segments,
    segmented_forward,
)
from flashkda.fwd.v2.workspace import CHUNK, build_chunk_layout
from tests.flashkda.test_fwd_v2 import make_inputs

K = 128
CPU = torch.device("cpu")


def cu_of(lengths):
    return [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()]


def check_plan(cu, P, chunk=CHUNK):
    """Every invariant of ``plan_segments(cu, P, chunk)``; returns the plan."""
    plan = plan_segments(cu, P, chunk)
    N, total = len(cu) - 1, cu[-1]
    assert 1 <= len(plan) <= P
    assert plan[0].start == 0 and plan[-1].end == total
    seen = [0] * N
    for i, seg in enumerate(plan):
        if i:
            assert seg.start == plan[i - 1].end and seg.start < seg.end
            # a cut inside a sequence sits on a chunk multiple of it, and hands that sequence's state over
            inside = [n for n in range(N) if cu[n] < seg.start < cu[n + 1]]
            assert seg.continues == bool(inside)
            if inside:
                n = inside[0]
                assert (seg.start - cu[n]) % chunk == 0
                assert seg.seq_lo == n == plan[i - 1].seq_hi - 1
            else:
                assert seg.seq_lo == plan[i - 1].seq_hi
        assert len(seg.lengths) == seg.seq_hi - seg.seq_lo and sum(seg.lengths) == seg.end - seg.start
        for n, length in zip(range(seg.seq_lo, seg.seq_hi), seg.lengths):
            assert length == min(cu[n + 1], seg.end) - max(cu[n], seg.start) >= 0
            seen[n] += 1
    assert plan[0].seq_lo == 0 and plan[-1].seq_hi == N
    # every sequence once, and twice or more only when it crosses a cut
    for n in range(N):
        crossings = sum(cu[n] < seg.start < cu[n + 1] for seg in plan[1:])
        assert seen[n] == 1 + crossings, n
    return plan


def test_fixed_length_cuts_are_equal():
    plan = check_plan([0, 8192], 4)
    assert [(s.start, s.end, s.lengths, s.continues) for s in plan] == [
        (0, 2048, (2048,), False), (2048, 4096, (2048,), True), (4096, 6144, (2048,), True),
        (6144, 8192, (2048,), True)]


def test_cuts_snap_to_chunks_and_merge():
    assert [(s.start, s.end) for s in check_plan([0, 100], 3)] == [(0, 32), (32, 64), (64, 100)]
    assert [(s.start, s.end) for s in check_plan([0, 20], 8)] == [(0, 16), (16, 20)]
    assert [(s.start, s.end) for s in check_plan([0, 5], 4)] == [(0, 5)]
    empty = check_plan([0, 0, 0], 3)
    assert len(empty) == 1 and empty[0].lengths == (0, 0)


def test_batch_of_fixed_sequences_crosses_boundaries():
    plan = check_plan([0, 100, 200], 3)
    assert [(s.start, s.end, s.seq_lo, s.seq_hi, s.lengths) for s in plan] == [
        (0, 64, 0, 1, (64,)), (64, 132, 0, 2, (36, 32)), (132, 200, 1, 2, (68,))]


def test_empty_and_one_token_sequences_belong_to_one_segment():
    plan = check_plan(cu_of((0, 40, 0, 1, 0, 40, 0)), 2)
    assert [(s.seq_lo, s.seq_hi, s.lengths) for s in plan] == [(0, 2, (0, 40)), (2, 7, (0, 1, 0, 40, 0))]


@pytest.mark.parametrize("seed", range(4))
def test_random_varlen_plans(seed):
    rng = random.Random(seed)
    for _ in range(50):
        lengths = [rng.choice([0, 1, 15, 16, 17, 31, 33, rng.randint(0, 300)]) for _ in range(rng.randint(1, 9))]
        check_plan(cu_of(lengths), rng.randint(1, 9), rng.choice([16, 32]))


def test_chunk32_cuts():
    assert [(s.start, s.end) for s in check_plan([0, 100], 3, 32)] == [(0, 32), (32, 64), (64, 100)]
    assert [(s.start, s.end) for s in check_plan([0, 8192], 4, 32)] == [(0, 2048), (2048, 4096), (4096, 6144),
                                                                        (6144, 8192)]
    assert [(s.start, s.end) for s in check_plan([0, 40], 4, 32)] == [(0, 32), (32, 40)]


def test_default_rule_and_bad_arguments():
    assert [default_segments(t) for t in (0, 2047, 4096, 8192, 32768, 131072)] == [1, 1, 2, 4, 16, 16]
    with pytest.raises(ValueError, match="num_segments"):
        plan_segments([0, 10], 0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        plan_segments([0, 10, 5], 2)
    with pytest.raises(ValueError, match="segments"):
        _plan(1, 64, 1, None, None, True, CPU, 16)
    with pytest.raises(ValueError, match="segments"):
        _plan(1, 64, 1, None, None, 0, CPU, 16)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        _plan(1, 64, 1, torch.tensor([0, 64]), torch.tensor([0, 32, 64]), 2, CPU, 16)
    with pytest.raises(ValueError, match="past the"):
        _plan(1, 64, 1, torch.tensor([0, 80]), None, 2, CPU, 16)
    for chunk in (16, 32):
        cu, plan = _plan(1, 8192, 64, None, None, None, CPU, chunk, num_sms=132)
        assert cu == [0, 8192] and list(plan.segments) == plan_segments([0, 8192], 4, chunk)
        assert plan.chunk == chunk and all(layout.chunk == chunk for layout in plan.layouts)
    assert _plan(1, 8192, 64, None, None, 1, CPU, 16) == (None, None)
    assert _plan(1, 1024, 64, None, None, 4, CPU, 16)[1] is not None  # an explicit P is taken as asked


def test_auto_segments_rule():
    # one chain per (sequence, head, half of V): split while they take at most two per SM
    assert auto_segments(8192, 1, 64, 132) == 4
    assert auto_segments(8192, 1, 96, 132) == 4  # 192 chains on 132 SMs
    assert auto_segments(131072, 1, 32, 132) == 16 and auto_segments(32768, 1, 64, 132) == 16
    assert auto_segments(2048, 1, 64, 132) == 1  # one segment's worth of tokens
    assert auto_segments(8192, 8, 64, 132) == 1  # varlen 1k x 8: 1024 chains, K2 throughput-bound
    assert auto_segments(8192, 6, 64, 132) == 1 and auto_segments(8192, 2, 64, 132) == 4
    # a varlen call the rule keeps unsegmented never reads cu_seqlens on the host (no cu_seqlens_cpu given)
    cu = torch.tensor(cu_of((1024,) * 8))
    assert _plan(1, 8192, 64, cu, None, None, CPU, 16, num_sms=132) == (None, None)


def test_segment_plan_is_cached(monkeypatch):
    built = []
    real = pipeline.build_chunk_layout
    monkeypatch.setattr(pipeline, "build_chunk_layout", lambda *a, **k: built.append(a) or real(*a, **k))
    pipeline._PLANS.clear()
    lengths = (1300, 547, 2048, 963, 271, 3063)
    cu_list = cu_of(lengths)
    first = cached_segment_plan(1, sum(lengths), cu_list, torch.tensor(cu_list), 4, CPU, 16)
    n = len(built)
    assert 1 <= n <= 4 and sum(layout.num_chunks for layout in first.layouts) == first.tile_rows
    assert first.tile_offsets == tuple(sum(lay.num_chunks for lay in first.layouts[:i]) for i in range(len(first)))
    # a new cu_seqlens tensor with the same values (and an inference one) reuses the plan: no layout is built
    with torch.inference_mode():
        again = cached_segment_plan(1, sum(lengths), list(cu_list), torch.tensor(cu_list), 4, CPU, 16)
    assert again is first and len(built) == n
    # fixed length: one layout serves the four equal segments
    fixed = cached_segment_plan(1, 8192, None, None, 4, CPU, 32)
    assert len(built) == n + 1 and len({id(lay) for lay in fixed.layouts}) == 1
    assert cached_segment_plan(1, 8192, None, None, 4, CPU, 32) is fixed and len(built) == n + 1
    assert cached_segment_plan(1, 8192, None, None, 4, CPU, 16) is not fixed


def emulated_prepare(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws):
    out = emulate_prepare(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias)
    for name in ("kd", "qd", "kr", "inv", "mqk", "glast", "beta"):
        getattr(ws, name).copy_(getattr(out, name))


def emulated_recurrence(ws, v, o, h0, ht, order):
    out, state = emulate_recurrence(ws, v, h0, True)
    o.copy_(out)
    ht.copy_(state)


def emulated_prepare32(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws):
    out = emulate_prepare32(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias)
    for name in ("kd", "qd", "kr", "inv", "mqk", "glast", "beta"):
        getattr(ws, name).copy_(getattr(out, name))


def run_segmented(B, T, H, cu, P, init=True, seed=0, HV=None, chunk=CHUNK, cached=False):
    N = B if cu is None else len(cu) - 1
    q, k, v, g, beta, A_log, dt_bias, h0 = make_inputs(B, T, H, N, seed, init, HV=HV)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    host = [b * T for b in range(B + 1)] if cu is None else list(cu)
    if cached:
        plan = cached_segment_plan(B, T, None if cu is None else host, cu_t, P, CPU, chunk)
    else:
        plan = build_segment_plan(host, plan_segments(host, P, chunk), cu_t, T, CPU, chunk)
    prep = emulated_prepare if chunk == CHUNK else emulated_prepare32
    o, s = segmented_forward(q, k, v, g, beta, K**-0.5, -5.0, A_log, dt_bias, h0, True, host, cu_t, plan,
                             prepare=prep, recurrence=emulated_recurrence)
    emulate = emulate_chunk_kda if chunk == CHUNK else emulate_chunk_kda32
    ro, rs = emulate(q, k, v, g, beta, K**-0.5, build_chunk_layout(B, T, cu_t, CPU, chunk), -5.0, A_log,
                     dt_bias, h0, True)
    return plan.segments, (o, s), (ro, rs)


@pytest.mark.parametrize(
    "B, T, H, cu, P, init",
    [(1, 200, 2, None, 3, True), (2, 100, 1, None, 3, True), (1, 260, 1, (0, 0, 1, 50, 51, 200, 260), 4, False),
     (1, 130, 1, (0, 1, 130), 5, True), (3, 40, 1, None, 4, False)],
    ids=["fixed-T200-P3", "fixed-B2-crossing", "varlen-empty-1tok-crossing", "varlen-long-tail", "fixed-B3-P4"],
)
def test_segmented_emulation_equals_unsegmented(B, T, H, cu, P, init):
    plan, (o, s), (ro, rs) = run_segmented(B, T, H, cu, P, init)
    assert len(plan) > 1 and any(seg.continues for seg in plan)
    n = (B * T if cu is None else cu[-1])
    assert torch.equal(o.reshape(B * T, -1)[:n], ro.reshape(B * T, -1)[:n])
    assert ((s - rs).norm() / rs.norm()).item() < 1e-6


def test_segmented_emulation_gva():
    _, (o, s), (ro, rs) = run_segmented(1, 96, 1, (0, 40, 96), 3, HV=2, seed=5)
    assert torch.equal(o, ro)
    assert ((s - rs).norm() / rs.norm()).item() < 1e-6


@pytest.mark.parametrize(
    "B, T, H, cu, P, init",
    [(1, 200, 2, None, 3, True), (2, 100, 1, None, 3, True), (1, 300, 1, (0, 0, 1, 70, 71, 230, 300), 4, False),
     (3, 70, 1, None, 4, True)],
    ids=["fixed-T200-P3", "fixed-B2-crossing", "varlen-empty-1tok-crossing", "fixed-B3-P4"],
)
def test_segmented_emulation_chunk32_equals_unsegmented(B, T, H, cu, P, init):
    plan, (o, s), (ro, rs) = run_segmented(B, T, H, cu, P, init, seed=3, chunk=32, cached=True)
    assert len(plan) > 1 and any(seg.continues for seg in plan)
    assert all((seg.start - max(c for c in ([b * T for b in range(B + 1)] if cu is None else cu)
                                if c <= seg.start)) % 32 == 0 for seg in plan if seg.continues)
    n = (B * T if cu is None else cu[-1])
    assert torch.equal(o.reshape(B * T, -1)[:n], ro.reshape(B * T, -1)[:n])
    assert ((s - rs).norm() / rs.norm()).item() < 1e-6


gpu = pytest.mark.gpu


def _gpu_inputs(B, T, H, N, seed=0):
    return [None if x is None else x.cuda() for x in make_inputs(B, T, H, N, seed)]


def _v2(x, P, cu=None, cu_cpu=None, side=True, chunk=16):
    from flashkda.fwd.v2 import chunk_kda_fwd_v2

    q, k, v, g, beta, A_log, dt_bias, h0 = x
    return chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, h0, True, True, True, True, lower_bound=-5.0,
                            cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias, cu_seqlens_cpu=cu_cpu, segments=P,
                            recurrence_on_side=side, chunk_size=chunk)[:2]


def _rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


@gpu
@pytest.mark.parametrize("B, T, H, lengths, P", [(1, 4096, 4, None, 4), (2, 1000, 2, None, 3),
                                                  (1, 3000, 2, (1300, 0, 1, 547, 1152), 4)],
                         ids=["fixed-T4096-P4", "fixed-B2-P3", "varlen-P4"])
@pytest.mark.parametrize("side", [True, False], ids=["k2-side", "k1-side"])
@pytest.mark.parametrize("chunk", [16, 32], ids=["c16", "c32"])
def test_segmented_v2_matches_one_segment(B, T, H, lengths, P, side, chunk):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cu_cpu = None if lengths is None else torch.tensor(cu_of(lengths), dtype=torch.int64)
    N = B if lengths is None else len(lengths)
    x = _gpu_inputs(B, T, H, N)
    cu = None if cu_cpu is None else cu_cpu.cuda()
    o1, s1 = _v2(x, 1, cu, cu_cpu, chunk=chunk)
    oP, sP = _v2(x, P, cu, cu_cpu, side, chunk)
    torch.cuda.synchronize()
    n = B * T if lengths is None else sum(lengths)
    assert _rms(oP.reshape(B * T, -1)[:n], o1.reshape(B * T, -1)[:n]) < 2e-3
    assert _rms(sP, s1) < 1e-3


@gpu
def test_segmented_v2_captures_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lengths = (1300, 547, 2048, 963)
    cu_cpu = torch.tensor(cu_of(lengths), dtype=torch.int64)
    cu = cu_cpu.cuda()
    x = _gpu_inputs(1, sum(lengths), 2, len(lengths), seed=2)
    o_ref, s_ref = _v2(x, 4, cu, cu_cpu)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _v2(x, 4, cu, cu_cpu)  # warm-up outside the capture (compiles the kernels)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = _v2(x, 4, cu, cu_cpu)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
