"""Meta-device builds with exact parameter totals, and clear errors for bad inputs."""

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM, count_parameters
from k3infra.model.moe import K3MoE


def _active_from_modules(model: K3ForCausalLM) -> int:
    total = sum(p.numel() for p in model.parameters())
    routed = 0
    for moe in model.moe_layers():
        per_expert = sum(w.numel() for w in (moe.w1, moe.w3, moe.w2)) // moe.num_experts
        routed += (moe.num_experts - moe.top_k) * per_expert
    return total - routed - model.model.embed_tokens.weight.numel()


@pytest.mark.parametrize("preset", ["k3-debug", "k3-mini", "k3"])
def test_meta_build_counts(preset):
    config = K3Config.from_preset(preset)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    total, active = count_parameters(config)
    assert sum(p.numel() for p in model.parameters()) == total
    assert _active_from_modules(model) == active
    assert all(p.device.type == "meta" for p in model.parameters())
    if preset == "k3":
        assert total == 2_779_484_393_568
        assert len(model.moe_layers()) == 92 and all(isinstance(m, K3MoE) for m in model.moe_layers())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.from_preset("k3-debug")).eval()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        pytest.param(dict(input_ids=torch.zeros(1, 4)), TypeError, "input_ids", id="float-ids"),
        pytest.param(dict(input_ids=torch.zeros(4, dtype=torch.long)), ValueError, "input_ids", id="1d-ids"),
        pytest.param(dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "T >= 1", id="empty"),
        pytest.param(dict(input_ids=torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4],
                     dtype=torch.int32)), ValueError, "B == 1", id="cu-seqlens-batch"),
        pytest.param(dict(input_ids=torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 3],
                     dtype=torch.int32)), ValueError, "cu_seqlens", id="cu-seqlens-total"),
        pytest.param(dict(input_ids=torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0., 4.])),
                     ValueError, "cu_seqlens", id="cu-seqlens-dtype"),
        pytest.param(dict(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 3, dtype=torch.long)),
                     ValueError, "labels", id="labels-shape"),
        pytest.param(dict(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 5)),
                     ValueError, "attention_mask", id="mask-shape"),
        pytest.param(dict(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1]])),
                     ValueError, "padding", id="mask-padding"),
        pytest.param(dict(input_ids=torch.zeros(1, 4, dtype=torch.long), cache=object()), TypeError, "cache",
                     id="cache-type"),
    ],
)
def test_bad_inputs(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        model(**kwargs)


def test_token_ids_out_of_range(model):
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[0, 512]]))


def test_kernel_backend_on_cpu_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would run the kernels on CPU
    model = K3ForCausalLM(K3Config.from_preset("k3-debug", kda_backend="flashkda"))
    with pytest.raises(ValueError, match="kda_backend"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_expert_parallel_needs_distributed(model):
    with pytest.raises(ValueError, match="torch.distributed"):
        model.enable_expert_parallel(None, max_tokens_per_rank=8)
