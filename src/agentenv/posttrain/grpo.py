"""GRPO and SFT losses on masked token sequences (a compact trainer on torch).

GRPO: per group of rollouts of one prompt, advantage ``A_i = (r_i - mean(r)) / (std(r) + eps)``; per token the
clipped surrogate ``min(rho * A, clip(rho, 1 - eps_clip, 1 + eps_clip) * A)`` with ``rho = exp(logp - logp_old)``,
averaged over each sequence's trained tokens, then over sequences; optional KL to a reference policy with the
``k3`` estimator ``exp(ref - logp) - (ref - logp) - 1``, weighted by `beta`.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``rewards [G, N] -> advantages [G, N]``: rewards normalised within each group (row)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_eps: float = 0.2, beta: float = 0.0, logp_ref: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO loss.

    Args:
        logp, logp_old: per-token log-probs under the policy being trained and the sampling policy, ``[B, T]``.
        advantages: one per sequence, ``[B]``.
        mask: trained tokens, ``[B, T]`` bool.
        beta, logp_ref: KL weight and reference log-probs ``[B, T]`` (needed when ``beta > 0``).

    Returns:
        ``(loss scalar, stats)`` with ``clip_frac`` and ``kl``.
    """
    if beta > 0 and logp_ref is None:
        raise ValueError("logp_ref is required when beta > 0")
    m = mask.float()
    ratio = torch.exp(logp - logp_old)
    adv = advantages.unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if beta > 0:
        diff = logp_ref - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + beta * kl
    counts = m.sum(dim=1).clamp(min=1)
    loss = ((per_token * m).sum(dim=1) / counts).mean()
    clipped = ((ratio - 1).abs() > clip_eps).float()
    stats = {"clip_frac": float((clipped * m).sum() / m.sum().clamp(min=1)),
             "kl": float((kl.detach() * m).sum() / m.sum().clamp(min=1))}
    return loss, stats


def sft_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the trained tokens: ``logp [B, T], mask [B, T] -> scalar``."""
    m = mask.float()
    return -(logp * m).sum() / m.sum().clamp(min=1)
