"""`linear_ce.linear_cross_entropy_sum` against ``F.cross_entropy`` over the full logits: loss and gradients of the
hidden states and the head's weight, ignored targets, pieces that do not divide the tokens, a frozen head, autocast,
and the Triton pass (Triton's CPU interpreter here, ``TRITON_INTERPRET=1`` from tests/conftest.py) against the torch
one."""

import os

import pytest
import torch
import torch.nn.functional as F

from benchmarks.harness import rms_ratio
from k3infra.model import fused
from k3infra.model.linear_ce import IGNORE_INDEX, linear_cross_entropy_sum

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)",
)


def _case(N, D, V, dtype=torch.float64, ignored=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) / D**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.randperm(N, generator=g)[:ignored]] = IGNORE_INDEX
    return h, w, t


def _reference(h, w, t):
    loss = F.cross_entropy(h @ w.t(), t, ignore_index=IGNORE_INDEX, reduction="sum")
    gh, gw = torch.autograd.grad(loss * 0.37, (h, w))
    return loss.detach(), gh, gw


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_matches_cross_entropy_over_the_full_logits(chunk):
    h, w, t = _case(N=23, D=12, V=37)
    ref_loss, ref_h, ref_w = _reference(h, w, t)
    loss = linear_cross_entropy_sum(h, w, t, chunk)
    gh, gw = torch.autograd.grad(loss * 0.37, (h, w))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(gh, ref_h, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gw, ref_w, rtol=1e-6, atol=1e-7)


def test_ignored_rows_add_nothing_and_a_frozen_head_gets_no_gradient():
    h, w, t = _case(N=10, D=8, V=16, ignored=10)
    w.requires_grad_(False)
    loss = linear_cross_entropy_sum(h, w, t, 4)
    assert float(loss.detach()) == 0.0
    (gh,) = torch.autograd.grad(loss, (h,))
    assert torch.count_nonzero(gh) == 0
    h2, w2, t2 = _case(N=10, D=8, V=16)
    w2.requires_grad_(False)
    linear_cross_entropy_sum(h2, w2, t2, 3).backward()
    assert w2.grad is None and h2.grad is not None and torch.count_nonzero(h2.grad) > 0


def test_no_grad_gives_the_loss_alone_and_int32_targets_work():
    h, w, t = _case(N=12, D=8, V=20)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h, w, t.int(), 5)
    assert not loss.requires_grad
    torch.testing.assert_close(loss.double(), _reference(h, w, t)[0], rtol=1e-6, atol=0)


def test_autocast_computes_in_bf16_as_accurately_as_f_linear():
    h, w, t = _case(N=40, D=32, V=50, dtype=torch.float32)
    exact_loss, exact_h, exact_w = _reference(*(x.detach().double().requires_grad_() for x in (h, w)), t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")
        ref_h, ref_w = torch.autograd.grad(ref * 0.37, (h, w))
        loss = linear_cross_entropy_sum(h, w, t, 16)
        gh, gw = torch.autograd.grad(loss * 0.37, (h, w))
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)  # the same bf16 logits, summed in another order
    # the gradients round the logits' gradient to bf16 as the F.linear path does, the weight's per piece of 16 rows
    for ours, theirs, exact in ((gh, ref_h, exact_h), (gw, ref_w, exact_w)):
        assert rms_ratio(ours, exact) <= 1.5 * rms_ratio(theirs, exact) < 2e-2


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_pass_matches_the_torch_pass(monkeypatch, device, dtype):
    h, w, t = _case(N=19, D=16, V=300, dtype=torch.float32, seed=1)
    h, w = (x.detach().to(device, dtype).requires_grad_() for x in (h, w))
    t = t.to(device)
    grads = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(fused, "MODE", mode)
        loss = linear_cross_entropy_sum(h, w, t, 8)
        grads[mode] = (loss, *torch.autograd.grad(loss, (h, w)))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    for off, on in zip(grads["off"], grads["on"]):
        torch.testing.assert_close(on.float(), off.float(), **tol)
    ref_loss, _, _ = _reference(*(x.detach().double().requires_grad_() for x in (h, w)), t)
    torch.testing.assert_close(grads["on"][0].double(), ref_loss, rtol=1e-4 if dtype == torch.float32 else 1e-2,
                               atol=0)


def test_bad_arguments_are_named():
    h, w, t = _case(N=6, D=4, V=9)
    with pytest.raises(ValueError, match="weight_VD"):
        linear_cross_entropy_sum(h, w[:, :3], t)
    with pytest.raises(ValueError, match="target_N"):
        linear_cross_entropy_sum(h, w, t[:5])
    with pytest.raises(ValueError, match="target_N"):
        linear_cross_entropy_sum(h, w, t.float())
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy_sum(h, w, t, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device machine)")
def test_cuda_bf16_errs_no_more_than_checkpointed_pieces():
    """At a k3-mini vocabulary on the GPU, the Triton pass (rounding to nearest) against fp64: loss, dh and dW no
    worse than the checkpointed-pieces baseline's."""
    from benchmarks.train.loss import _errors, _inputs, checkpointed_pieces

    h, w, t = _inputs(1000, 256, 32768, "cuda", seed=3)
    ours = _errors(linear_cross_entropy_sum, h, w, t, 384, "cuda")
    base = _errors(checkpointed_pieces, h, w, t, 384, "cuda")
    for name in ("loss", "dh", "dW"):
        assert ours[name] <= 1.05 * base[name] + 1e-7, (name, ours, base)
