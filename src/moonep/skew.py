"""Routing skew models shared by tests, the demo and the benchmark (DESIGN §3).

Shape suffixes: s tokens, K top-k, E experts.

Every model draws ``topk_idx_sK`` from a seeded generator, so all ranks can regenerate every rank's
routing (``seed`` mixes in the rank) and check results exactly.
"""

from __future__ import annotations

import torch

SKEWS = ("uniform", "lognormal1", "lognormal2", "hot_rank", "one_expert", "repeated")
"""uniform: K distinct experts uniformly; lognormal1/2: distinct experts, popularity ``exp(sigma*z)``
with one popularity vector shared by all ranks; hot_rank: 80% of hits go to rank 0's experts;
one_expert: every token picks experts ``0..K-1`` (the hottest routing with distinct ids; expert 0 gets a
hit from every token); repeated: every token of a rank repeats one random set of K distinct experts."""


def expert_popularity(skew: str, num_experts: int, num_ranks: int, seed: int = 0) -> torch.Tensor:
    """``[E]`` float64 probabilities of each expert under a skew model (shared by every rank)."""
    if skew not in SKEWS:
        raise ValueError(f"skew must be one of {', '.join(SKEWS)}, got {skew!r}")
    gen = torch.Generator().manual_seed(10_007 * seed + 1)
    if skew.startswith("lognormal"):
        sigma = float(skew[len("lognormal") :])
        pop = torch.exp(sigma * torch.randn(num_experts, generator=gen, dtype=torch.float64))
    elif skew == "hot_rank":
        per_rank = num_experts // num_ranks
        pop = torch.full((num_experts,), 0.2 / max(num_experts - per_rank, 1), dtype=torch.float64)
        pop[:per_rank] = 0.8 / per_rank if num_ranks > 1 else pop[:per_rank]
    elif skew == "one_expert":
        pop = torch.zeros(num_experts, dtype=torch.float64)
        pop[0] = 1.0
    else:
        pop = torch.ones(num_experts, dtype=torch.float64)
    return pop / pop.sum()


def make_routing(
    skew: str,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    num_ranks: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one rank's routing under a skew model.

    Args:
        skew: one of `SKEWS`.
        num_tokens: ``s`` (0 allowed).
        top_k: ``K``.
        num_experts: ``E``.
        num_ranks: ``R`` (used by ``hot_rank``).
        rank: which rank's routing (mixed into the seed).
        seed: base seed.

    Returns:
        ``(topk_idx_sK int64, topk_weights_sK float32)``; weights are multiples of 1/8 in ``[1/8, 1]``.
    """
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts}): a token's experts are distinct")
    pop = expert_popularity(skew, num_experts, num_ranks, seed)
    gen = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + 17)
    if num_tokens == 0:
        idx = torch.zeros((0, top_k), dtype=torch.long)
    elif skew == "one_expert":
        idx = torch.arange(top_k).expand(num_tokens, top_k).clone()
    elif skew == "repeated":
        idx = torch.randperm(num_experts, generator=gen)[:top_k].expand(num_tokens, top_k).clone()
    else:
        # Distinct experts per token, drawn with probability ~ popularity (Gumbel top-k).
        gumbel = -torch.log(-torch.log(torch.rand((num_tokens, num_experts), generator=gen, dtype=torch.float64)))
        idx = (pop.clamp(min=1e-300).log()[None] + gumbel).topk(top_k, dim=1).indices
    # Dyadic weights (multiples of 1/8) keep fp32 sums in tests exact.
    weights = torch.randint(1, 9, (num_tokens, top_k), generator=gen).float() / 8
    return idx.to(device), weights.to(device)
