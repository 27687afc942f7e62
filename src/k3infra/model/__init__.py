"""The K3-style model: its configuration, presets and parameter accounting."""

from k3infra.model.config import PRESETS, K3Config, count_parameters, flops_per_token, preset_names

__all__ = ["PRESETS", "K3Config", "count_parameters", "flops_per_token", "preset_names"]
