"""The K3-style model: configuration, presets, parameter accounting and the transformers models.

``register()`` makes ``AutoConfig`` / ``AutoModelForCausalLM`` know ``model_type="k3"``.
"""

from k3infra.model.cache import K3Cache
from k3infra.model.config import PRESETS, K3Config, count_parameters, flops_per_token, preset_names
from k3infra.model.modeling import K3ForCausalLM, K3Model, K3PreTrainedModel

__all__ = [
    "PRESETS",
    "K3Cache",
    "K3Config",
    "K3ForCausalLM",
    "K3Model",
    "K3PreTrainedModel",
    "count_parameters",
    "flops_per_token",
    "preset_names",
    "register",
]


def register() -> None:
    """Register `K3Config` and `K3ForCausalLM` with transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    try:
        AutoConfig.register("k3", K3Config)
    except ValueError:
        pass  # already registered
    for auto, cls in ((AutoModel, K3Model), (AutoModelForCausalLM, K3ForCausalLM)):
        try:
            auto.register(K3Config, cls)
        except ValueError:
            pass
