"""Gated multi-head latent attention (MLA) of K3: q-LoRA, a compressed KV latent, a shared rope-part key that is
never rotated (NoPE), a sigmoid output gate and softmax scale ``(n + r)^{-1/2}``.

    q = W_qb RMSNorm(W_qa x);  [c | k_r] = W_kva x;  [k_n | v] = W_kvb RMSNorm(c);  k_r shared by heads
    y = W_o[σ(W_g x) ⊙ softmax(q·[k_n; k_r] / √(n + r)) v]

The decode cache keeps ``[c | k_r]`` (``r_kv + r`` values per token). In training the layer records each head's
largest pre-softmax logit (``max_logit``) for QK-Clip (`k3infra.model.qk_clip`).

Shape suffixes: B batch, T query tokens, S key tokens, D hidden, H heads.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3infra.model.layers import Linear, RMSNorm
from k3infra.model.max_logit import causal_max_logit

__all__ = ["K3MLA", "attention_mask_for", "packed_causal_flash", "uses_varlen_flash"]


def attention_mask_for(T: int, S: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``[T, S]`` bool mask (True = attend) for queries at the last ``T`` of ``S`` positions, block-diagonal over
    packed sequences when ``cu_seqlens`` is given; None when plain causal with ``T == S`` (SDPA's ``is_causal``)."""
    if cu_seqlens is None and T == S:
        return None
    key = torch.arange(S, device=device)
    query = torch.arange(S - T, S, device=device)
    mask = key[None, :] <= query[:, None]
    if cu_seqlens is not None:
        bounds = cu_seqlens[1:].to(device=device, dtype=torch.long)
        seq_q = torch.searchsorted(bounds, query, right=True)
        seq_k = torch.searchsorted(bounds, key, right=True)
        mask = mask & (seq_q[:, None] == seq_k[None, :])
    return mask


class K3MLA(nn.Module):
    """Gated MLA layer (parameters exactly those counted by `count_parameters`).

    Args:
        config: a `K3Config`.
        layer_idx: index of this layer in the decoder (its cache slot).
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        d, H = config.hidden_size, config.mla_num_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.r_kv, self.n, self.r, self.dv = (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                                              config.v_head_dim)
        self.scale = (self.n + self.r) ** -0.5
        self.q_a_proj = Linear(d, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, H * (self.n + self.r), bias=False)
        self.kv_a_proj = Linear(d, self.r_kv + self.r, bias=False)
        self.kv_a_norm = RMSNorm(self.r_kv, config.rms_norm_eps)
        self.kv_b_proj = Linear(self.r_kv, H * (self.n + self.dv), bias=False)
        self.g_proj = Linear(d, H * self.dv, bias=False)
        self.o_proj = Linear(H * self.dv, d, bias=False)
        self.register_buffer("max_logit", torch.zeros(H), persistent=False)
        self.track_max_logit = True
        """Record ``max_logit`` in training forwards (a detached ``q·kᵀ`` recompute, one sequence at a time)."""

    def muon_head_blocks(self) -> dict[str, tuple[int, ...]]:
        """Per-head Muon: ``q_b_proj`` rows are one ``n + r`` query block per head; ``kv_b_proj`` rows a key block
        (``n``) then a value block (``d_v``) per head."""
        return {"q_b_proj.weight": (self.n + self.r,), "kv_b_proj.weight": (self.n, self.dv)}

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Attend; ``x_BTD`` ``[B, T, D]``, ``cu_seqlens`` ``[N + 1]`` (``B == 1``), ``cache`` a `K3Cache`.
        Returns ``[B, T, D]``."""
        B, T, _ = x_BTD.shape
        H, n, r, dv = self.num_heads, self.n, self.r, self.dv
        q_BHTE = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BTD))).view(B, T, H, n + r).transpose(1, 2)
        latent_BTL = self.kv_a_proj(x_BTD)
        if cache is not None:
            latent_BTL = cache.update_mla(self.layer_idx, latent_BTL)
        S = latent_BTL.shape[1]
        c, k_r = latent_BTL.split([self.r_kv, r], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(c)).view(B, S, H, n + dv)
        k_n, v = kv.split([n, dv], dim=-1)
        k_BHSE = torch.cat([k_n, k_r[:, :, None, :].expand(B, S, H, r)], -1).transpose(1, 2)
        o = self._attend(q_BHTE, k_BHSE, v.transpose(1, 2), cu_seqlens, cache is not None)
        o_BTV = o.transpose(1, 2).reshape(B, T, H * dv)
        return self.o_proj(torch.sigmoid(self.g_proj(x_BTD)) * o_BTV)

    @torch.compiler.disable
    def _attend(self, q_BHTE, k_BHSE, v_BHSV, cu_seqlens, cached: bool) -> torch.Tensor:
        """Causal attention ``[B, H, T, V]`` (within each packed sequence) and, in training, the max-logit record.
        Opaque to ``torch.compile``: the packed path reads the sequence bounds on the host."""
        T, S = q_BHTE.shape[2], k_BHSE.shape[2]
        bounds = _host_bounds(cu_seqlens) if cu_seqlens is not None else None
        if self.training and self.track_max_logit:
            self._record_max_logit(q_BHTE, k_BHSE, bounds)
        if bounds is not None and not cached and uses_varlen_flash(q_BHTE):
            return packed_causal_flash(q_BHTE, k_BHSE, v_BHSV, cu_seqlens, bounds, self.scale)
        if bounds is not None and not cached:
            # one causal SDPA per packed sequence: no [T, S] mask, so the flash / memory-efficient kernels apply
            return torch.cat([F.scaled_dot_product_attention(q_BHTE[:, :, a:b], k_BHSE[:, :, a:b],
                                                             v_BHSV[:, :, a:b], is_causal=True, scale=self.scale)
                              for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dim=2)
        mask_TS = attention_mask_for(T, S, cu_seqlens, q_BHTE.device)
        return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSV, attn_mask=mask_TS, is_causal=mask_TS is None,
                                              scale=self.scale)

    @torch.no_grad()
    def _record_max_logit(self, q_BHTE, k_BHSE, bounds: list[int] | None) -> None:
        """Running per-head max of the causal logits (`max_logit.causal_max_logit`: a Triton kernel on CUDA, fp32
        query blocks on CPU; never a whole ``[H, T, S]`` matrix)."""
        best = causal_max_logit(q_BHTE, k_BHSE, bounds, self.scale)
        self.max_logit.copy_(torch.maximum(self.max_logit, best.to(self.max_logit.dtype)))


