"""RMSNorm, SiTU-GLU and the AttnRes site compute in fp32 with hand-written backwards that keep only their
inputs: outputs and every gradient equal plain fp64 autograd, and nothing of fp32 activation size is saved; the
projections of one input as one product (`shared_input_linears`) equal the modules called one by one."""

import pytest
import torch
import torch.nn as nn

from k3infra.model import layers
from k3infra.model.layers import attn_res_mix, rms_norm, shared_input_linears, situ_glu


def _check(fn, inputs, tol=1e-5):
    """fn on fp32 inputs (the custom functions) vs fn on fp64 inputs (plain autograd)."""
    ref_in = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    y, ref = fn(*inputs), fn(*ref_in)
    w = torch.randn(ref.shape, dtype=torch.float64)
    grads = torch.autograd.grad((y.double() * w).sum(), [t for t in inputs if t.requires_grad])
    ref_grads = torch.autograd.grad((ref * w).sum(), [t for t in ref_in if t.requires_grad])
    assert float((y.double() - ref).detach().abs().max()) < tol * max(1.0, float(ref.detach().abs().max()))
    for g, r in zip(grads, ref_grads):
        assert float((g.double() - r).norm() / r.norm().clamp(min=1e-12)) < tol * 10


def test_rms_norm_matches_autograd():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    _check(lambda x, w: rms_norm(x, w, 1e-5), [x, w])


@pytest.mark.parametrize("block", [1 << 24, 64])  # one block; 2-row blocks (the last one partial)
def test_situ_glu_matches_autograd(block, monkeypatch):
    monkeypatch.setattr(layers, "SITU_BLOCK_ELEMENTS", block)
    torch.manual_seed(0)
    a, c = (torch.randn(3, 7, 32).mul(6).requires_grad_() for _ in range(2))
    _check(lambda a, c: situ_glu(a, c, 4.0, 25.0), [a, c])


def test_attn_res_mix_matches_autograd():
    torch.manual_seed(0)
    sources = [torch.randn(2, 5, 16, requires_grad=True) for _ in range(4)]
    q, nw = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    _check(lambda q, nw, *s: attn_res_mix(list(s), q, nw, 1e-5), [q, nw, *sources])


def test_bf16_layers_save_no_fp32_activation_copies():
    torch.manual_seed(0)
    sources = [torch.randn(2, 64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(5)]
    q, nw = torch.zeros(32, requires_grad=True), torch.ones(32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = attn_res_mix(sources, q, nw, 1e-5)
        y = situ_glu(rms_norm(h, nw, 1e-5), h, 4.0, 25.0)
    assert y.dtype == torch.bfloat16
    big_fp32 = [t for t in saved if t.dtype == torch.float32 and t.numel() >= 2 * 64 * 32]
    assert not big_fp32, [tuple(t.shape) for t in big_fp32]
    known = {s.untyped_storage().data_ptr() for s in sources}
    new = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
           if t.untyped_storage().data_ptr() not in known}
    # bf16 h and rms_norm(h); fp32 per-row statistics: [S, B, T] rms, score, weight and rms_norm's [B, T, 1]
    assert sum(new.values()) <= 2 * (2 * 64 * 32 * 2) + 3 * 5 * 2 * 64 * 4 + 2 * 64 * 4 + 256


def test_shared_input_linears_match_the_modules():
    """One GEMM over the concatenated weights gives each module's output and every gradient (fp64: exact up to
    summation order); with a biased module among them the modules are called one by one."""
    torch.manual_seed(0)
    mods = (nn.Linear(24, 16, bias=False), nn.Linear(24, 5, bias=False), nn.Linear(24, 32, bias=False))
    mods = tuple(m.double() for m in mods)
    x = torch.randn(2, 7, 24, dtype=torch.float64, requires_grad=True)
    outs = shared_input_linears(x, mods)
    refs = [m(x) for m in mods]
    assert [o.shape for o in outs] == [r.shape for r in refs]
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    upstream = [torch.randn_like(r) for r in refs]
    params = [x, *(m.weight for m in mods)]
    got = torch.autograd.grad(outs, params, upstream)
    want = torch.autograd.grad(refs, params, upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    biased = (mods[0], nn.Linear(24, 3).double())
    calls = []
    biased[1].register_forward_hook(lambda *_: calls.append(1))
    outs = shared_input_linears(x, biased)
    assert calls == [1] and torch.equal(outs[1], biased[1](x))
