"""Activation checkpointing (``gradient_checkpointing_enable``, non-reentrant) gives the gradients of the plain
backward, with the torch KDA path and through FlashKDA's autograd function (Triton's CPU interpreter in CI)."""

import os

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _grads(model, ids, cu):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, cu_seqlens=cu).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["torch", pytest.param("flashkda", marks=pytest.mark.skipif(
    not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1"))])
def test_gradient_checkpointing_matches_plain_backward(backend):
    torch.manual_seed(0)
    config = K3Config.from_preset("k3-debug", kda_backend=backend)
    model = K3ForCausalLM(config).to(DEVICE).train()
    ids = torch.randint(0, 512, (1, 48), device=DEVICE)
    cu = torch.tensor([0, 20, 48], dtype=torch.int32, device=DEVICE)
    state = {n: b.clone() for n, b in model.named_buffers()}
    loss, plain = _grads(model, ids, cu)
    model.load_state_dict(state, strict=False)  # QB histograms and max-logit records back to their start
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    assert model.model.gradient_checkpointing
    loss_ckpt, ckpt = _grads(model, ids, cu)
    assert loss_ckpt == pytest.approx(loss, abs=1e-6)
    assert plain.keys() == ckpt.keys() and len(plain) > 20
    for name, g in plain.items():
        assert torch.allclose(ckpt[name], g, rtol=1e-4, atol=1e-6), name
