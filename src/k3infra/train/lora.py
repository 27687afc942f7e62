"""LoRA fine-tuning through `peft`, with the router frozen (K3's guidance for fine-tuning).

Adapters go on the attention and expert projections (every `nn.Linear` except the router, ``lm_head`` and the
embedding); the base model, router included, is frozen. With ``router_lr_scale > 0`` the router weights stay
trainable at that fraction of the learning rate instead.
"""

from __future__ import annotations

from torch import nn

from k3infra.train.optim import ADAMW_NAME_PARTS


def lora_targets(model: nn.Module) -> list[str]:
    """Names of the `nn.Linear` modules that receive adapters (router, embeddings and ``lm_head`` excluded)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not any(part in name for part in ADAMW_NAME_PARTS)]


def apply_lora(model: nn.Module, *, rank: int, alpha: float | None = None, dropout: float = 0.0) -> nn.Module:
    """Wrap ``model`` in a `peft` LoRA model; only the adapters are trainable.

    Args:
        model: the base causal LM.
        rank: LoRA rank ``r`` (``--lora``).
        alpha: scaling numerator (default ``2·rank``).
        dropout: dropout on the adapter input.

    Raises:
        ValueError: ``rank`` < 1, or the model has no `nn.Linear` to adapt.
    """
    from peft import LoraConfig, get_peft_model

    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"--lora must be a positive int rank, got {rank!r}")
    targets = lora_targets(model)
    if not targets:
        raise ValueError("--lora: the model has no nn.Linear module outside the router/embeddings/lm_head to adapt")
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                        target_modules=targets, bias="none")
    return get_peft_model(model, config)


def router_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter with ``router`` in its name."""
    return [p for name, p in model.named_parameters() if "router" in name]
