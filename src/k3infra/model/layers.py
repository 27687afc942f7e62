"""Small building blocks of the K3 decoder: RMSNorm, the SiTU-GLU MLP and a Block Attention Residuals site.

All three compute in fp32 and save for backward only their inputs (in the activation dtype) and per-row fp32
scalars; the element-wise fp32 intermediates are recomputed in backward (K3 recomputes element-wise ops), so a
bf16 step keeps no fp32 copies of activations.

Shape suffixes: B batch, T tokens, D hidden, F MLP width, S residual sources.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

try:
    from k3infra.model import fused
except ModuleNotFoundError:  # no triton: the eager Functions only
    fused = None
from k3infra.model import weight_casts
from k3infra.model.weight_casts import compute_weight, compute_weights_cat

__all__ = ["AttnResSite", "Linear", "RMSNorm", "SiTUGLU", "attn_res_mix", "recompute", "rms_norm",
           "shared_input_linears", "situ_glu"]


def recompute(fn, *args):
    """``fn(*args)``, keeping for backward only ``args`` (``fn``'s intermediates are recomputed in backward).

    For element-wise chains whose intermediates would be saved in fp32; a plain call without grad."""
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn(*args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype inside a `weight_casts.cast_once` block with autocast on for ``x``'s device, else None."""
    device = x.device.type
    if not weight_casts.active() or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


class Linear(nn.Linear):
    """`nn.Linear` whose weight, under autocast inside `weight_casts.cast_once`, is cast once per block and gets its
    gradient added straight into ``.grad`` (`weight_casts.compute_weight`); elsewhere exactly `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        if dtype is None:
            return super().forward(x)
        return F.linear(x, compute_weight(self.weight, dtype), self.bias)


def shared_input_linears(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """``[m(x) for m in linears]`` as one matrix product over the concatenated weights when every module is a plain
    bias-free `nn.Linear` or `Linear` (else module by module, e.g. under LoRA adapters): one cast of the input and one
    of the weights under autocast instead of one each per module (inside `weight_casts.cast_once`, one cast of the
    concatenation per block), one GEMM forward and two backward, the input gradient summed inside the GEMM. The
    outputs are column slices of one ``[..., Σ out_features]`` tensor.

    Args:
        x: ``[..., in_features]``, the input every module reads.
        linears: the modules, in output order.
    """
    if any(type(m) not in (nn.Linear, Linear) or m.bias is not None for m in linears):
        return [m(x) for m in linears]
    weights = [m.weight for m in linears]
    dtype = _autocast_dtype(x)
    weight = torch.cat(weights) if dtype is None else compute_weights_cat(weights, dtype)
    out = F.linear(x, weight)
    return list(out.split([m.out_features for m in linears], dim=-1))


def _forward_output(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an autograd Function's forward returns for its result ``t``: ``t`` in ``dtype``, and under
    ``torch.compile`` never ``t`` itself when the forward wrote into ``t`` in place or ``t`` is the Function's own
    intermediate returned through a no-op cast. torch 2.11's compiler turns such an output into wrong (zero)
    gradients for every input of the Function; a copy while tracing costs nothing in eager mode."""
    if t.dtype != dtype:
        return t.to(dtype)
    return t.clone() if torch.compiler.is_compiling() else t


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        with torch.autocast(x.device.type, enabled=False):
            xf = x.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = _forward_output(xf * rstd * weight.float(), x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            xhat = x.float() * rstd
            dyw = dy.float() * weight.float()
            dx = rstd * (dyw - xhat * (dyw * xhat).mean(-1, keepdim=True))
            dw = None
            if ctx.needs_input_grad[1]:
                dw = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx.to(x.dtype), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) · weight`` over the last dim in fp32, returned in ``x``'s dtype; saves ``x`` and the fp32
    ``1/rms`` ``[..., 1]`` for backward (fp64 inputs: plain autograd in fp64; CUDA tensors: the fused kernel of
    `fused.rms_norm`, as `fused.MODE` says)."""
    if x.dtype == torch.float64:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)
    if fused is not None and fused.use_fused(x):
        return fused.rms_norm(x, weight, eps)
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32, returned in the input dtype (`rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _situ_glu_math(a: torch.Tensor, c: torch.Tensor, gate_beta: float, up_beta: float) -> torch.Tensor:
    return (gate_beta * torch.tanh(a / gate_beta) * torch.sigmoid(a)) * (up_beta * torch.tanh(c / up_beta))


SITU_BLOCK_ELEMENTS = 1 << 24
"""Elements per fp32 block of `situ_glu` (64 MB temporaries however many rows come in)."""


def _row_blocks(x: torch.Tensor):
    rows = max(1, SITU_BLOCK_ELEMENTS // max(1, x.shape[-1]))
    return range(0, x.shape[0], rows), rows


class _SiTUGLUFunction(torch.autograd.Function):
    """Inputs flattened to ``[N, F]``; fp32 math in row blocks of `SITU_BLOCK_ELEMENTS`."""

    @staticmethod
    def forward(ctx, a, c, gate_beta, up_beta):
        ctx.save_for_backward(a, c)
        ctx.betas = (gate_beta, up_beta)
        out = torch.empty_like(a)
        starts, rows = _row_blocks(a)
        with torch.autocast(a.device.type, enabled=False):
            for i in starts:
                out[i : i + rows] = _situ_glu_math(a[i : i + rows].float(), c[i : i + rows].float(), gate_beta,
                                                   up_beta)
        return out

    @staticmethod
    def backward(ctx, dy):
        a, c = ctx.saved_tensors
        b1, b2 = ctx.betas
        da, dc = torch.empty_like(a), torch.empty_like(c)
        starts, rows = _row_blocks(a)
        with torch.autocast(a.device.type, enabled=False):
            for i in starts:
                af, cf, dyf = a[i : i + rows].float(), c[i : i + rows].float(), dy[i : i + rows].float()
                t1, s, t2 = torch.tanh(af / b1), torch.sigmoid(af), torch.tanh(cf / b2)
                gate, up = b1 * t1 * s, b2 * t2
                da[i : i + rows] = dyf * up * ((1 - t1 * t1) * s + gate * (1 - s))
                dc[i : i + rows] = dyf * gate * (1 - t2 * t2)
        return da, dc, None, None


def situ_glu(a: torch.Tensor, c: torch.Tensor, gate_beta: float, up_beta: float,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """SiTU-GLU activation ``β1·tanh(a/β1)·σ(a) ⊙ β2·tanh(c/β2)`` (each factor bounded, product by β1·β2), in fp32,
    returned in ``a``'s dtype; saves only ``a`` and ``c`` for backward (fp64 inputs: plain autograd; CUDA tensors:
    the fused kernel of `fused.situ_glu`, as `fused.MODE` says). ``scale`` (shape ``a.shape[:-1]``, or None)
    multiplies each row: inside the fused kernel in fp32, elsewhere after the activation in ``a``'s dtype."""
    if a.dtype == torch.float64:
        y = _situ_glu_math(a, c, gate_beta, up_beta)
        return y if scale is None else y * scale[..., None].to(y.dtype)
    if fused is not None and fused.use_fused(a, while_compiling=True):
        return fused.situ_glu(a, c, gate_beta, up_beta, scale)
    shape = a.shape
    y = _SiTUGLUFunction.apply(a.reshape(-1, shape[-1]), c.reshape(-1, shape[-1]), gate_beta, up_beta).view(shape)
    return y if scale is None else y * scale[..., None].to(y.dtype)


