"""`ModelSpec`: what the planner needs to know about a decoder, read from a preset, a `K3Config` JSON or a
transformers ``config.json`` (DeepSeek-V3 / Kimi K2, Qwen3-MoE).

A model is a list of layers, each an attention kind (``kda``, ``mla``, ``gqa``) and an FFN kind (``dense``,
``moe``), plus the sizes of each kind. Parameter counts are exact for the modules the configs build
(``k3infra.model`` for K3 presets, ``DeepseekV3ForCausalLM`` / ``Qwen3MoeForCausalLM`` for transformers configs);
routed-expert parameters are kept apart from the rest because expert parallelism shards only them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from k3infra.model.config import K3Config, _kda_params, _mla_params, preset_names

__all__ = ["KDASpec", "MLASpec", "GQASpec", "MoESpec", "ModelSpec", "load_model", "model_from_k3", "model_from_hf"]

HF_DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2")
HF_QWEN_MOE_TYPES = ("qwen3_moe",)
SHIPPED = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class KDASpec:
    """Kimi Delta Attention sizes: ``heads`` × ``head_dim`` (d_k = d_v), causal conv width ``conv``."""

    heads: int
    head_dim: int
    conv: int
    params: int
    """Parameters of one KDA layer."""
    gate_rank: int = 0
    """Rank of the low-rank forget-gate projection (0: none)."""


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: ``heads``, q LoRA rank (0: no q LoRA), kv LoRA rank, nope/rope/v head dims."""

    heads: int
    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v_dim: int
    gated: bool
    params: int


@dataclass(frozen=True)
class GQASpec:
    """Grouped-query attention with ``kv_heads`` key/value heads of ``head_dim``."""

    heads: int
    kv_heads: int
    head_dim: int
    params: int


@dataclass(frozen=True)
class MoESpec:
    """Routed experts ``experts`` (top ``top_k``) of width ``width`` acting on ``latent`` features (``latent`` =
    hidden when there is no latent projection), plus shared experts of total width ``shared_width``."""

    experts: int
    top_k: int
    width: int
    latent: int
    shared_width: int
    has_latent: bool
    expert_params: int
    """Parameters of one routed expert (3·latent·width)."""
    other_params: int
    """Non-routed parameters of one MoE layer: router, shared experts, latent projections."""


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a decoder as the planner sees it.

    ``layers`` holds one ``(attention, ffn)`` pair per layer: attention in ``kda | mla | gqa``, ffn in
    ``dense | moe``. ``layer_extra`` counts the per-layer parameters outside attention and FFN (norms, AttnRes
    queries); ``model_extra`` the final norm and AttnRes output site; embeddings are ``vocab × hidden`` each,
    shared when ``tied``.
    """

    name: str
    family: str
    hidden: int
    vocab: int
    tied: bool
    layers: tuple[tuple[str, str], ...]
    dense_width: int
    layer_extra: int
    model_extra: int
    kda: KDASpec | None = None
    mla: MLASpec | None = None
    gqa: GQASpec | None = None
    moe: MoESpec | None = None
    attn_res_blocks: int = 0
    """Block Attention Residual blocks (0: plain residual stream)."""
    attn_res_block_size: int = 0
    """Layers per AttnRes block (0: plain residual stream)."""
    layer_buffer_bytes: tuple[int, ...] = ()
    """fp32 buffers per layer, on every rank (K3: router bias and Quantile Balancing histograms, MLA max-logit
    record); empty when the model keeps none."""
    max_context: int = 0

    # -- parameter counts --------------------------------------------------------------------------------------

    def attention_params(self, kind: str) -> int:
        return {"kda": self.kda, "mla": self.mla, "gqa": self.gqa}[kind].params

    def layer_params(self, index: int) -> tuple[int, int]:
        """``(non_expert, routed_expert)`` parameters of layer ``index``."""
        attn, ffn = self.layers[index]
        dense = self.attention_params(attn) + self.layer_extra
        if ffn == "moe":
            return dense + self.moe.other_params, self.moe.experts * self.moe.expert_params
        return dense + 3 * self.hidden * self.dense_width, 0

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Output projection and the final norm(s) (the projection is the embedding when tied)."""
        return (0 if self.tied else self.vocab * self.hidden) + self.model_extra

    @functools.lru_cache(maxsize=64)  # noqa: B019 (specs are few, frozen and small)
    def count(self) -> tuple[int, int, int]:
        """``(total, routed_expert, active)`` parameters; active counts ``top_k`` experts per MoE layer and
        leaves out the input embedding (a lookup)."""
        non_expert = self.embedding_params + self.head_params
        expert = 0
        for i in range(len(self.layers)):
            ne, e = self.layer_params(i)
            non_expert += ne
            expert += e
        active = non_expert + (self.n_moe_layers * self.moe.top_k * self.moe.expert_params if self.moe else 0)
        return non_expert + expert, expert, active - (0 if self.tied else self.embedding_params)

    @functools.cached_property
    def n_moe_layers(self) -> int:
        return sum(1 for _, ffn in self.layers if ffn == "moe")

    def n_attention(self, kind: str) -> int:
        return sum(1 for attn, _ in self.layers if attn == kind)


