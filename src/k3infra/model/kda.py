"""The K3 KDA token mixer: projections, causal depthwise conv, the bounded low-rank decay and a KDA backend.

Per head (``K3_MODEL.md`` §1)::

    q, k = L2Norm(Swish(Conv4(W x)))   v = Swish(Conv4(W_v x))   β = σ(W_β x)
    z = W_α↑ W_α↓ x + b_α              g = lower_bound · σ(e^{A_h} z)   (log decay per key channel)
    S_t = (I − β k kᵀ) Diag(e^g) S_{t−1} + β k vᵀ     õ = S_tᵀ q · d_h^{-1/2}
    y = W_o[σ(W_g x) ⊙ RMSNorm(õ)]

Backends (``config.kda_backend``): ``torch`` (`k3infra.model.kda_torch`, any device, differentiable),
``flashkda`` / ``fla`` (Triton, CUDA), ``auto`` = ``flashkda`` on CUDA tensors else ``torch``. The kernel backends
take the raw q, k, z and β logits and apply the L2 norm (``x / √(Σx² + 10⁻⁶)``), the gate and the sigmoid inside
``chunk_kda`` (``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``); the torch path
and decode steps apply them in torch.

Shape suffixes: B batch, T tokens, D hidden, H heads, K head dim, W conv width.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3infra.model import fused
from k3infra.model.fused_conv import conv_silu
from k3infra.model.kda_torch import chunk_kda_torch, recurrent_kda_torch
from k3infra.model.layers import Linear, RMSNorm, recompute, shared_input_linears

__all__ = ["K3KDA", "causal_depthwise_conv", "positions_in_sequence"]

#: Decode steps of at most this many tokens run the recurrent form.
DECODE_MAX_TOKENS = 4
#: From this many tokens (B·T) on, the torch path recomputes its chunk intermediates in backward instead of
#: keeping them (~0.3 MB per token per layer at d_h = 128); shorter inputs keep them (faster on the CPU).
TORCH_KDA_RECOMPUTE_TOKENS = 1024


def positions_in_sequence(T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[T]`` int64 index of each token within its packed sequence (plain ``arange`` without ``cu_seqlens``)."""
    pos = torch.arange(T, device=device)
    if cu_seqlens is None:
        return pos
    starts = cu_seqlens[:-1].to(device=device, dtype=torch.long)
    seq_of_token = torch.searchsorted(cu_seqlens[1:].to(device=device, dtype=torch.long), pos, right=True)
    return pos - starts[seq_of_token]


def causal_depthwise_conv(
    x_BTD: torch.Tensor, weight_DW: torch.Tensor, state_BWD: torch.Tensor | None, pos_T: torch.Tensor | None
) -> torch.Tensor:
    """``y_t = Σ_j weight[:, W−1−j] · x_{t−j}`` without crossing sequence starts.

    Args:
        x_BTD: inputs.
        weight_DW: depthwise kernel (last column multiplies the current token).
        state_BWD: ``[B, W−1, D]`` the previous ``W−1`` inputs (decode), or None (zeros / sequence start).
        pos_T: position of each token in its sequence (taps reaching before it are dropped), or None when
            ``state_BWD`` is given.
    """
    W = weight_DW.shape[1]
    T = x_BTD.shape[1]
    if state_BWD is not None:
        xx = torch.cat([state_BWD.to(x_BTD.dtype), x_BTD], 1)
    else:
        xx = F.pad(x_BTD, (0, 0, W - 1, 0))
    y = x_BTD * weight_DW[:, W - 1]
    for j in range(1, W):
        tap = xx[:, W - 1 - j : W - 1 - j + T] * weight_DW[:, W - 1 - j]
        if state_BWD is None and pos_T is not None:
            tap = tap * (pos_T >= j).to(tap.dtype)[None, :, None]
        y = y + tap
    return y


