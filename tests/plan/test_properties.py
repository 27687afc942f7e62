"""Monotonicity and consistency of the planner's memory, traffic and time."""

from __future__ import annotations

import pytest

from k3infra.model.config import K3Config, flops_per_token
from k3infra.plan import (
    Layout,
    SearchOptions,
    ServeWorkload,
    TrainWorkload,
    load_cluster,
    load_model,
    plan_serve,
    plan_train,
    serve_memory,
    train_memory,
)  # fmt: skip
from k3infra.plan.comm import train_comm
from k3infra.plan.memory import stages
from k3infra.plan.timing import model_flops_per_token

MODELS = [pytest.param(name, id=name) for name in ("k3-mini", "k3", "deepseek-v3", "qwen3-30b-a3b")]
WORK = TrainWorkload(seq_len=8192, global_batch_tokens=8192 * 64, micro_batch=1)
LAYOUTS = [
    Layout(),
    Layout(tp=2, ep=8, pp=4, dp=8, zero=1),
    Layout(tp=8, ep=16, pp=4, vp=2, cp=2, dp=4, zero=2, redundant=4),
    Layout(tp=1, ep=64, pp=2, cp=1, dp=64, zero=3),
]


def _valid(model, layout):
    return not model.moe or model.moe.experts % layout.ep == 0


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.label())
def test_more_recompute_never_raises_memory(name, layout):
    model = load_model(name)
    if not _valid(model, layout):
        pytest.skip("EP does not divide the experts")
    m = WORK.sequences // (layout.dp * WORK.micro_batch)
    peaks = [train_memory(model, Layout(**{**layout.__dict__, "recompute": r}), WORK, m) for r in
             ("none", "selective", "full")]  # fmt: skip
    assert peaks[0]["activations"] >= peaks[1]["activations"] >= peaks[2]["activations"]
    assert peaks[0]["total"] >= peaks[1]["total"] >= peaks[2]["total"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_more_dp_never_raises_per_gpu_weights_or_states(name, zero):
    model = load_model(name)
    previous = None
    for dp in (1, 2, 4, 8, 16):
        work = TrainWorkload(seq_len=4096, global_batch_tokens=4096 * 16)
        mem = train_memory(model, Layout(dp=dp, zero=zero), work, 16 // dp)
        states = mem["weights"] + mem["gradients"] + mem["optimizer"]
        if previous:
            assert mem["weights"] <= previous[0] and states <= previous[1]
        previous = (mem["weights"], states)


@pytest.mark.parametrize("name", MODELS)
def test_more_ep_never_raises_expert_weights(name):
    model = load_model(name)
    _, experts_total, _ = model.count()
    previous = None
    for ep in (1, 2, 4, 8, 16, 32, 64):
        mem = train_memory(model, Layout(ep=ep, dp=64, zero=0), WORK, 1)
        if previous is not None:
            assert mem["weights"] <= previous
        previous = mem["weights"]
    # Expert weights shrink exactly by EP: the difference between EP 1 and EP 64 is 63/64 of the experts.
    one = train_memory(model, Layout(ep=1, dp=64, zero=0), WORK, 1)["weights"]
    assert one - previous == pytest.approx(2 * experts_total * (1 - 1 / 64), rel=1e-9)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", [Layout(), Layout(tp=8, ep=8, pp=2), Layout(tp=4, ep=8, cp=2, pp=2)],
                         ids=lambda x: x.label())  # fmt: skip
def test_longer_context_never_lowers_serving_memory(name, layout):
    model = load_model(name)
    previous = 0.0
    for context in (1024, 4096, 16384, 65536, 1 << 20):
        total = serve_memory(model, layout, ServeWorkload(context=context, concurrency=4))["total"]
        assert total >= previous
        previous = total


def test_terms_sum_to_total_and_stage_split_covers_every_layer():
    model = load_model("k3")
    for pp, vp in ((1, 1), (4, 3), (16, 3), (31, 3)):
        held = sorted(i for s in stages(93, pp, vp) for i in s.layers)
        assert held == list(range(93))
    mem = train_memory(model, LAYOUTS[2], WORK, 32)
    assert sum(v for k, v in mem.items() if k not in ("total", "stage")) == pytest.approx(mem["total"])


def test_single_gpu_has_no_traffic_and_ep_traffic_leaves_the_node_only_past_8():
    model = load_model("k3-mini")
    cluster = load_cluster("64xH200")
    assert train_comm(model, Layout(), WORK, load_cluster("1xH200"), 64) == {}
    inside = train_comm(model, Layout(ep=8, dp=64), WORK, cluster, 1)["ep_all_to_all"]
    across = train_comm(model, Layout(ep=64, dp=64), WORK, cluster, 1)["ep_all_to_all"]
    assert inside["network"] == 0 and inside["nvlink"] > 0
    assert across["network"] > across["nvlink"] > 0


@pytest.mark.parametrize("name", ["k3", "k3-mini", "k3-debug"])
@pytest.mark.parametrize("seq", [4096, 65536])
def test_flops_agree_with_config(name, seq):
    assert sum(model_flops_per_token(load_model(name), seq)) == pytest.approx(
        flops_per_token(K3Config.from_preset(name), seq), rel=1e-12
    )


def test_plans_are_ranked_by_step_time_and_all_fit():
    result = plan_train(load_model("k3-mini"), load_cluster("8xH200"), WORK, SearchOptions(vp=(1, 2)))
    feasible = result.feasible
    assert feasible and all(p.peak <= result.usable for p in feasible)
    times = [p.time["step_s"] for p in feasible]
    assert times == sorted(times)
    assert all(p.layout.world == 8 for p in result.plans)


def test_serving_ranked_by_throughput():
    result = plan_serve(load_model("k3-mini"), load_cluster("8xH200"), ServeWorkload(context=65536, concurrency=32))
    rates = [p.time["decode_tokens_per_s"] for p in result.feasible]
    assert rates and rates == sorted(rates, reverse=True)
