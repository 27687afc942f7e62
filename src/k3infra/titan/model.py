"""`K3TitanModel`: the K3-style causal LM as a torchtitan ``BaseModel`` (its ``Module`` + ``Config.build`` protocol).

torchtitan builds the model on the meta device from ``model_spec.model`` (a `K3TitanModel.Config`), hands it to
the spec's ``parallelize_fn``, materialises it with ``to_empty`` and calls ``init_weights`` → `init_states`. The
network inside is the transformers `K3ForCausalLM` (``self.lm``), so weights and names stay those of
``k3infra train`` and ``save_pretrained``; the forward takes torchtitan's ``(tokens, **extra)`` call and returns
logits whose position ``t`` predicts ``labels[t]`` (torchtitan's labels are already shifted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.protocols import BaseModel

from k3infra.model import K3Config, K3ForCausalLM, flops_per_token, preset_names

__all__ = ["K3TitanModel"]


class K3TitanModel(BaseModel):
    """torchtitan's view of `K3ForCausalLM`.

    Attributes:
        lm: the transformers model (``lm.model.layers`` the decoder layers, ``lm.lm_head`` the untied head).
        k3_config: its `K3Config`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        """Which model: a `K3Config` preset with fields replaced by ``overrides``."""

        preset: str = "k3-debug"
        overrides: dict[str, Any] = field(default_factory=dict)

        def k3_config(self) -> K3Config:
            """The `K3Config` this describes; raises ValueError for an unknown preset or field."""
            if self.preset not in preset_names():
                raise ValueError(f"preset must be one of {preset_names()}, got {self.preset!r}")
            unknown = sorted(k for k in self.overrides if k not in K3Config.__annotations__)
            if unknown:
                raise ValueError(f"overrides: unknown K3Config field(s) {unknown}")
            return K3Config.from_preset(self.preset, **self.overrides)

        def update_from_config(self, *, config, **kwargs) -> None:
            """Check the trainer settings against the model (torchtitan calls this before building).

            Raises:
                ValueError: sequence length above ``max_position_embeddings``, an expert-parallel degree that does
                    not divide the routed experts, or a parallelism this spec does not provide (TP, CP, PP).
            """
            k3 = self.k3_config()
            seq_len = config.training.seq_len
            if seq_len > k3.max_position_embeddings:
                raise ValueError(f"training.seq_len {seq_len} exceeds max_position_embeddings="
                                 f"{k3.max_position_embeddings} of {self.preset}")
            par = config.parallelism
            ep = par.expert_parallel_degree
            if k3.n_routed_experts % ep:
                raise ValueError(f"parallelism.expert_parallel_degree {ep} must divide n_routed_experts="
                                 f"{k3.n_routed_experts} of {self.preset}")
            for name in ("tensor_parallel_degree", "context_parallel_degree", "pipeline_parallel_degree"):
                if getattr(par, name) != 1:
                    raise ValueError(f"parallelism.{name} must be 1 for the K3 model (its parallelize_fn applies "
                                     f"FSDP/HSDP and MoonEP expert parallel only), got {getattr(par, name)}")

        def get_nparams_and_flops(self, model: torch.nn.Module, seq_len: int) -> tuple[int, int]:
            """``(parameters of the built model, training FLOPs per token at seq_len)`` (6·N_active + attention)."""
            return sum(p.numel() for p in model.parameters()), int(flops_per_token(self.k3_config(), seq_len))

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.k3_config = config.k3_config()
        self.lm = K3ForCausalLM(self.k3_config)

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Next-token logits.

        Args:
            tokens: ``int64 [B, T]``.
            cu_seqlens: ``int32 [N + 1]`` packed-document boundaries of a single row (``B == 1``), or None.

        Returns:
            ``fp32 [B, T, V]`` logits; position ``t`` predicts the token after ``tokens[:, t]``.
        """
        from k3infra.train.compile import mark_packed_dynamic

        mark_packed_dynamic(cu_seqlens)  # compiled layers: new packings do not recompile
        return self.lm(input_ids=tokens, cu_seqlens=cu_seqlens, use_cache=False).logits

    @torch.no_grad()
    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter as `K3ForCausalLM` does and zero the buffers (router bias, Quantile
        Balancing histograms, MLA max-logit): after ``to_empty`` they hold arbitrary memory. Works on FSDP2
        DTensor parameters (random fills are sharding-aware)."""
        for module in self.lm.modules():
            self.lm._init_weights(module)
        for buffer in self.lm.buffers():
            buffer.zero_()

    def verify_module_protocol(self) -> None:
        """The inner network is a transformers model, not torchtitan ``Module``s; `init_states` covers it whole.
        Checks instead that ``lm`` is the K3 model."""
        if not isinstance(self.lm, K3ForCausalLM):
            raise RuntimeError(f"K3TitanModel.lm must be a K3ForCausalLM, got {type(self.lm).__name__}")