def _k3_sizes(c: K3Config) -> dict:
    d, lat, m = c.hidden_size, c.moe_latent_size, c.moe_intermediate_size
    moe = MoESpec(
        experts=c.n_routed_experts, top_k=c.num_experts_per_tok, width=m, latent=lat,
        shared_width=c.n_shared_experts * m, has_latent=True, expert_params=3 * lat * m,
        other_params=3 * c.n_shared_experts * d * m + 2 * d * lat + lat + c.n_routed_experts * d,
    )  # fmt: skip
    kda = KDASpec(c.kda_num_heads, c.kda_head_dim, c.kda_conv_size, _kda_params(c), c.kda_gate_rank)
    mla = MLASpec(
        c.mla_num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
        True, _mla_params(c),
    )  # fmt: skip
    return dict(kda=kda, mla=mla, moe=moe)


def model_from_k3(config: K3Config, name: str = "k3") -> ModelSpec:
    """The planner's view of a `K3Config` (exact per ``K3_MODEL.md`` §2)."""
    c = config
    layers = tuple(
        ("kda" if t == "linear_attention" else "mla", "moe" if c.is_moe_layer(i) else "dense")
        for i, t in enumerate(c.layer_types)
    )
    d = c.hidden_size
    buffers = tuple(
        4 * ((c.n_routed_experts * (c.qb_bins + 1) if ffn == "moe" else 0) + (c.mla_num_heads if attn == "mla" else 0))
        for attn, ffn in layers
    )
    return ModelSpec(
        name=name, family="k3", hidden=d, vocab=c.vocab_size, tied=bool(c.tie_word_embeddings), layers=layers,
        dense_width=c.dense_intermediate_size, layer_extra=6 * d, model_extra=3 * d,
        attn_res_blocks=c.num_attn_res_blocks, attn_res_block_size=c.attn_res_block_size, layer_buffer_bytes=buffers,
        max_context=c.max_position_embeddings, **_k3_sizes(c),
    )  # fmt: skip


def _need(raw: dict, key: str, source: str) -> int:
    if key not in raw:
        raise ValueError(f"model config {source}: missing field {key!r}")
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"model config {source}: field {key!r} must be an int >= 0, got {value!r}")
    return value


def _deepseek(raw: dict, name: str, source: str) -> ModelSpec:
    g = lambda key: _need(raw, key, source)  # noqa: E731
    d, H, L = g("hidden_size"), g("num_attention_heads"), g("num_hidden_layers")
    rq, rkv = raw.get("q_lora_rank") or 0, g("kv_lora_rank")
    n, r, dv = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
    q = d * rq + rq + rq * H * (n + r) if rq else d * H * (n + r)
    attn = q + d * (rkv + r) + rkv + rkv * H * (n + dv) + H * dv * d
    E, m, shared = g("n_routed_experts"), g("moe_intermediate_size"), g("n_shared_experts")
    moe = MoESpec(E, g("num_experts_per_tok"), m, d, shared * m, False, 3 * d * m, 3 * d * shared * m + E * d)
    first, freq = g("first_k_dense_replace"), raw.get("moe_layer_freq", 1) or 1
    layers = tuple(("mla", "moe" if i >= first and i % freq == 0 else "dense") for i in range(L))
    return ModelSpec(
        name=name, family="deepseek_v3", hidden=d, vocab=g("vocab_size"), tied=bool(raw.get("tie_word_embeddings")),
        layers=layers, dense_width=g("intermediate_size"), layer_extra=2 * d, model_extra=d,
        mla=MLASpec(H, rq, rkv, n, r, dv, False, attn), moe=moe, max_context=raw.get("max_position_embeddings", 0),
    )  # fmt: skip


