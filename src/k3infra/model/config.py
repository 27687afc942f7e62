"""`K3Config`: the K3-style model's sizes as a transformers config, the three presets and exact parameter counts.

Symbols follow ``K3_MODEL.md`` §2: d hidden, V vocab, L layers (L_K KDA + L_M MLA), H_K × d_h KDA heads
(D = H_K·d_h), w conv width, H_M MLA heads, r_q / r_kv LoRA ranks, n / r / d_v head dims, F dense width of
layer 0, E routed experts, k top-k, N_s shared experts, m expert width, ℓ latent width.

Example::

    >>> from k3infra.model.config import K3Config, count_parameters
    >>> count_parameters(K3Config.from_preset("k3-debug"))
    (459974, 255174)
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig

__all__ = ["KDA_BACKENDS", "PRESETS", "K3Config", "count_parameters", "flops_per_token", "preset_names"]

KDA_BACKENDS = ("auto", "torch", "flashkda", "fla")
"""``torch``: the chunked pure-torch KDA (CPU and any device, differentiable); ``flashkda`` / ``fla``: Triton
kernels (GPU); ``auto``: ``flashkda`` on CUDA tensors, ``torch`` elsewhere."""

KDA_LAYER = "linear_attention"
MLA_LAYER = "full_attention"


class K3Config(PretrainedConfig):
    """Sizes of a K3-style decoder: 3 KDA : 1 gated MLA (MLA at every fourth layer and the last), layer 0 a dense
    SiTU-GLU, the rest Stable LatentMoE, Block Attention Residuals.

    Every field is a keyword argument; `from_preset` gives ``k3``, ``k3-mini`` and ``k3-debug``.

    Raises:
        ValueError: a size is not a positive int, dims do not divide, top-k exceeds the expert count, or the
            layer pattern is not ``linear_attention`` / ``full_attention`` entries of length ``num_hidden_layers``.
    """

    model_type = "k3"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    layer_types: list[str] | None = None
    """Per layer ``"linear_attention"`` (KDA) or ``"full_attention"`` (MLA); default: MLA at 1-based layers
    4, 8, … and the last."""
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    # KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate_rank: int | None = None
    """Rank of the decay projection ``W_α↑ W_α↓`` (default ``kda_head_dim``)."""
    kda_gate_lower_bound: float = -5.0
    kda_backend: str = "auto"
    kda_chunk_size: int = 16
    """Chunk of the pure-torch KDA (16 keeps the summed log-decay of a chunk above −80)."""

    # MLA
    mla_num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    # FFN / MoE
    first_k_dense_replace: int = 1
    dense_intermediate_size: int = 33792
    n_routed_experts: int = 896
    num_experts_per_tok: int = 16
    n_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    moe_latent_size: int = 3584
    routed_scaling_factor: float = 1.0
    situ_gate_beta: float = 4.0
    situ_up_beta: float = 25.0
    qb_bins: int = 2048
    """Histogram bins per expert for Quantile Balancing's margin quantile."""
    qb_margin_range: float = 2.0
    """Margins ``s − α`` are histogrammed over ``[−range, range]`` (sigmoid scores keep them in (−2, 2))."""

    # Block Attention Residuals
    attn_res_block_size: int = 12

    loss_chunk_size: int = 4096
    """Training with labels on more than this many tokens computes the loss in chunks of this many tokens, each
    chunk's logits recomputed in backward (no ``[T, V]`` fp32 logits kept; ``logits`` is then None). 0: never."""

    def __post_init__(self, **kwargs: Any) -> None:
        if self.layer_types is None and isinstance(self.num_hidden_layers, int) and self.num_hidden_layers > 0:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        if self.kda_gate_rank is None:
            self.kda_gate_rank = self.kda_head_dim
        super().__post_init__(**kwargs)
        self.check()

    # -- validation ------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ValueError naming the first inconsistent field (called on construction)."""
        positive = (
            "vocab_size hidden_size num_hidden_layers kda_num_heads kda_head_dim kda_conv_size kda_gate_rank "
            "kda_chunk_size mla_num_heads q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
            "dense_intermediate_size n_routed_experts num_experts_per_tok moe_intermediate_size moe_latent_size "
            "attn_res_block_size qb_bins"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) must be <= num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        types = self.layer_types
        if not isinstance(types, list) or len(types) != self.num_hidden_layers:
            raise ValueError(f"layer_types must be a list of {self.num_hidden_layers} entries, got {types!r}")
        bad = sorted({t for t in types if t not in (KDA_LAYER, MLA_LAYER)})
        if bad:
            raise ValueError(f"layer_types entries must be {KDA_LAYER!r} (KDA) or {MLA_LAYER!r} (MLA), got {bad}")
        if self.num_experts_per_tok >= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be < n_routed_experts "
                f"({self.n_routed_experts}): Quantile Balancing routes top-(k+1)"
            )
        if self.kda_backend not in KDA_BACKENDS:
            raise ValueError(f"kda_backend must be one of {KDA_BACKENDS}, got {self.kda_backend!r}")
        if not -5.0 <= self.kda_gate_lower_bound < 0:
            raise ValueError(f"kda_gate_lower_bound must be in [-5, 0), got {self.kda_gate_lower_bound}")
        if self.kda_chunk_size * abs(self.kda_gate_lower_bound) > 80:
            raise ValueError(
                f"kda_chunk_size * |kda_gate_lower_bound| must be <= 80 (exp range of the chunked form), got "
                f"{self.kda_chunk_size} * {abs(self.kda_gate_lower_bound)}"
            )
        for name in ("rms_norm_eps", "routed_scaling_factor", "situ_gate_beta", "situ_up_beta", "qb_margin_range"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    # -- derived sizes ---------------------------------------------------------------------------------------

    @property
    def kda_layers(self) -> list[int]:
        """0-based indices of the KDA layers."""
        return [i for i, t in enumerate(self.layer_types) if t == KDA_LAYER]

    @property
    def mla_layers(self) -> list[int]:
        """0-based indices of the MLA layers."""
        return [i for i, t in enumerate(self.layer_types) if t == MLA_LAYER]

    @property
    def num_attn_res_blocks(self) -> int:
        """AttnRes blocks of ``attn_res_block_size`` layers (the last may be partial)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` (0-based) has a LatentMoE FFN (else the dense SiTU-GLU)."""
        return layer_idx >= self.first_k_dense_replace

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> K3Config:
        """Build one of `PRESETS` (``k3``, ``k3-mini``, ``k3-debug``), fields in ``overrides`` replaced.

        Raises:
            ValueError: unknown preset name (the message lists the valid ones).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {preset_names()}")
        return cls(**{**PRESETS[name], **overrides})


def default_layer_types(num_layers: int) -> list[str]:
    """MLA at every fourth layer (1-based 4, 8, …) and at the last layer; KDA elsewhere."""
    return [MLA_LAYER if (i + 1) % 4 == 0 or i == num_layers - 1 else KDA_LAYER for i in range(num_layers)]


PRESETS: dict[str, dict[str, Any]] = {
    "k3": {},
    "k3-mini": dict(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=17,
        kda_num_heads=8, kda_head_dim=128,
        mla_num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        dense_intermediate_size=4864, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=2,
        moe_intermediate_size=128, moe_latent_size=512, attn_res_block_size=2, max_position_embeddings=65536,
    ),
    "k3-debug": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=5,
        kda_num_heads=2, kda_head_dim=32,
        mla_num_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        dense_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=2,
        moe_intermediate_size=16, moe_latent_size=32, attn_res_block_size=2, max_position_embeddings=4096,
    ),
}  # fmt: skip
"""Keyword arguments of each preset (``K3_MODEL.md`` §3); ``k3`` is the class defaults."""


def preset_names() -> tuple[str, ...]:
    """The names `K3Config.from_preset` accepts."""
    return tuple(PRESETS)


def _kda_params(c: K3Config) -> int:
    d, H, dh, w, rank = c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.kda_conv_size, c.kda_gate_rank
    D = H * dh
    # q, k, v, g, o | conv, decay-up, decay bias | decay-down, beta | A per head | output norm
    return 5 * d * D + D * (3 * w + rank + 1) + d * (rank + H) + H + dh


def _mla_params(c: K3Config) -> int:
    d, H = c.hidden_size, c.mla_num_heads
    rq, rkv, n, r, dv = c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    return d * rq + rq * H * (n + r) + d * (rkv + r) + rkv * H * (n + dv) + 2 * d * H * dv + rq + rkv


def _moe_params(c: K3Config, experts: int) -> int:
    d, m, lat = c.hidden_size, c.moe_intermediate_size, c.moe_latent_size
    return 3 * experts * lat * m + 3 * c.n_shared_experts * d * m + 2 * d * lat + lat + c.n_routed_experts * d


def count_parameters(config: K3Config) -> tuple[int, int]:
    """Exact parameter totals from the sizes (``K3_MODEL.md`` §2), without building the model.

    Returns:
        ``(total, active)``: active counts ``k`` of the ``E`` routed experts per MoE layer and leaves out the
        input embedding (a lookup). Buffers (router bias, QB statistics) are not parameters.
    """
    c = config
    d, V, L = c.hidden_size, c.vocab_size, c.num_hidden_layers
    attn = len(c.kda_layers) * _kda_params(c) + len(c.mla_layers) * _mla_params(c)
    dense = c.first_k_dense_replace * 3 * d * c.dense_intermediate_size
    moe_layers = L - c.first_k_dense_replace
    norms = 6 * d * L + 3 * d
    total = attn + dense + moe_layers * _moe_params(c, c.n_routed_experts) + norms + 2 * V * d
    active = attn + dense + moe_layers * _moe_params(c, c.num_experts_per_tok) + norms + V * d
    return total, active


def flops_per_token(config: K3Config, seq_len: int, *, causal_exact: bool = False) -> float:
    """Model FLOPs per trained token (forward + backward), ``K3_MODEL.md`` §5.

    ``6·N_active + c·6·L_M·H_M(n + r + d_v)·T + 6·L_K·H_K(3·d_h² + 4·C·d_h)`` with ``c = 1`` (PaLM convention)
    or ``½`` (``causal_exact``) and ``C = 64``.

    Args:
        config: the model sizes.
        seq_len: ``T``, tokens per sequence.
        causal_exact: count only the causal half of the attention matrix.
    """
    c = config
    _, active = count_parameters(c)
    mla = (0.5 if causal_exact else 1.0) * 6 * len(c.mla_layers) * c.mla_num_heads
    mla *= (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * seq_len
    chunk = 64
    kda = 6 * len(c.kda_layers) * c.kda_num_heads * (3 * c.kda_head_dim**2 + 4 * chunk * c.kda_head_dim)
    return 6.0 * active + mla + kda