def _kda_kernels(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "flashkda" if device.type == "cuda" else "torch"
    # Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite without a GPU) runs the kernels on CPU.
    if backend in ("flashkda", "fla") and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kda_backend={backend!r} needs CUDA tensors, got device {device}; use 'torch' or 'auto'")
    return backend


class K3KDA(nn.Module):
    """Kimi Delta Attention layer of K3 (parameters exactly those counted by `count_parameters`).

    Args:
        config: a `K3Config`.
        layer_idx: index of this layer in the decoder (its cache slot).
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        d, H, K, W, rank = (config.hidden_size, config.kda_num_heads, config.kda_head_dim, config.kda_conv_size,
                            config.kda_gate_rank)
        D = H * K
        self.layer_idx, self.num_heads, self.head_dim, self.conv_size = layer_idx, H, K, W
        self.lower_bound, self.chunk_size, self.backend = config.kda_gate_lower_bound, config.kda_chunk_size, \
            config.kda_backend
        self.q_proj = Linear(d, D, bias=False)
        self.k_proj = Linear(d, D, bias=False)
        self.v_proj = Linear(d, D, bias=False)
        self.q_conv = nn.Parameter(torch.empty(D, W))
        self.k_conv = nn.Parameter(torch.empty(D, W))
        self.v_conv = nn.Parameter(torch.empty(D, W))
        self.f_a_proj = Linear(d, rank, bias=False)
        self.f_b_proj = Linear(rank, D, bias=True)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.b_proj = Linear(d, H, bias=False)
        self.g_proj = Linear(d, D, bias=False)
        self.o_norm = RMSNorm(K, config.rms_norm_eps)
        self.o_proj = Linear(D, d, bias=False)

    def muon_head_blocks(self) -> dict[str, tuple[int, ...]]:
        """Per-head Muon: ``q_proj``, ``k_proj``, ``v_proj`` rows come in ``head_dim`` blocks, one per head."""
        return {f"{name}.weight": (self.head_dim,) for name in ("q_proj", "k_proj", "v_proj")}

    @torch.no_grad()
    def reset_kda_parameters(self) -> None:
        """Conv taps ~ U(±1/√W); decay bias so the initial per-token decay ``−g`` spans [0.001, 0.1] (log-uniform)
        and ``A = 0``: long memory at the start, as fla initialises its gate."""
        bound = 1 / math.sqrt(self.conv_size)
        for w in (self.q_conv, self.k_conv, self.v_conv):
            w.uniform_(-bound, bound)
        decay = torch.exp(torch.empty_like(self.f_b_proj.bias).uniform_(math.log(1e-3), math.log(1e-1)))
        frac = (decay / -self.lower_bound).clamp(1e-6, 1 - 1e-6)
        self.f_b_proj.bias.copy_(torch.log(frac) - torch.log1p(-frac))
        self.A_log.zero_()

    def forward(
        self,
        x_BTD: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """Mix tokens; ``x_BTD`` ``[B, T, D]``; ``cu_seqlens`` ``[N + 1]`` for packed input (``B == 1``);
        ``cache`` a `K3Cache` (its KDA slot for this layer is read and updated). Returns ``[B, T, D]``."""
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        state = cache.kda_state(self.layer_idx) if cache is not None else None
        pos_T = None if state is not None else positions_in_sequence(T, cu_seqlens, x_BTD.device)
        *conv_in, z_low, beta_logits = shared_input_linears(
            x_BTD, (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj))
        backend = _kda_kernels(self.backend, x_BTD.device)
        decode = not torch.is_grad_enabled() and T <= DECODE_MAX_TOKENS and cu_seqlens is None
        # the chunk kernels take raw q, k, gate and beta and apply the L2 norm, the bounded gate and the sigmoid
        # themselves; the torch path and the decode kernel take them applied
        in_kernel = backend != "torch" and not decode
        # conv, Swish, L2 norm (fp32) and the decay gate (fp32) are recomputed in backward: only the projections'
        # outputs, in the activation dtype, are kept for them (the fused conv kernel keeps only its input already).
        q, k, v = (_conv_act_kept_input(u, w, None if state is None else state.conv[i], pos_T, H,
                                        normalize=i < 2 and not in_kernel)
                   for i, (u, w) in enumerate(zip(conv_in, (self.q_conv, self.k_conv, self.v_conv))))
        z_BTD = self.f_b_proj(z_low)
        initial = None if state is None else state.recurrent
        if in_kernel:
            o, final = self._chunk_kernel(backend, q, k, v, z_BTD.view(B, T, H, K), beta_logits, initial,
                                          cache is not None, cu_seqlens)
        else:
            g = recompute(functools.partial(_decay, lower_bound=self.lower_bound, heads=H), z_BTD, self.A_log)
            beta = torch.sigmoid(beta_logits.float())
            o, final = self._mix(backend, q, k, v, g, beta, initial, cache is not None, cu_seqlens, decode)
        if cache is not None:
            new_conv = [_tail(u, None if state is None else state.conv[i], self.conv_size - 1)
                        for i, u in enumerate(conv_in)]
            cache.update_kda(self.layer_idx, final, new_conv, T)
        o = self.o_norm(o.to(x_BTD.dtype)).reshape(B, T, H * K)
        return self.o_proj(torch.sigmoid(self.g_proj(x_BTD)) * o)

    @torch.compiler.disable
    def _chunk_kernel(self, backend, q, k, v, z, beta_logits, initial, want_state, cu_seqlens):
        """FlashKDA's or fla's ``chunk_kda`` from raw inputs: q, k ``[B, T, H, K]`` before the L2 norm, z
        ``[B, T, H, K]`` the gate before ``lower_bound · σ(e^A ·)``, beta_logits ``[B, T, H]``. Opaque to
        ``torch.compile`` (Triton, host reads of ``cu_seqlens``)."""
        if backend == "fla":
            from fla.ops.kda import chunk_kda
        else:
            from flashkda import chunk_kda
        return chunk_kda(q, k, v, z.to(q.dtype), beta_logits.to(q.dtype), initial_state=initial,
                         output_final_state=want_state, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=self.A_log,
                         lower_bound=self.lower_bound, safe_gate=True)

    @torch.compiler.disable
    def _mix(self, backend, q, k, v, g, beta, initial, want_state, cu_seqlens, decode):
        """The torch path, or a decode step, from applied inputs (normed q, k; log decay g; beta in (0, 1)).
        Opaque to ``torch.compile`` (packed documents are laid out by their host lengths)."""
        if decode and backend != "torch":
            from flashkda import fused_recurrent_kda

            return fused_recurrent_kda(q, k, v, g.to(q.dtype), beta.to(q.dtype), initial_state=initial,
                                       output_final_state=True)
        if decode:
            return recurrent_kda_torch(q, k, v, g, beta, initial_state=initial)
        run = functools.partial(chunk_kda_torch, initial_state=initial, output_final_state=want_state,
                                cu_seqlens=cu_seqlens, chunk_size=self.chunk_size)
        if q.shape[0] * q.shape[1] < TORCH_KDA_RECOMPUTE_TOKENS:
            return run(q, k, v, g, beta)
        # the chunked form's fp32 [B, H, n, C, C, K] intermediates are recomputed in backward, not kept
        return recompute(run, q, k, v, g, beta)


def _conv_act(u_BTD, weight_DW, state, pos_T, heads: int, normalize: bool) -> torch.Tensor:
    """``Swish(Conv(u))`` as ``[B, T, H, K]`` in ``u``'s dtype, L2-normalised per head in fp32 if ``normalize``."""
    B, T, D = u_BTD.shape
    if _takes_fused_conv(u_BTD, state, pos_T):
        y = conv_silu(u_BTD, weight_DW.to(u_BTD.dtype), pos_T).view(B, T, heads, D // heads)
    else:
        y = F.silu(causal_depthwise_conv(u_BTD, weight_DW.to(u_BTD.dtype), state, pos_T)).view(B, T, heads,
                                                                                               D // heads)
    return F.normalize(y.float(), dim=-1, eps=1e-6).to(u_BTD.dtype) if normalize else y


def _takes_fused_conv(u_BTD, state, pos_T) -> bool:
    """Whether `_conv_act` runs the fused kernel (no decode state, positions known, `fused.use_fused`; an operator,
    so compiled graphs take it too)."""
    return state is None and pos_T is not None and fused.use_fused(u_BTD, while_compiling=True)


def _conv_act_kept_input(u_BTD, weight_DW, state, pos_T, heads: int, normalize: bool) -> torch.Tensor:
    """`_conv_act`, keeping only ``u`` and the weight for backward: the fused kernel does so by itself (its backward
    recomputes the pre-activation), so it is called directly; other paths go through `layers.recompute`."""
    if not normalize and _takes_fused_conv(u_BTD, state, pos_T):
        return _conv_act(u_BTD, weight_DW, state, pos_T, heads, normalize)
    return recompute(functools.partial(_conv_act, state=state, pos_T=pos_T, heads=heads, normalize=normalize),
                     u_BTD, weight_DW)


def _decay(z_BTD, A_log_H, lower_bound: float, heads: int) -> torch.Tensor:
    """Log decay ``g = lower_bound · σ(e^A z)``, ``[B, T, H, K]`` fp32."""
    B, T, D = z_BTD.shape
    z = z_BTD.view(B, T, heads, D // heads).float()
    return lower_bound * torch.sigmoid(A_log_H.float().exp()[:, None] * z)


def _tail(u_BTD: torch.Tensor, prev_BWD: torch.Tensor | None, width: int) -> torch.Tensor:
    """The last ``width`` conv inputs after this call (zeros before the first token)."""
    if prev_BWD is not None:
        u_BTD = torch.cat([prev_BWD.to(u_BTD.dtype), u_BTD], 1)
    if u_BTD.shape[1] < width:
        u_BTD = F.pad(u_BTD, (0, 0, width - u_BTD.shape[1], 0))
    # a copy: a view would keep the whole [B, T, D] projection alive in the cache
    return u_BTD[:, u_BTD.shape[1] - width :].detach().clone()
