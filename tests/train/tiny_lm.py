"""A small causal LM with the `K3ForCausalLM` forward contract, for trainer tests that must not depend on the
K3 model's speed: token embedding, segment-aware causal token mixing (respects ``cu_seqlens``), a top-k MoE with
a selection-only router bias, ``lm_head``, and the `transformers` label shift."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class TinyMoE(nn.Module):
    def __init__(self, d: int, experts: int, k: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(experts))
        self.register_buffer("bias", torch.zeros(experts))
        self.k = k
        self.updates = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(self.router(x).float())
        top = torch.topk(scores + self.bias, self.k, dim=-1).indices
        weights = torch.gather(scores, -1, top)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for slot in range(self.k):
            for e, expert in enumerate(self.experts):
                mask = (top[..., slot] == e).unsqueeze(-1).to(x.dtype)
                out = out + mask * weights[..., slot : slot + 1] * expert(x)
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
    """``K3Config -> TinyLM`` with the config's vocabulary."""
    return TinyLM(config.vocab_size)
