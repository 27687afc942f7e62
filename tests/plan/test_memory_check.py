"""The memory-check benchmark's training step keeps the planner's layout: bf16 weights, fp32 main grads, fp32
master weights with AdamW states."""

from __future__ import annotations

import torch

from benchmarks.plan.memory_check import VARIANTS, _train_step_fn, predict
from k3infra.model.config import K3Config


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_train_step_layout_and_progress():
    torch.manual_seed(0)
    model = _TinyLM()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    step = _train_step_fn(model, torch, "cpu")
    ids = torch.randint(0, 16, (2, 8))
    losses = [step(ids) for _ in range(20)]
    assert losses[-1] < losses[0]
    for p in model.parameters():
        assert p.dtype == torch.bfloat16 and p.grad is None
        assert p.main_grad.dtype == torch.float32 and not p.main_grad.any()


def test_every_variant_has_a_prediction():
    config = K3Config.from_preset("k3-mini")
    kinds = {v.kind for v in VARIANTS}
    assert kinds == {"train", "serve"} and sum(v.kind == "train" for v in VARIANTS) >= 6
    for v in VARIANTS:
        assert 1e9 < predict(v, config)["total"] < 141e9
