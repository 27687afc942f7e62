"""`KimiDeltaAttention`: the KDA token mixer as an ``nn.Module``, equal in function to fla's
``fla.layers.KimiDeltaAttention`` (same parameter names, so a state dict copies across) with the K3 options.

Forward, per token (``x`` ``[B, T, hidden_size]``):

1. ``q, k, v = silu(conv4(q_proj(x))), ...`` (depthwise causal conv of width ``conv_size``; plain SiLU without
   ``use_short_conv``).
2. Gate input ``f_proj(x)`` (low rank ``hidden -> head_v_dim -> HV * K`` or full rank), beta logits ``b_proj(x)``.
3. ``o = chunk_kda(q, k, v, g, beta, A_log, dt_bias, use_qk_l2norm_in_kernel, use_gate_in_kernel,
   use_beta_sigmoid_in_kernel, lower_bound, state_v_first=True)``.
4. ``o = RMSNorm(o) * weight * sigmoid(g_proj(x))`` per value head, then ``o_proj``.

Decode: pass a cache (`KDACache`, or fla's ``Cache``: any object with ``len()``, ``[layer_idx]`` returning a dict
with ``"conv_state"`` and ``"recurrent_state"``, and ``update(layer_idx=..., recurrent_state=..., conv_state=...,
offset=...)``) and ``use_cache=True``; the cache keeps the last ``conv_size`` conv inputs ``[N, D, conv_size]``
per projection and the fp32 KDA state ``[N, HV, V, K]``, so a prefill followed by token-by-token decode gives the
same outputs as one full forward.

Example::

    >>> import torch
    >>> from flashkda.layer import KDACache, KimiDeltaAttention
    >>> layer = KimiDeltaAttention(hidden_size=64, head_dim=32, num_heads=2, layer_idx=0)
    >>> x = torch.randn(1, 10, 64)
    >>> cache = KDACache()
    >>> y, _, cache = layer(x[:, :9], past_key_values=cache, use_cache=True)
    >>> y_last, _, cache = layer(x[:, 9:], past_key_values=cache, use_cache=True)
    >>> y_last.shape
    torch.Size([1, 1, 64])
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashkda.bwd.prologue import kda_gate_torch
from flashkda.chunk import chunk_kda_autograd
from flashkda.seqlens import host_cu_seqlens

__all__ = ["KDACache", "KimiDeltaAttention"]

logger = logging.getLogger(__name__)


class KDACache:
    """Per-layer decode state, indexed by ``layer_idx`` (the protocol fla's layers use)."""

    def __init__(self) -> None:
        self._layers: list[dict[str, Any] | None] = []
        self.seen_tokens = 0

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, layer_idx: int) -> dict[str, Any] | None:
        return self._layers[layer_idx]

    def update(
        self,
        *,
        layer_idx: int,
        recurrent_state: torch.Tensor | None = None,
        conv_state: tuple[torch.Tensor, ...] | None = None,
        offset: int = 1,
        **_: Any,
    ) -> dict[str, Any]:
        """Store a layer's new state; ``offset`` tokens were consumed (counted once, at layer 0)."""
        while len(self._layers) <= layer_idx:
            self._layers.append(None)
        state = self._layers[layer_idx] or {"recurrent_state": None, "conv_state": None}
        if recurrent_state is not None:
            state["recurrent_state"] = recurrent_state
        if conv_state is not None:
            state["conv_state"] = conv_state
        self._layers[layer_idx] = state
        if layer_idx == 0:
            self.seen_tokens += offset
        return state