def uses_varlen_flash(q_BHTE: torch.Tensor) -> bool:
    """Whether packed causal attention goes through `packed_causal_flash`: CUDA, bf16/fp16, and a torch with
    ``torch.nn.attention.varlen``."""
    return q_BHTE.is_cuda and q_BHTE.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None


@functools.cache
def _varlen_attn():
    """``(varlen_attn, whether it takes window_size and scale)``, or None on a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "window_size" in inspect.signature(varlen_attn).parameters


def packed_causal_flash(q_BHTE: torch.Tensor, k_BHSE: torch.Tensor, v_BHSV: torch.Tensor, cu_seqlens: torch.Tensor,
                        bounds: list[int], scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence in one varlen flash-attention call (``B == 1``).

    One call for the whole batch, whatever the sequence lengths: per-sequence SDPA calls build a new cuDNN plan for
    every new length, which a packed batch brings on every step. Flash attention takes one head size for ``q``,
    ``k`` and ``v``, so ``v`` is zero-padded to ``q``'s and the output cut back.

    Args:
        q_BHTE, k_BHSE: ``[1, H, T, E]`` (``S == T``); v_BHSV: ``[1, H, T, V]`` with ``V <= E``; CUDA, bf16/fp16.
        cu_seqlens: ``[N + 1]`` cumulative lengths (any int dtype, any device); bounds: the same on the host.
        scale: softmax scale.

    Returns:
        ``[1, H, T, V]``.
    """
    E, V = q_BHTE.shape[-1], v_BHSV.shape[-1]
    q_THE, k_THE = q_BHTE[0].transpose(0, 1), k_BHSE[0].transpose(0, 1)
    v_THE = F.pad(v_BHSV[0].transpose(0, 1), (0, E - V))
    cu = cu_seqlens.to(device=q_BHTE.device, dtype=torch.int32)
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=1)
    attn, takes_window = _varlen_attn()
    if takes_window:  # torch >= 2.10
        o_THE = attn(q_THE, k_THE, v_THE, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))
    else:  # torch 2.9: causal flag, default scale only
        o_THE = attn(q_THE * (scale * E**0.5), k_THE, v_THE, cu, cu, longest, longest, is_causal=True)
    return o_THE[..., :V].transpose(0, 1).unsqueeze(0)


def _host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as a host list (flashkda's cached host copy on CUDA: one device read per batch)."""
    if cu_seqlens.is_cuda:
        from flashkda.seqlens import host_cu_seqlens

        cu_seqlens = host_cu_seqlens(cu_seqlens)
    return [int(x) for x in cu_seqlens.tolist()]