def _qwen_moe(raw: dict, name: str, source: str) -> ModelSpec:
    g = lambda key: _need(raw, key, source)  # noqa: E731
    d, H, L = g("hidden_size"), g("num_attention_heads"), g("num_hidden_layers")
    kv = raw.get("num_key_value_heads") or H
    hd = raw.get("head_dim") or d // H
    attn = d * H * hd + 2 * d * kv * hd + H * hd * d + 2 * hd  # q, k, v, o, q_norm, k_norm
    if raw.get("attention_bias"):
        attn += H * hd + 2 * kv * hd + d
    E, m = g("num_experts"), g("moe_intermediate_size")
    moe = MoESpec(E, g("num_experts_per_tok"), m, d, 0, False, 3 * d * m, E * d)
    only_dense, step = set(raw.get("mlp_only_layers") or []), raw.get("decoder_sparse_step", 1) or 1
    layers = tuple(
        ("gqa", "moe" if i not in only_dense and E > 0 and (i + 1) % step == 0 else "dense") for i in range(L)
    )
    return ModelSpec(
        name=name, family="qwen3_moe", hidden=d, vocab=g("vocab_size"), tied=bool(raw.get("tie_word_embeddings")),
        layers=layers, dense_width=g("intermediate_size"), layer_extra=2 * d, model_extra=d,
        gqa=GQASpec(H, kv, hd, attn), moe=moe, max_context=raw.get("max_position_embeddings", 0),
    )  # fmt: skip


def model_from_hf(raw: dict, name: str = "hf", source: str = "<dict>") -> ModelSpec:
    """The planner's view of a transformers ``config.json`` (as a dict).

    Raises:
        ValueError: ``model_type`` is not one of the supported families, or a size field is missing.
    """
    kind = raw.get("model_type")
    if kind in HF_DEEPSEEK_TYPES:
        return _deepseek(raw, name, source)
    if kind in HF_QWEN_MOE_TYPES:
        return _qwen_moe(raw, name, source)
    if kind == "k3":
        skip = ("model_type", "architectures", "transformers_version")
        return model_from_k3(K3Config(**{k: v for k, v in raw.items() if k not in skip}), name)
    raise ValueError(
        f"model config {source}: model_type {kind!r} is not supported; expected one of "
        f"{('k3', *HF_DEEPSEEK_TYPES, *HF_QWEN_MOE_TYPES)}"
    )


def shipped_names() -> tuple[str, ...]:
    """Names of the config.json files shipped with the planner (``deepseek-v3``, ``kimi-k2``, …)."""
    return tuple(sorted(p.stem for p in SHIPPED.glob("*.json")))


def load_model(spec: str) -> ModelSpec:
    """A preset name (``k3``, ``k3-mini``, ``k3-debug``), a shipped config name (`shipped_names`) or a path to
    a ``config.json`` (K3Config JSON or a transformers config of a supported family).

    Raises:
        ValueError: unknown name, unreadable file or unsupported config (the message names ``--model``).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--model must be a preset name or a config.json path, got {spec!r}")
    if spec in preset_names():
        return model_from_k3(K3Config.from_preset(spec), spec)
    path = SHIPPED / f"{spec}.json" if spec in shipped_names() else Path(spec)
    if not path.is_file():
        raise ValueError(
            f"--model {spec!r}: not a preset {preset_names()}, a shipped config {shipped_names()} or a file"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--model {spec!r}: cannot read JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"--model {spec!r}: expected a JSON object, got {type(raw).__name__}")
    return model_from_hf(raw, name=path.stem if path.parent == SHIPPED else str(path), source=str(path))