def _causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cache: torch.Tensor | None,
    seq_bounds: torch.Tensor,
    activation: bool,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution that never reads across sequences.

    Args:
        x: ``[T, D]`` tokens of all sequences, packed.
        weight: ``[D, 1, W]`` (``nn.Conv1d`` layout).
        bias: ``[D]`` or None.
        cache: ``[N, D, W]`` the last ``W`` inputs of each sequence before ``x`` (newest last), or None (zeros).
        seq_bounds: ``[N + 1]`` int64 CPU cumulative lengths.
        activation: apply SiLU.
        output_final_state: also return the new ``[N, D, W]`` cache.

    Returns:
        ``(y [T, D], cache or None)``.
    """
    T, D = x.shape
    W = weight.shape[-1]
    N = seq_bounds.numel() - 1
    lens = seq_bounds[1:] - seq_bounds[:-1]
    seq = torch.repeat_interleave(torch.arange(N), lens)
    pos = torch.arange(T) - seq_bounds[:-1][seq]

    # Source rows: 0..T-1 are x, T..T+N*W-1 are the caches (row T + n*W + j is cache[n, :, j]), T+N*W is zero.
    cache_rows = cache.transpose(1, 2).reshape(N * W, D).to(x.dtype) if cache is not None else None
    zero_row = T + N * W

    def source(seq_idx: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        # rel: position inside the sequence (may be negative: then it is in the cache, -1 = newest)
        in_x = rel >= 0
        from_cache = T + seq_idx * W + (W + rel)
        idx = torch.where(in_x, seq_bounds[:-1][seq_idx] + rel, from_cache if cache is not None else zero_row)
        return torch.where(rel < -W, torch.full_like(idx, zero_row), idx)

    taps = torch.arange(W) - (W - 1)  # [W] relative offsets, last tap is the token itself
    idx = source(seq[:, None].expand(T, W), pos[:, None] + taps[None, :])
    parts = [x, cache_rows if cache_rows is not None else x.new_zeros(N * W, D), x.new_zeros(1, D)]
    table = torch.cat(parts, 0)
    window = table[idx.to(x.device)]  # [T, W, D]
    y = (window * weight.squeeze(1).t().to(x.dtype)).sum(1)
    if bias is not None:
        y = y + bias.to(x.dtype)
    if activation:
        y = F.silu(y)
    final = None
    if output_final_state:
        fidx = source(torch.arange(N)[:, None].expand(N, W), lens[:, None] + taps[None, :] - 1)
        final = table[fidx.to(x.device)].transpose(1, 2).contiguous()  # [N, D, W]
    return y, final


class _ShortConvolution(nn.Conv1d):
    """Depthwise causal conv + SiLU with fla's ``ShortConvolution`` parameter layout (``weight [D, 1, W]``)."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size, bias=bias)

    def forward(self, x, cache, output_final_state, seq_bounds):
        return _causal_conv(x, self.weight, self.bias, cache, seq_bounds, True, output_final_state)


