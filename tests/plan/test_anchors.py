"""Formula-level anchors from K3_MODEL.md §5 (derived, not tuned): cache, state, activations, states, weights."""

from __future__ import annotations

import math

import pytest

from k3infra.plan import Layout, TrainWorkload, load_model, train_memory
from k3infra.plan.memory import cache_per_token, kda_state_bytes, layer_activation, weight_bytes

K3 = load_model("k3")
MINI = load_model("k3-mini")


def test_mla_cache_bytes_per_token():
    assert cache_per_token(K3, "bf16") == 27_648
    assert round(cache_per_token(K3) * 2**20 / 1e9, 1) == 29.0  # per 1M tokens
    assert cache_per_token(K3, "fp8") == 27_648 / 2


def test_kda_state_per_sequence():
    recurrent, conv = kda_state_bytes(K3)
    assert recurrent == 69 * 96 * 128**2 * 4
    assert round(recurrent / 1e6) == 434
    assert round(conv / 1e6) == 15
    # MLA cache equals the KDA state at ≈16K tokens.
    assert round((recurrent + conv) / cache_per_token(K3) / 1024) == 16


@pytest.mark.parametrize(
    "layer, policy, kb",
    [
        pytest.param(1, "none", 373 + 622, id="KDA+MoE"),
        pytest.param(3, "none", 234 + 622, id="MLA+MoE"),
        pytest.param(1, "full", 14.3, id="full-recompute"),
    ],
)
def test_saved_activation_per_layer(layer, policy, kb):
    assert layer_activation(K3, layer, policy) / 1e3 == pytest.approx(kb, abs=1.0)


def test_memory_efficient_moe_saves_3km_instead_of_k_2l_3m():
    e = K3.moe
    saved = layer_activation(K3, 3, "none") - layer_activation(K3, 3, "selective")
    mla_qk = 2 * 2 * K3.mla.heads * (K3.mla.nope + K3.mla.rope)
    assert saved - mla_qk == 2 * e.top_k * 2 * e.latent  # 622 KB → 393 KB per token


def test_whole_stack_activations():
    naive = sum(layer_activation(K3, i, "none") for i in range(len(K3.layers)))
    assert round(naive / 1e6, 1) == 88.8
    assert round(sum(layer_activation(K3, i, "full") for i in range(93)) / 1e6, 2) == 1.33


@pytest.mark.parametrize("optimizer, gb", [("muon", 14.1), ("adamw", 18.1)])
def test_k3_mini_states_on_one_gpu(optimizer, gb):
    work = TrainWorkload(seq_len=4096, global_batch_tokens=4096, optimizer=optimizer)
    mem = train_memory(MINI, Layout(zero=0), work, 1)
    assert round((mem["weights"] + mem["gradients"] + mem["optimizer"]) / 1e9, 1) == gb


def test_k3_mini_activations_8x4096():
    work = TrainWorkload(seq_len=4096, global_batch_tokens=8 * 4096, micro_batch=8)
    mem = train_memory(MINI, Layout(zero=0), work, 1)
    assert mem["activations"] / 1e9 == pytest.approx(35, rel=0.02)


def test_k3_training_states_whole_model():
    total = K3.count()[0]
    assert round(total * 14 / 1e12, 1) == 38.9  # Muon
    assert round(total * 18 / 1e12, 1) == 50.0  # AdamW


def test_k3_serving_weights():
    assert round(weight_bytes(K3) / 1e12, 2) == 5.56
    assert round(weight_bytes(K3, "mxfp4") / 1e12, 2) == 1.56
    assert round(weight_bytes(K3, "int4", "int4") / 1e12, 1) == 1.4  # "≈1.4 TB after low-precision quantization"
    assert math.ceil(weight_bytes(K3, "fp8", "fp8") / 288e9) == 10  # "≥10 GB300-class GPUs to load"


def test_deepseek_v3_published_layout_fits_h800():
    """DeepSeek-V3: PP16 × EP64 × ZeRO-1 DP on 2048 H800 without TP, FP8, seq 4K, 15,360 sequences per step."""
    from k3infra.plan import SearchOptions, load_cluster, plan_train

    work = TrainWorkload(seq_len=4096, global_batch_tokens=4096 * 15360, precision="fp8", optimizer="adamw")
    opts = SearchOptions(tp=(1,), pp=(16,), ep=(64,), zero=(1,), cp=(1,), vp=(1,), recompute=("selective",),
                         overlap="all")  # fmt: skip
    result = plan_train(load_model("deepseek-v3"), load_cluster("2048xH800"), work, opts)
    assert result.best is not None and result.best.layout.dp == 128 and result.best.micro_batches == 120


def test_k3_layout_sketch_within_ten_percent():
    """K3_MODEL.md §5 sketch: 64 nodes, PP16 VP3, EP32, DP32, full recompute at 8K tokens ≈ 114 GB of 141."""
    from k3infra.plan import SearchOptions, load_cluster, plan_train

    work = TrainWorkload(seq_len=8192, global_batch_tokens=8192 * 1024)
    opts = SearchOptions(tp=(1,), pp=(16,), vp=(3,), ep=(32,), cp=(1,), zero=(2,), redundant=(28,),
                         recompute=("full",))  # fmt: skip
    plan = plan_train(load_model("k3"), load_cluster("512xH200"), work, opts).plans[0]
    assert plan.memory["moonep_prefetch"] / 1e9 == pytest.approx(1.85, abs=0.01)
    assert plan.memory["ep_buffer"] / 1e9 == pytest.approx(0.94, abs=0.01)
    assert plan.peak / 1e9 == pytest.approx(114, rel=0.1)
