"""Parameter counts (and K3 buffer bytes) of the planner's model descriptions equal the instantiated models'
(meta device)."""

from __future__ import annotations

import json

import pytest
import torch

import k3infra.model
from k3infra.model.config import K3Config, count_parameters, preset_names
from k3infra.plan.memory import buffer_bytes
from k3infra.plan.model import SHIPPED, load_model

HF_CASES = [
    pytest.param("deepseek-v3", "DeepseekV3", 671_026_404_352, id="deepseek-v3"),
    pytest.param("kimi-k2", "DeepseekV3", None, id="kimi-k2"),
    pytest.param("qwen3-30b-a3b", "Qwen3Moe", None, id="qwen3-30b-a3b"),
    pytest.param("qwen3-235b-a22b", "Qwen3Moe", None, id="qwen3-235b-a22b"),
]


def _meta_count(module: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in module.parameters())
    experts = sum(p.numel() for n, p in module.named_parameters() if ".mlp.experts." in n)
    return total, experts


@pytest.mark.parametrize("name, family, published", HF_CASES)
def test_transformers_config_counts_equal_meta_model(name, family, published):
    import transformers

    raw = json.loads((SHIPPED / f"{name}.json").read_text())
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    config = getattr(transformers, f"{family}Config")(**kwargs)
    with torch.device("meta"):
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    total, experts = _meta_count(model)
    spec_total, spec_experts, _ = load_model(name).count()
    assert (spec_total, spec_experts) == (total, experts)
    if published is not None:
        assert spec_total == published


@pytest.mark.parametrize("name", preset_names())
def test_k3_presets_equal_count_parameters(name):
    total, active = count_parameters(K3Config.from_preset(name))
    spec_total, _, spec_active = load_model(name).count()
    assert (spec_total, spec_active) == (total, active)


@pytest.mark.skipif(not hasattr(k3infra.model, "K3ForCausalLM"), reason="K3ForCausalLM not on this branch")
@pytest.mark.parametrize("name", preset_names())
def test_k3_presets_equal_meta_module(name):
    from k3infra.model import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.from_preset(name))
    assert sum(p.numel() for p in model.parameters()) == load_model(name).count()[0]
    spec = load_model(name)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffers == buffer_bytes(spec, tuple(range(len(spec.layers))))


def test_k3_config_json_matches_preset(tmp_path):
    path = tmp_path / "config.json"
    K3Config.from_preset("k3-mini").to_json_file(path)
    assert load_model(str(path)).count() == load_model("k3-mini").count()


def test_published_totals():
    """Rounded public totals: K3 2.78T / 104.2B active, Kimi K2 ≈1.03T, Qwen3 30.5B / 235B."""
    assert round(load_model("k3").count()[0] / 1e12, 2) == 2.78
    assert round(load_model("k3").count()[2] / 1e9, 1) == 104.2
    assert round(load_model("kimi-k2").count()[0] / 1e12, 2) == 1.03
    assert round(load_model("qwen3-30b-a3b").count()[0] / 1e9, 1) == 30.5
    assert round(load_model("qwen3-235b-a22b").count()[0] / 1e9) == 235
