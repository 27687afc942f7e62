"""The K3 KDA layer through FlashKDA's Triton kernels (CPU interpreter without a GPU) against the torch path:
training forward/backward with packed sequences, and decode through `fused_recurrent_kda`."""

import os

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM
from k3infra.model.kda import K3KDA

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_flashkda_layer_matches_torch_path_varlen():
    torch.manual_seed(0)
    layer = K3KDA(K3Config.from_preset("k3-debug"), 0).to(DEVICE)
    layer.reset_kda_parameters()
    x = torch.randn(1, 40, 64, device=DEVICE, requires_grad=True)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=DEVICE)
    results = {}
    for backend in ("torch", "flashkda"):
        layer.backend = backend
        y = layer(x, cu_seqlens=cu)
        weights = torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)
        grads = torch.autograd.grad((y * weights).sum(), [x, *layer.parameters()], allow_unused=True)
        results[backend] = (y, grads)
    assert _rel(results["flashkda"][0], results["torch"][0]) < 1e-5
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, results["flashkda"][1], results["torch"][1]):
        assert _rel(a, b) < 1e-4, name


def test_flashkda_decode_matches_torch_full_forward():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug", kda_backend="flashkda")).to(DEVICE).eval()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        out = model(ids[:, :10], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in (10, 11):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
        model.config.kda_backend = "torch"
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "backend"):
                layer.self_attn.backend = "torch"
        full = model(ids, use_cache=False).logits
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