class SiTUGLU(nn.Module):
    """Gated MLP ``W_down[SiTU-GLU(W_gate x, W_up x)]`` (the dense layer 0 and the shared experts).

    Args:
        hidden: ``D``.
        width: ``F``.
        gate_beta, up_beta: SiTU bounds (K3: 4 and 25).
    """

    def __init__(self, hidden: int, width: int, gate_beta: float, up_beta: float) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, width, bias=False)
        self.up_proj = Linear(hidden, width, bias=False)
        self.down_proj = Linear(width, hidden, bias=False)
        self.gate_beta, self.up_beta = gate_beta, up_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.gate_beta, self.up_beta))


class _AttnResFunction(torch.autograd.Function):
    """Saves the sources themselves (no stacked copy) and fp32 ``[S, B, T]`` rms, scores and weights."""

    @staticmethod
    def forward(ctx, query, norm_weight, eps, *sources):
        with torch.autocast(sources[0].device.type, enabled=False):
            u = norm_weight.float() * query.float()
            rstd, score = [], []
            for v in sources:
                vf = v.float()
                rstd.append(torch.rsqrt(vf.pow(2).mean(-1) + eps))
                score.append(vf @ u)
                del vf
            rstd_SBT, score_SBT = torch.stack(rstd), torch.stack(score)
            w_SBT = torch.softmax(rstd_SBT * score_SBT, dim=0)
            out = torch.zeros(sources[0].shape, dtype=torch.float32, device=sources[0].device)
            for i, v in enumerate(sources):
                out.addcmul_(v, w_SBT[i].unsqueeze(-1))
        ctx.save_for_backward(query, norm_weight, rstd_SBT, score_SBT, w_SBT, *sources)
        return _forward_output(out, sources[0].dtype)

    @staticmethod
    def backward(ctx, dh):
        query, norm_weight, rstd_SBT, score_SBT, w_SBT, *sources = ctx.saved_tensors
        D = dh.shape[-1]
        want_q = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        with torch.autocast(dh.device.type, enabled=False):
            dhf = dh.float()
            dw_SBT = torch.stack([(dhf * v).sum(-1) for v in sources])
            dlogit_SBT = w_SBT * (dw_SBT - (w_SBT * dw_SBT).sum(0, keepdim=True))
            u = norm_weight.float() * query.float()
            p = torch.zeros(D, dtype=torch.float32, device=dh.device)
            grads = []
            for i, v in enumerate(sources):
                want_v = ctx.needs_input_grad[3 + i]
                if not (want_v or want_q):
                    grads.append(None)
                    continue
                vf = v.float()
                c = (dlogit_SBT[i] * rstd_SBT[i]).unsqueeze(-1)  # d logit / d (v·u), per row
                if want_q:
                    p += (c * vf).reshape(-1, D).sum(0)
                if want_v:
                    r2 = (score_SBT[i] * rstd_SBT[i].pow(2) / D).unsqueeze(-1)
                    grads.append((w_SBT[i].unsqueeze(-1) * dhf + c * (u - r2 * vf)).to(v.dtype))
                else:
                    grads.append(None)
                del vf
            dq = (p * norm_weight.float()).to(query.dtype) if ctx.needs_input_grad[0] else None
            dnw = (p * query.float()).to(norm_weight.dtype) if ctx.needs_input_grad[1] else None
        return dq, dnw, None, *grads


