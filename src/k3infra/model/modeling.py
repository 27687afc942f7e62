"""The K3-style decoder as transformers models: `K3PreTrainedModel`, `K3Model`, `K3ForCausalLM`.

Layer ``l``: ``h = AttnRes(sources)``, ``a = Mixer(RMSNorm(h))`` (KDA or gated MLA), ``h' = AttnRes(sources + a)``,
``f = FFN(RMSNorm(h'))`` (dense SiTU-GLU in layer 0, LatentMoE after). Block Attention Residuals: the sources are
the embedding, each finished block's sum of layer outputs and the running sum of the current block;
``attn_res_block_size`` layers make a block. A last site mixes the sources before the final norm.

Example::

    >>> import torch
    >>> from k3infra.model import K3Config, K3ForCausalLM
    >>> model = K3ForCausalLM(K3Config.from_preset("k3-debug"))
    >>> ids = torch.randint(0, 512, (2, 16))
    >>> out = model(ids, labels=ids)
    >>> out.logits.shape, out.loss.dim()
    (torch.Size([2, 16, 512]), 0)
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from k3infra.model.cache import K3Cache
from k3infra.model.config import K3Config
from k3infra.model.kda import K3KDA
from k3infra.model.layers import AttnResSite, RMSNorm, SiTUGLU
from k3infra.model.linear_ce import linear_cross_entropy_sum
from k3infra.model.mla import K3MLA
from k3infra.model.moe import K3MoE

__all__ = ["K3DecoderLayer", "K3ForCausalLM", "K3Model", "K3PreTrainedModel"]

logger = logging.getLogger(__name__)


class K3DecoderLayer(nn.Module):
    """One decoder layer: two AttnRes sites, pre-norms, a KDA or MLA mixer, a dense or MoE FFN."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.attn_res = AttnResSite(d, eps)
        self.ffn_res = AttnResSite(d, eps)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.is_mla = layer_idx in config.mla_layers
        self.self_attn = K3MLA(config, layer_idx) if self.is_mla else K3KDA(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = K3MoE(config)
        else:
            self.mlp = SiTUGLU(d, config.dense_intermediate_size, config.situ_gate_beta, config.situ_up_beta)

    def forward(self, blocks: list[torch.Tensor], partial: torch.Tensor | None, cu_seqlens, cache) -> torch.Tensor:
        """Returns the new running block sum (``partial`` plus this layer's two outputs), ``[B, T, D]``."""
        h = self.attn_res(blocks if partial is None else [*blocks, partial])
        a = self.self_attn(self.input_layernorm(h), cu_seqlens=cu_seqlens, cache=cache)
        partial = a if partial is None else partial + a
        h = self.ffn_res([*blocks, partial])
        return partial + self.mlp(self.post_attention_layernorm(h))


class K3PreTrainedModel(PreTrainedModel):
    """Weight initialisation and transformers plumbing shared by `K3Model` and `K3ForCausalLM`."""

    config_class = K3Config
    config: K3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["K3DecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, AttnResSite):
            module.query.zero_()
        elif isinstance(module, K3MoE):
            for w in (module.w1, module.w3, module.w2):
                w.normal_(0.0, std)
            module.router.weight.normal_(0.0, std)
            module.router.bias.zero_()
        if isinstance(module, K3KDA):
            module.reset_kda_parameters()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # KDA state and MLA latents live in K3Cache, which forward creates and returns.
        return False


def _check_inputs(input_ids, attention_mask, position_ids, cu_seqlens, labels, vocab_size: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, T] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
    B, T = input_ids.shape
    if T == 0:
        raise ValueError("input_ids must hold at least one token (T >= 1), got T=0")
    low, high = (int(x) for x in torch.aminmax(input_ids))  # one reduction and one device read
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids must lie in [0, vocab_size={vocab_size}), got values in [{low}, {high}]")
    if attention_mask is not None:
        if attention_mask.shape != (B, T):
            raise ValueError(f"attention_mask must be [B, T] = [{B}, {T}], got {tuple(attention_mask.shape)}")
        if not bool((attention_mask != 0).all()):
            raise ValueError("attention_mask with padding (zeros) is not supported; pack sequences with cu_seqlens")
    if position_ids is not None and position_ids.shape[-1] != T:
        raise ValueError(f"position_ids must end in T={T}, got {tuple(position_ids.shape)}")
    if labels is not None and labels.shape != (B, T):
        raise ValueError(f"labels must be [B, T] = [{B}, {T}], got {tuple(labels.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs packed input with B == 1, got input_ids of shape {(B, T)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be an int32/int64 [N + 1] tensor, got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        if cu_seqlens.is_cuda:  # flashkda's cached host copy: its own checks then read the device only once
            from flashkda.seqlens import host_cu_seqlens

            cu_seqlens = host_cu_seqlens(cu_seqlens)
        c = cu_seqlens.tolist()
        if c[0] != 0 or c[-1] != T or any(b < a for a, b in zip(c[:-1], c[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {c}")


class K3Model(K3PreTrainedModel):
    """Embedding, decoder layers, the final AttnRes site and norm; returns hidden states ``[B, T, D]``."""

    def __init__(self, config: K3Config) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([K3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.final_res = AttnResSite(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: K3Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """See `K3ForCausalLM.forward`."""
        _check_inputs(input_ids, attention_mask, position_ids, cu_seqlens, None, self.config.vocab_size)
        cache = cache if cache is not None else past_key_values
        if use_cache is None:  # a cache only where it can serve: eval, whole (unpacked) sequences
            use_cache = self.config.use_cache and not self.training and cu_seqlens is None
        if cache is not None and not isinstance(cache, K3Cache):
            raise TypeError(f"cache must be a K3Cache, got {type(cache).__name__}")
        if use_cache and cache is None:
            cache = K3Cache()
        if cache is not None and cu_seqlens is not None:
            raise ValueError("cu_seqlens cannot be combined with a cache (decode one batch of whole sequences)")
        x = self._embed(input_ids)
        blocks, partial = [x], None
        size = self.config.attn_res_block_size
        for i, layer in enumerate(self.layers):
            if self.gradient_checkpointing and self.training:
                partial = torch.utils.checkpoint.checkpoint(layer, blocks, partial, cu_seqlens, cache,
                                                            use_reentrant=False)
            else:
                partial = layer(blocks, partial, cu_seqlens, cache if use_cache or cache is not None else None)
            if (i + 1) % size == 0:
                blocks, partial = [*blocks, partial], None
        h = self.norm(self.final_res(blocks if partial is None else [*blocks, partial]))
        out = BaseModelOutputWithPast(last_hidden_state=h)
        if cache is not None:  # an extra key (item assignment: transformers versions whose outputs reject it)
            out["cache"] = cache
        return out

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Under autocast the embedding enters the residual sources in the compute dtype, as with FSDP's bf16
        # parameters: an fp32 first source would make every AttnRes output, norm and projection input fp32.
        x = self.embed_tokens(input_ids)
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.dtype == torch.float32:
            x = x.to(torch.get_autocast_dtype(device))
        return x

    def moe_layers(self) -> list[K3MoE]:
        """The LatentMoE modules, in layer order."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, K3MoE)]


class K3ForCausalLM(K3PreTrainedModel, GenerationMixin):
    """`K3Model` with an untied LM head and next-token cross-entropy."""

    _tied_weights_keys: dict[str, str] = {}

    def __init__(self, config: K3Config) -> None:
        super().__init__(config)
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def moe_layers(self) -> list[K3MoE]:
        """The LatentMoE modules, in layer order (the trainer calls ``update_balancing`` on each)."""
        return self.model.moe_layers()

    def update_balancing(self, group=None) -> None:
        """Quantile Balancing step of every MoE layer (collective over ``group`` when distributed)."""
        for moe in self.moe_layers():
            moe.update_balancing(group)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: K3Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits and the next-token loss.

        Args:
            input_ids: ``[B, T]`` int64/int32 token ids.
            attention_mask: ``[B, T]`` all ones (padding is not supported: pack with ``cu_seqlens``), or None.
            position_ids: accepted for API compatibility; unused (NoPE: position comes from KDA).
            cu_seqlens: ``[N + 1]`` int32/int64 boundaries of packed sequences in the single row (``B == 1``);
                no attention, conv or KDA state crosses a boundary.
            labels: ``[B, T]`` int64 targets aligned with ``input_ids`` (shifted inside); ``-100`` is ignored.
            cache / past_key_values: a `K3Cache` to continue from (decode); updated in place.
            use_cache: create/return a cache (default: ``config.use_cache`` outside training, without
                ``cu_seqlens`` and ``labels``).
            return_dict: accepted; a `CausalLMOutputWithPast` is always returned.

        Returns:
            ``CausalLMOutputWithPast(loss, logits [B, T, V] fp32, cache)``; ``loss`` is the mean CE over the
            non-ignored targets. In training with ``labels`` on more than ``config.loss_chunk_size`` tokens the
            loss is computed in chunks and ``logits`` is None (no ``[T, V]`` logits are kept).

        Raises:
            ValueError / TypeError: a bad argument (named in the message).
        """
        if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape):
            got = getattr(labels, "shape", labels)
            raise ValueError(f"labels must be [B, T] = {tuple(input_ids.shape)}, got {got}")
        if use_cache is None and labels is not None:
            use_cache = False
        out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids, cu_seqlens=cu_seqlens,
                         cache=cache, use_cache=use_cache, past_key_values=past_key_values)
        hidden = out.last_hidden_state
        chunk = self.config.loss_chunk_size
        if labels is not None and self.training and chunk and hidden.shape[0] * hidden.shape[1] > chunk:
            logits, loss = None, self._chunked_loss(hidden, labels, chunk)
        else:
            logits = self.lm_head(hidden).float()
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                       labels[:, 1:].reshape(-1).long(), ignore_index=-100)
        result = CausalLMOutputWithPast(loss=loss, logits=logits)
        if out.get("cache") is not None:
            result["cache"] = out["cache"]
        return result

    def _chunked_loss(self, hidden_BTD: torch.Tensor, labels_BT: torch.Tensor, chunk: int) -> torch.Tensor:
        """Mean next-token CE over ``chunk``-token pieces (`linear_ce`: each piece's gradient formed in the forward,
        no logits kept)."""
        h_ND = hidden_BTD[:, :-1].reshape(-1, hidden_BTD.shape[-1])
        target_N = labels_BT[:, 1:].reshape(-1).long()
        total = linear_cross_entropy_sum(h_ND, self.lm_head.weight, target_N, chunk)
        return total / (target_N != -100).sum().clamp(min=1)

    def enable_expert_parallel(self, group, *, max_tokens_per_rank: int, dtype: torch.dtype | None = None,
                               device: torch.device | None = None, **buffer_kwargs) -> None:
        """Shard routed experts over ``group`` with MoonEP (collective: every rank of ``group`` calls it).

        Each rank keeps its ``E / R`` home experts (``[r·E/R, (r+1)·E/R)``) and dispatches tokens through one
        `moonep.Buffer` per MoE layer.

        Args:
            group: the EP process group (``R`` ranks, ``R`` divides ``n_routed_experts``).
            max_tokens_per_rank: most tokens (``B·T``) one rank passes per forward.
            dtype: dispatch dtype (default: the expert weights' dtype).
            device: device of the dispatch buffers (default: the expert weights' device; give it when the model
                is still on the meta device).
            **buffer_kwargs: passed to `moonep.Buffer` (``transport``, ``balanced``, ...).

        Raises:
            ValueError: ``R`` does not divide the expert count, or ``max_tokens_per_rank < 1``.
        """
        import torch.distributed as dist

        from moonep import Buffer

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("enable_expert_parallel needs torch.distributed initialised (init_process_group)")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        E = self.config.n_routed_experts
        if E % size:
            raise ValueError(f"EP size {size} must divide n_routed_experts={E}")
        if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}")
        for moe in self.moe_layers():
            if moe.ep_buffer is not None:
                raise ValueError("expert parallel is already enabled on this model")
            buf = Buffer(group, max_tokens_per_rank, self.config.moe_latent_size, self.config.num_experts_per_tok, E,
                         dtype=dtype or moe.w1.dtype, device=device or moe.w1.device, **buffer_kwargs)
            moe.shard_experts(buf, rank, size)
        logger.info("expert parallel: rank %d of %d holds %d experts per layer", rank, size, E // size)

    def prepare_inputs_for_generation(self, input_ids, cache=None, **kwargs):
        if cache is not None and cache.get_seq_length() > 0:
            input_ids = input_ids[:, cache.get_seq_length():]
        inputs = {"input_ids": input_ids, "cache": cache, "use_cache": kwargs.get("use_cache", True)}
        return inputs


