"""The local expert path's token sort (`moe._SortedCopies`, `moe._SlotSums`, `moe._PermutedRows`): forward and
gradients equal to plain indexing (``h[order // K]``, ``y[unsort]`` summed per token, whose backwards scatter) in
fp64, through a whole MoE layer."""

import pytest
import torch

from k3infra.model import K3Config, moe


def _layer():
    torch.manual_seed(0)
    config = K3Config.from_preset("k3-debug")
    layer = moe.K3MoE(config).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer, config.hidden_size


def _run(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def test_sort_and_slot_sums_match_plain_indexing(monkeypatch):
    layer, hidden = _layer()
    x = torch.randn(2, 13, hidden, dtype=torch.float64)
    ours = _run(layer, x)
    layer.zero_grad()
    monkeypatch.setattr(moe._SortedCopies, "apply", lambda h, token, slots: h[token])
    monkeypatch.setattr(moe._SlotSums, "apply",
                        lambda y, token, slots: y[slots.flatten()].view(*slots.shape, -1).sum(1))
    monkeypatch.setattr(moe._PermutedRows, "apply", lambda y, perm, inverse: y[perm])
    plain = _run(layer, x)
    torch.testing.assert_close(ours[0], plain[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[1], plain[1], rtol=1e-10, atol=1e-12)
    assert ours[2].keys() == plain[2].keys() and {"w1", "w2", "w3"} <= ours[2].keys()
    for name, grad in plain[2].items():
        torch.testing.assert_close(ours[2][name], grad, rtol=1e-10, atol=1e-12, msg=name)


def _sort(s, K, g):
    order = torch.randperm(s * K, generator=g)
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(s * K)
    return order // K, unsort.view(s, K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sorted_copies_sum_each_tokens_slots_in_fp32(dtype):
    s, K, L = 5, 3, 4
    g = torch.Generator().manual_seed(1)
    h = torch.randn(s, L, generator=g).to(dtype).requires_grad_()
    token, slots = _sort(s, K, g)
    rows = moe._SortedCopies.apply(h, token, slots)
    torch.testing.assert_close(rows, h.detach()[token], rtol=0, atol=0)
    grad = torch.randn(s * K, L, generator=g).to(dtype)
    rows.backward(grad)
    expected = torch.zeros(s, L, dtype=torch.float64).index_add_(0, token, grad.double())
    assert h.grad.dtype == dtype
    torch.testing.assert_close(h.grad.double(), expected.to(dtype).double(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_sums_are_fp32_token_sums_and_copy_gradients_back(dtype):
    s, K, L = 6, 4, 5
    g = torch.Generator().manual_seed(3)
    token, slots = _sort(s, K, g)
    y = torch.randn(s * K, L, generator=g).to(dtype).requires_grad_()
    u = moe._SlotSums.apply(y, token, slots)
    expected = torch.zeros(s, L, dtype=torch.float64).index_add_(0, token, y.detach().double())
    assert u.dtype == torch.float32
    torch.testing.assert_close(u.double(), expected, rtol=1e-6, atol=1e-6)
    grad = torch.randn(s, L, generator=g)
    u.backward(grad)
    assert y.grad.dtype == dtype
    torch.testing.assert_close(y.grad, grad.to(dtype)[token], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_router_logits_function_matches_autograd(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 24, generator=g).to(dtype).requires_grad_()
    w = torch.randn(10, 24, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    w.requires_grad_()
    grad = torch.randn(37, 10, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ours = moe._RouterLogits.apply(x, w)
    ours.backward(grad)
    got = (ours.detach(), x.grad, w.grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = x2.to(w2.dtype) @ w2.t()
    ref.backward(grad)
    assert ours.dtype == w.dtype and x.grad.dtype == dtype and w.grad.dtype == w.dtype
    for a, b in zip(got, (ref.detach(), x2.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=0 if dtype == torch.float64 else 1e-5, atol=1e-12)


def _router_case(device="cpu"):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 256, generator=g).bfloat16().to(device)
    w = (torch.randn(64, 256, generator=g) * 0.05).to(device)
    grad = torch.randn(300, 64, generator=g).to(device) * 1e-3
    return x, w, grad


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def test_router_split_products_reach_fp32_precision():
    x, w, grad = _router_case()
    xd, wd, gd = x.double(), w.double(), grad.double()
    ref = xd @ wd.t(), gd @ wd, gd.t() @ xd
    fp32 = x.float() @ w.t(), grad @ w, grad.t() @ x.float()
    split = (moe.router_logits_split(x, w), *moe.router_logits_split_backward(grad, x, w))
    for name, s, f, r in zip(("logits", "grad_x", "grad_w"), split, fp32, ref):
        assert s.dtype == torch.float32, name
        # grad_x uses two-part splits (it is rounded to bf16 after): 2^-16 is far below bf16's 2^-8
        bound = 2e-5 if name == "grad_x" else 3 * _rel(f, r) + 1e-7
        assert _rel(s, r) <= bound, (name, _rel(s, r), _rel(f, r))
    # a one-part product would not pass: the test can tell the split from a plain bf16 cast
    assert _rel(x.float() @ w.bfloat16().float().t(), ref[0]) > 100 * _rel(split[0], ref[0])


def test_router_split_backward_skips_gradients_not_needed():
    x, w, grad = _router_case()
    gx, gw = moe.router_logits_split_backward(grad, x, w, needs=(False, True))
    assert gx is None and gw.shape == w.shape
    gx, gw = moe.router_logits_split_backward(grad, x, w, needs=(True, False))
    assert gw is None and gx.shape == x.shape


@pytest.mark.gpu
def test_router_logits_function_splits_on_cuda():
    x, w, grad = _router_case("cuda")
    x.requires_grad_(), w.requires_grad_()
    out = moe._RouterLogits.apply(x, w)
    out.backward(grad)
    xd, wd, gd = x.detach().double(), w.detach().double(), grad.double()
    assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(out.detach(), xd @ wd.t()) < 1e-6
    assert _rel(w.grad, gd.t() @ xd) < 1e-6
    assert _rel(x.grad, gd @ wd) < 8e-3