class _RMSNormSigmoidGated(nn.Module):
    """``RMSNorm(x) * weight * sigmoid(g)`` over the last dim in fp32 (fla's ``FusedRMSNormGated``, sigmoid)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(g.float())).to(x.dtype)


def _recurrent_kda_torch(q, k, v, g, beta, *, initial_state, A_log, dt_bias, lower_bound, allow_neg_eigval, scale):
    """Token-by-token KDA for short no-grad decode calls (fp32; equal-length input; V-first state ``[N, HV, V, K]``).

    Used when the forward teammate's ``fused_recurrent_kda`` is absent: a decode step is one tiny recurrence, which
    the chunked path would pad to a whole chunk.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    qf = q.float() * torch.rsqrt(q.float().pow(2).sum(-1, keepdim=True) + 1e-6)
    kf = k.float() * torch.rsqrt(k.float().pow(2).sum(-1, keepdim=True) + 1e-6)
    qf, kf = qf.repeat_interleave(HV // H, dim=2) * scale, kf.repeat_interleave(HV // H, dim=2)
    gf = kda_gate_torch(g, A_log, dt_bias, lower_bound)
    bf = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    vf = v.float()
    S = initial_state.float() if initial_state is not None else vf.new_zeros(B, HV, v.shape[-1], K)
    outs = []
    for t in range(T):
        S = S * gf[:, t].exp().unsqueeze(-2)  # [B, HV, V, K] decays along K
        pred = (S * kf[:, t].unsqueeze(-2)).sum(-1)  # [B, HV, V]
        S = S + (bf[:, t, :, None] * (vf[:, t] - pred)).unsqueeze(-1) * kf[:, t].unsqueeze(-2)
        outs.append((S * qf[:, t].unsqueeze(-2)).sum(-1))
    return torch.stack(outs, 1).to(q.dtype), S


def _kda_ops():
    """The forward teammate's public ops when present, else None (the layer then uses the autograd path)."""
    try:
        from flashkda import chunk as chunk_mod
    except ImportError:
        return None, None
    return getattr(chunk_mod, "chunk_kda", None), getattr(chunk_mod, "fused_recurrent_kda", None)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer (fla-compatible parameters and cache; K3 options).

    Args:
        hidden_size: model width.
        expand_v: value head size = ``head_dim * expand_v``.
        head_dim: query/key head size ``K`` (64, 128 or 256 for the fast path).
        num_heads: query/key heads ``H``.
        num_v_heads: value heads ``HV`` (GVA when ``> num_heads``; a multiple of it); default ``num_heads``.
        mode: ``"chunk"`` or ``"fused_recurrent"`` (accepted for fla compatibility; the math is the same).
        use_short_conv: short causal conv + SiLU on q, k, v (else SiLU only).
        allow_neg_eigval: ``beta = 2 * sigmoid(...)``.
        safe_gate: fla's bounded-gate fast path flag (requires ``lower_bound``).
        lower_bound: bounded gate floor, e.g. -5.0 (K3), or None for the softplus gate.
        conv_size: conv width (K3: 4).
        conv_bias: conv bias.
        layer_idx: index in the cache.
        norm_eps: RMSNorm epsilon.
        full_rank_gate: ``f_proj`` is one ``hidden -> HV * K`` linear instead of the low-rank pair.
        full_rank_output_gate: ``g_proj`` is one ``hidden -> HV * V`` linear (with bias) instead of the pair.

    Raises:
        ValueError: a size or option is inconsistent (names the argument).
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        full_rank_gate: bool = False,
        full_rank_output_gate: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("head_dim", head_dim), ("num_heads", num_heads),
                            ("conv_size", conv_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'fused_recurrent', got {mode!r}")
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if num_v_heads <= 0 or num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads={num_v_heads} must be a positive multiple of num_heads={num_heads}")
        head_v_dim = head_dim * expand_v
        if expand_v <= 0 or not math.isclose(head_v_dim, round(head_v_dim), rel_tol=1e-5):
            raise ValueError(f"expand_v={expand_v} must make head_dim * expand_v a positive integer")
        if lower_bound is not None and not (-5.0 <= lower_bound < 0):
            raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True requires lower_bound (e.g. -5.0)")
        if kwargs:
            logger.debug("KimiDeltaAttention ignores %s", sorted(kwargs))

        self.hidden_size, self.expand_v, self.mode = hidden_size, expand_v, mode
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.allow_neg_eigval, self.safe_gate, self.lower_bound = allow_neg_eigval, safe_gate, lower_bound
        self.head_dim, self.num_heads, self.num_v_heads = head_dim, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_dim, int(round(head_v_dim))
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * self.head_v_dim
        self.gate_dim = num_v_heads * head_dim
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = _ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.k_conv1d = _ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.v_conv1d = _ShortConvolution(self.value_dim, conv_size, conv_bias)
        if full_rank_gate:
            self.f_proj = nn.Linear(hidden_size, self.gate_dim, bias=False)
        else:
            self.f_proj = nn.Sequential(
                nn.Linear(hidden_size, self.head_v_dim, bias=False),
                nn.Linear(self.head_v_dim, self.gate_dim, bias=False),
            )
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        if safe_gate:
            self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        else:
            self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(1, 16)))
        dt = torch.exp(torch.rand(self.gate_dim) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        if full_rank_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=True)
        else:
            self.g_proj = nn.Sequential(
                nn.Linear(hidden_size, self.head_v_dim, bias=False),
                nn.Linear(self.head_v_dim, self.value_dim, bias=True),
            )
        self.o_norm = _RMSNormSigmoidGated(self.head_v_dim, norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _mix(self, q, k, v, g, beta, recurrent_state, use_cache, cu_seqlens, cu_seqlens_cpu=None):
        kwargs = dict(
            initial_state=recurrent_state,
            output_final_state=use_cache,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval,
            lower_bound=self.lower_bound,
            state_v_first=True,
            cu_seqlens=cu_seqlens,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
        )
        if cu_seqlens is not None:
            kwargs["cu_seqlens_cpu"] = cu_seqlens_cpu
        chunk_kda, fused_recurrent_kda = _kda_ops()
        decode = not torch.is_grad_enabled() and q.shape[1] <= 64 and not self.training
        if decode and fused_recurrent_kda is not None:
            return fused_recurrent_kda(q, k, v, g, beta, **kwargs)
        if decode and cu_seqlens is None and q.shape[1] <= 4:
            return _recurrent_kda_torch(
                q, k, v, g, beta, initial_state=recurrent_state, A_log=self.A_log, dt_bias=self.dt_bias,
                lower_bound=self.lower_bound, allow_neg_eigval=self.allow_neg_eigval, scale=self.head_k_dim**-0.5,
            )
        if chunk_kda is not None:
            return chunk_kda(q, k, v, g, beta, safe_gate=self.safe_gate, **kwargs)
        return chunk_kda_autograd(q, k, v, g, beta, scale=self.head_k_dim**-0.5, safe_gate=self.safe_gate, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None, Any]:
        """Mix tokens.

        Args:
            hidden_states: ``[B, T, hidden_size]``.
            attention_mask: ``[B, T]`` 0/1 padding mask (1 = real token), or None.
            past_key_values: a cache (see the module docstring) or None.
            use_cache: update the cache with this call's final states.
            output_attentions: accepted for fla compatibility; always None is returned.
            **kwargs: ``cu_seqlens`` ``[N + 1]`` for packed varlen input (``B == 1``).

        Returns:
            ``(o [B, T, hidden_size], None, past_key_values)``.

        Raises:
            ValueError: bad shapes or a cache without ``layer_idx``.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [B, T, {self.hidden_size}], got {list(hidden_states.shape)}")
        B, T, _ = hidden_states.shape
        cu_seqlens = kwargs.get("cu_seqlens")
        if attention_mask is not None and attention_mask.shape != (B, T):
            raise ValueError(f"attention_mask must be [B, T] = {[B, T]}, got {list(attention_mask.shape)}")
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("pass either attention_mask or cu_seqlens, not both")
        if past_key_values is not None and self.layer_idx is None:
            raise ValueError("layer_idx must be set on the layer to use past_key_values")
        last = None
        if past_key_values is not None and len(past_key_values) > self.layer_idx:
            last = past_key_values[self.layer_idx]

        x = hidden_states
        indices = None
        if attention_mask is not None:
            keep = attention_mask.bool()
            indices = torch.nonzero(keep.flatten()).squeeze(1)
            lens = keep.sum(1).cpu()
            bounds = torch.zeros(B + 1, dtype=torch.int64)
            bounds[1:] = lens.cumsum(0)
            x = x.reshape(B * T, -1).index_select(0, indices).unsqueeze(0)
            cu_seqlens = bounds.to(x.device)
        elif cu_seqlens is not None:
            if x.shape[0] != 1:
                raise ValueError(f"cu_seqlens needs B == 1 (packed input), got B={x.shape[0]}")
            bounds = host_cu_seqlens(cu_seqlens)
        else:
            bounds = torch.arange(B + 1, dtype=torch.int64) * T
        rows = x.reshape(-1, self.hidden_size)

        q, k, v = self.q_proj(rows), self.k_proj(rows), self.v_proj(rows)
        conv_state = (None, None, None)
        if self.use_short_conv:
            if last is not None and last.get("conv_state") is not None:
                conv_state = last["conv_state"]
            (q, cq), (k, ck), (v, cv) = (
                conv(t, c, bool(use_cache), bounds)
                for conv, t, c in zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), (q, k, v), conv_state)
            )
            conv_state = (cq, ck, cv)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        lead = x.shape[:2]
        q = q.reshape(*lead, self.num_heads, self.head_k_dim)
        k = k.reshape(*lead, self.num_heads, self.head_k_dim)
        v = v.reshape(*lead, self.num_v_heads, self.head_v_dim)
        g = self.f_proj(x).reshape(*lead, self.num_v_heads, self.head_k_dim)
        beta = self.b_proj(x)
        recurrent_state = last.get("recurrent_state") if last is not None else None
        o, recurrent_state = self._mix(q, k, v, g, beta, recurrent_state, bool(use_cache), cu_seqlens,
                                       None if cu_seqlens is None else bounds)

        if past_key_values is not None and use_cache:
            past_key_values.update(
                layer_idx=self.layer_idx,
                recurrent_state=recurrent_state,
                conv_state=conv_state if self.use_short_conv else None,
                offset=T,
            )
        gate = self.g_proj(x).reshape(*lead, self.num_v_heads, self.head_v_dim)
        o = self.o_norm(o, gate).reshape(*lead, self.value_dim)
        o = self.o_proj(o)
        if indices is not None:
            out = o.new_zeros(B * T, self.hidden_size)
            o = out.index_copy(0, indices, o.squeeze(0)).reshape(B, T, self.hidden_size)
        return o, None, past_key_values
