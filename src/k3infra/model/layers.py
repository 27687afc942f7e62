"""Small building blocks of the K3 decoder: RMSNorm, the SiTU-GLU MLP and a Block Attention Residuals site.

Shape suffixes: B batch, T tokens, D hidden, F MLP width, S residual sources.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["AttnResSite", "RMSNorm", "SiTUGLU", "situ_glu"]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def situ_glu(a: torch.Tensor, c: torch.Tensor, gate_beta: float, up_beta: float) -> torch.Tensor:
    """SiTU-GLU activation ``β1·tanh(a/β1)·σ(a) ⊙ β2·tanh(c/β2)`` (each factor bounded, product by β1·β2)."""
    return (gate_beta * torch.tanh(a / gate_beta) * torch.sigmoid(a)) * (up_beta * torch.tanh(c / up_beta))


class SiTUGLU(nn.Module):
    """Gated MLP ``W_down[SiTU-GLU(W_gate x, W_up x)]`` (the dense layer 0 and the shared experts).

    Args:
        hidden: ``D``.
        width: ``F``.
        gate_beta, up_beta: SiTU bounds (K3: 4 and 25).
    """

    def __init__(self, hidden: int, width: int, gate_beta: float, up_beta: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.gate_beta, self.up_beta = gate_beta, up_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.gate_beta, self.up_beta))


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
        V_SBTD = torch.stack(sources, 0)
        logits_SBT = (self.norm(V_SBTD).float() * self.query.float()).sum(-1)
        weights_SBT = F.softmax(logits_SBT, dim=0).to(V_SBTD.dtype)
        return (weights_SBT.unsqueeze(-1) * V_SBTD).sum(0)
