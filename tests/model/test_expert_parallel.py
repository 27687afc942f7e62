"""Expert parallel through MoonEP (gloo, 2 ranks): each rank's loss and every gradient equal the
single-process model with the same weights (relative error <= 1e-4, fp32; only the summation order differs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from k3infra.testing import run_ranks

pytestmark = pytest.mark.multiproc

B, T = 2, 12


def _model():
    from k3infra.model import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug", kda_chunk_size=8)).train()
    with torch.no_grad():  # favour the first experts so the balanced plan must place redundant copies
        for moe in model.moe_layers():
            moe.router.bias[:4] = 0.3
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(10 + rank))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _check(rank: int, world: int) -> dict:
    reference = _model()
    ref_losses = []
    for r in range(world):
        ids = _batch(r)
        loss = reference(ids, labels=ids).loss
        loss.backward()
        ref_losses.append(float(loss))
    model = _model()
    model.enable_expert_parallel(None, max_tokens_per_rank=B * T, dtype=torch.float32)
    E = model.config.n_routed_experts
    P = E // world
    assert all(m.w1.shape[0] == P for m in model.moe_layers())
    ids = _batch(rank)
    loss = model(ids, labels=ids).loss
    loss.backward()
    errors = {"loss": abs(float(loss) - ref_losses[rank]) / abs(ref_losses[rank])}
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad
        ref = ref_params[name].grad
        if name.endswith((".w1", ".w2", ".w3")):
            ref = ref[rank * P : (rank + 1) * P]  # home experts: their grads already hold every rank's tokens
        elif grad is not None:
            grad = grad.clone()
            dist.all_reduce(grad)  # replicated: sum over the data each rank saw
        if ref is None:
            assert grad is None or float(grad.abs().max()) == 0, name
            continue
        errors[name] = _rel(grad, ref)
    return errors


@pytest.mark.parametrize("world", [2])
def test_expert_parallel_matches_single_process(world):
    for rank_errors in run_ranks(_check, world, timeout_s=240):
        worst = max(rank_errors, key=rank_errors.get)
        assert rank_errors[worst] <= 1e-4, (worst, rank_errors[worst])
