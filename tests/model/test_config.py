import pytest

from k3infra.model import K3Config, count_parameters, preset_names


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    [
        ("k3", 2_779_484_393_568, 104_189_530_208),
        ("k3-mini", 1_007_011_552, 193_316_576),
        ("k3-debug", 459_974, 255_174),
    ],
)
def test_preset_parameter_counts_match_k3_model_reference(preset, total, active):
    assert count_parameters(K3Config.from_preset(preset)) == (total, active)


def test_k3_layer_pattern_is_three_kda_to_one_mla_with_trailing_mla():
    config = K3Config.from_preset("k3")
    assert len(config.kda_layers) == 69 and len(config.mla_layers) == 24
    assert config.mla_layers[-2:] == [91, 92]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_experts_per_tok": 32}, "num_experts_per_tok"),
        ({"kda_backend": "cuda"}, "kda_backend"),
        ({"layer_types": ["linear_attention"]}, "layer_types"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        K3Config.from_preset("k3-debug", **overrides)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="k3-debug"):
        K3Config.from_preset("k4")
    assert preset_names() == ("k3", "k3-mini", "k3-debug")
