"""A small causal LM with the `K3ForCausalLM` forward contract, for trainer tests that must not depend on the
K3 model's speed: token embedding, segment-aware causal token mixing (respects ``cu_seqlens``), a top-k MoE with
a selection-only router bias, ``lm_head``, and the `transformers` label shift.

``enable_expert_parallel(group)`` keeps ``E / ep`` experts per rank; tokens are exchanged with autograd-aware
all-gather / all-reduce (a plain collective EP, not MoonEP), enough to exercise the trainer's EP plumbing."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn


class TinyMoE(nn.Module):
    def __init__(self, d: int, experts: int, k: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, d) * d**-0.5)
        self.register_buffer("bias", torch.zeros(experts))
        self.k = k
        self.updates = 0
        self.first = 0
        self.group = None
        self.ep_size = 1

    def shard(self, group) -> None:
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        per = self.w1.shape[0] // ep
        self.first = rank * per
        self.w1 = nn.Parameter(self.w1.detach()[self.first : self.first + per].clone())
        self.group, self.ep_size = group, ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(self.router(x).float())
        top = torch.topk(scores + self.bias, self.k, dim=-1).indices
        weights = torch.gather(scores, -1, top)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        if self.group is not None:
            tokens = x.shape[1]
            x = torch.cat(dist_fn.all_gather(x, group=self.group), 1)
            weights = torch.cat(dist_fn.all_gather(weights, group=self.group), 1)
            gathered = [torch.empty_like(top) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(gathered, top, group=self.group)
            top = torch.cat(gathered, 1)
        out = torch.zeros_like(x)
        for slot in range(self.k):
            for e, w in enumerate(self.w1, start=self.first):
                mask = (top[..., slot] == e).unsqueeze(-1).to(x.dtype)
                out = out + mask * weights[..., slot : slot + 1] * (x @ w.t())
        if self.group is not None:
            out = dist_fn.all_reduce(out, group=self.group)
            rank = dist.get_rank(self.group)
            out = out[:, rank * tokens : (rank + 1) * tokens]
        return out

    def update_balancing(self) -> None:
        self.updates += 1


class TinyLayer(nn.Module):
    def __init__(self, d: int, experts: int, k: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.mix = nn.Linear(2 * d, d, bias=False)
        self.moe = TinyMoE(d, experts, k)

    def forward(self, h: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        prev = torch.roll(x, 1, dims=1) * (~starts).unsqueeze(-1).to(x.dtype)
        h = h + self.mix(torch.cat([x, prev], -1))
        return h + self.moe(h)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int = 32, layers: int = 2, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(TinyLayer(d, experts, k) for _ in range(layers))
        self.model.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def enable_expert_parallel(self, group, *, max_tokens_per_rank: int, dtype=None, device=None) -> None:
        for moe in self.moe_layers():
            moe.shard(group)

    def moe_layers(self) -> list[TinyMoE]:
        return [layer.moe for layer in self.model.layers]

    def forward(self, input_ids, cu_seqlens=None, labels=None, **_):
        starts = torch.zeros_like(input_ids, dtype=torch.bool)
        starts[:, 0] = True
        if cu_seqlens is not None:
            starts[0, cu_seqlens[:-1].long()] = True
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, starts)
        logits = self.lm_head(self.model.norm(h)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return SimpleNamespace(loss=loss, logits=logits)


def tiny_factory(config) -> TinyLM:
    """``K3Config -> TinyLM`` with the config's vocabulary and routed-expert count."""
    return TinyLM(config.vocab_size, experts=config.n_routed_experts // 4)