def attn_res_mix(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``Σ_i softmax_i(qᵀ RMSNorm(V_i)) · V_i`` over ``sources`` (each ``[B, T, D]``; dtypes may differ, as autocast
    leaves them), fp32 inside, returned in the first source's dtype. Keeps for backward the sources themselves (no
    stacked copy) and fp32 ``[S, B, T]`` statistics; nothing of size ``S·B·T·D`` is materialised in either direction
    (CUDA tensors: the fused kernels of `fused.attn_res_mix`, as `fused.MODE` says)."""
    if sources[0].dtype == torch.float64:
        V = torch.stack(sources, 0)
        xn = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.to(V.dtype)
        w = torch.softmax((xn * query.to(V.dtype)).sum(-1), dim=0)
        return (w.unsqueeze(-1) * V).sum(0)
    if fused is not None and fused.use_fused(sources[0]):
        return fused.attn_res_mix(sources, query, norm_weight, eps)
    return _AttnResFunction.apply(query, norm_weight, eps, *sources)


class AttnResSite(nn.Module):
    """One Block Attention Residuals site: ``h = Σ_i softmax_i(wᵀ RMSNorm(V_i)) · V_i`` over the sources.

    The query ``w`` starts at zero, so a fresh site averages its sources uniformly.
    """

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.query = nn.Parameter(torch.zeros(hidden))

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """Mix ``sources`` (each ``[B, T, D]``) into one ``[B, T, D]`` tensor (softmax in fp32)."""
        if len(sources) == 1:
            return sources[0]
        return attn_res_mix(sources, self.query, self.norm.weight, self.norm.eps)
