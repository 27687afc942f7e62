"""`fused_topk.biased_topk` (the router's selection) against ``torch.topk``: random scores, ties, widths that are not
a power of two, K3's 896 experts, and the router through both paths. On CPU the kernel runs in Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py)."""

import os

import pytest
import torch
import torch._dynamo.testing

from k3infra.model import fused
from k3infra.model.fused_topk import biased_topk
from k3infra.model.moe import Router

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)",
)


@pytest.mark.parametrize(("S", "E", "k"), [(37, 256, 9), (5, 896, 17), (3, 12, 12), (1, 7, 1)])
def test_matches_torch_topk(fused_on, device, S, E, k):
    g = torch.Generator().manual_seed(S * 1000 + E)
    scores = torch.rand(S, E, generator=g).to(device)
    bias = (0.1 * torch.randn(E, generator=g)).to(device)
    values, indices = biased_topk(scores, bias, k)
    ref = (scores + bias).topk(k, dim=1)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64 and values.shape == (S, k)
    torch.testing.assert_close(values, ref.values, rtol=0, atol=0)
    torch.testing.assert_close(indices, ref.indices, rtol=0, atol=0)


def test_ties_go_to_the_lower_index(fused_on, device):
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]], device=device)
    values, indices = biased_topk(scores, torch.zeros(5, device=device), 3)
    assert indices.tolist() == [[1, 3, 0], [0, 1, 2]]
    torch.testing.assert_close(values, scores.gather(1, indices), rtol=0, atol=0)


def test_router_selects_the_same_experts_through_both_paths(monkeypatch, device):
    torch.manual_seed(0)
    router = Router(hidden=24, num_experts=40, top_k=6, bins=16, margin_range=1.0).to(device)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.bias.copy_(0.05 * torch.randn(40))
    x = torch.randn(50, 24, device=device)
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(fused, "MODE", mode)
        router.qb_hist.zero_()
        idx, weights = router(x)
        out[mode] = (idx, weights, router.qb_hist.clone())
    for a, b in zip(out["off"], out["on"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_arguments_are_named():
    scores = torch.rand(4, 8)
    with pytest.raises(ValueError, match="scores_sE"):
        biased_topk(scores.double(), torch.zeros(8), 2)
    with pytest.raises(ValueError, match="bias_E"):
        biased_topk(scores, torch.zeros(7), 2)
    with pytest.raises(ValueError, match="k must"):
        biased_topk(scores, torch.zeros(8), 9)


@pytest.mark.parametrize(("S", "E", "k", "bins"), [(37, 256, 9, 64), (5, 896, 17, 2048), (9, 12, 3, 1)])
def test_margin_histogram_matches_the_torch_path(monkeypatch, device, S, E, k, bins):
    g = torch.Generator().manual_seed(S + E)
    scores = torch.rand(S, E, generator=g).to(device)
    scores[0, :4] = scores[0, 4]  # ties, margins of exactly zero
    bias = (0.1 * torch.randn(E, generator=g)).to(device)
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(fused, "MODE", mode)
        hist = torch.zeros(E, bins, device=device)
        values, indices = biased_topk(scores, bias, k, hist_EX=hist, margin_range=0.75)
        out[mode] = (values, indices, hist)
    for a, b in zip(out["off"], out["on"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    hist = out["on"][2]
    assert hist.sum().item() == S * E and (hist.sum(1) == S).all()
    # the k-th value's own margin is 0: the middle bin of its expert holds at least that token
    ref = ((scores - out["off"][0][:, -1:]) + 0.75) / 1.5 * bins
    assert hist[torch.arange(E, device=device)[None, :].expand(S, E), ref.long().clamp(0, bins - 1)].min() >= 1


def test_margin_histogram_accumulates_and_rejects_bad_buffers(fused_on, device):
    scores = torch.rand(6, 16, device=device)
    hist = torch.zeros(16, 8, device=device)
    biased_topk(scores, torch.zeros(16, device=device), 3, hist_EX=hist, margin_range=1.0)
    biased_topk(scores, torch.zeros(16, device=device), 3, hist_EX=hist, margin_range=1.0)
    assert hist.sum().item() == 2 * 6 * 16
    with pytest.raises(ValueError, match="hist_EX"):
        biased_topk(scores, torch.zeros(16, device=device), 3, hist_EX=torch.zeros(15, 8, device=device))
    with pytest.raises(ValueError, match="hist_EX"):
        biased_topk(scores, torch.zeros(16, device=device), 3, hist_EX=torch.zeros(8, 16, device=device).t())
    with pytest.raises(ValueError, match="margin_range"):
        biased_topk(scores, torch.zeros(16, device=device), 3, hist_EX=hist, margin_range=0.0)
    assert hist.sum().item() == 2 * 6 * 16  # a rejected call adds nothing


def test_compiled_graph_calls_the_kernel_operator(fused_on, device):
    torch._dynamo.reset()
    scores = torch.rand(21, 40, device=device)
    bias = 0.1 * torch.randn(40, device=device)

    def select(s, hist):
        values, indices = biased_topk(s, bias, 5, hist_EX=hist, margin_range=0.5)
        return values * 2, indices

    hist_eager, hist_compiled = torch.zeros(40, 32, device=device), torch.zeros(40, 32, device=device)
    ref = select(scores, hist_eager)
    counts = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    out = torch.compile(select, backend=counts, fullgraph=True)(scores, hist_compiled)
    assert counts.frame_count == 1
    for a, b in zip((*ref, hist_eager), (*out, hist_compiled)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    graph = "\n".join(str(g.graph) for g in counts.graphs)
    assert "k3infra.biased_topk" in graph and "topk(" not in graph.replace("biased_topk", "")
