"""The planner's optimizer update (`plan.optimizer`): Muon's Newton–Schulz slices counted exactly as the trainer's
Muon counts them, and the update's time split over the GPUs the way the trainer splits it."""

from __future__ import annotations

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM
from k3infra.plan import Layout, TrainWorkload, load_cluster, load_model
from k3infra.plan.comm import train_comm
from k3infra.plan.model import model_from_k3
from k3infra.plan.optimizer import muon_batches, muon_slices, newton_schulz_flops, update_seconds
from k3infra.plan.timing import train_time
from k3infra.train.optim import build_optimizers

K3_WIDTH = {"vocab_size": 32768, "max_position_embeddings": 65536, "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"], "first_k_dense_replace": 0, "n_routed_experts": 32,
            "num_experts_per_tok": 16, "attn_res_block_size": 1}
WORK = TrainWorkload(seq_len=4096, global_batch_tokens=4096 * 64, micro_batch=1)


@pytest.mark.parametrize("name,overrides", [("k3-debug", {}), ("k3-mini", {}), ("k3", K3_WIDTH)])
def test_newton_schulz_count_equals_the_trainers_muon(name, overrides):
    config = K3Config.from_preset(name, **overrides)
    with torch.device("meta"):
        muon = build_optimizers(K3ForCausalLM(config), lr=1e-3)[0]
    spec = model_from_k3(config)
    assert sum(newton_schulz_flops(spec)) == muon.newton_schulz_flops()
    assert sum(c * r * k for c, r, k, _ in muon_slices(spec)) == sum(p.numel() for g in muon.param_groups
                                                                        for p in g["params"])
    assert newton_schulz_flops(spec)[1] > 0  # the routed experts are counted apart


def test_update_is_spread_over_the_group_and_part_of_the_step():
    model, cluster = load_model("k3-mini"), load_cluster("8xH200")
    one = update_seconds(model, Layout(), WORK, load_cluster("1xH200"), efficiency=0.5)
    sharded = update_seconds(model, Layout(dp=8, zero=3), WORK, cluster, efficiency=0.5)
    replicated = update_seconds(model, Layout(dp=8, zero=0), WORK, cluster, efficiency=0.5)
    assert sharded == pytest.approx(one / 8)
    assert one / 8 < replicated < one  # only the dense matrices are repeated on every rank
    adamw = update_seconds(model, Layout(dp=8, zero=3), TrainWorkload(seq_len=4096, global_batch_tokens=4096 * 64,
                                                                       micro_batch=1, optimizer="adamw"),
                           cluster, efficiency=0.5)
    assert adamw < sharded  # no Newton-Schulz
    slower = update_seconds(model, Layout(dp=8, zero=3), WORK, cluster, efficiency=0.25)
    assert slower > sharded

    layout = Layout(dp=8, zero=3)
    comm = train_comm(model, layout, WORK, cluster, 64 // 8)
    t = train_time(model, layout, WORK, cluster, 64 // 8, comm, efficiency=0.5)
    assert t["update_s"] == pytest.approx(sharded)
    assert t["step_s"] == pytest.approx(t["compute_s"] + t["bubble_s"] + t["exposed_comm_s"] + t["update_s"])


@pytest.mark.parametrize("name,overrides", [("k3-debug", {}), ("k3-mini", {}), ("k3", K3_WIDTH)])
def test_executed_count_takes_the_trainers_batches_and_symmetric_rule(name, overrides):
    from benchmarks.train.newton_schulz import slice_groups
    from k3infra.train.optim import takes_symmetric_products

    spec = model_from_k3(K3Config.from_preset(name, **overrides))
    groups = slice_groups(name, overrides)
    assert muon_batches(spec) == groups
    expected = 0.0
    for (rows, cols), count in groups.items():
        a, b = sorted((rows, cols))
        t = -(-a // 128)
        lower = t * (t + 1) / (2 * t * t) if takes_symmetric_products(torch.Size([count, rows, cols])) else 1.0
        expected += 5 * count * (2 * a * a * b * (1 + lower) + 2 * a ** 3 * lower)
    assert sum(newton_schulz_flops(spec, executed=True)) == pytest.approx(expected, rel=1e-12)
    if name == "k3":  # the expert stacks take the symmetric products: 212.7 of the plain 307.6 TFLOP
        assert sum(newton_schulz_flops(spec, executed=True)) / 1e12 == pytest.approx(212.7, abs=0.1)
        assert sum(newton_schulz_flops(spec)) / 1e12 == pytest.approx(307.6, abs=0.1)
    else:  # no k3-debug batch is large enough; k3-mini has one (34 x 1,024 x 1,024)
        saved = sum(newton_schulz_flops(spec)) - sum(newton_schulz_flops(spec, executed=True))
        assert (saved > 0) == (name == "k3-mini")
