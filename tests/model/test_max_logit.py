"""The MLA max-logit kernel of `k3infra.model.max_logit` against the eager fp32 recompute (the reference) and a
plain fp64 ``q·kᵀ`` with a causal, per-sequence mask: packed sequences with empty and one-token members, batch
rows without packing, head widths that are not a power of two, fp32 and bf16 inputs, strided views as MLA passes
them. On CPU the kernel runs in Triton's interpreter (``fused.MODE = "on"``)."""

import os

import pytest
import torch

from k3infra.model import fused
from k3infra.model.max_logit import causal_max_logit

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)",
)


def _fp64_max(q, k, bounds, scale):
    B, H, T, _ = q.shape
    spans = [(0, T)] if bounds is None else list(zip(bounds[:-1], bounds[1:]))
    best = torch.full((H,), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for a, e in spans:
            for t in range(a, e):
                logits = q[b, :, t : t + 1].double().cpu() @ k[b, :, a : t + 1].double().cpu().transpose(-1, -2)
                best = torch.maximum(best, (logits * scale).amax((-2, -1)))
    return best


def _inputs(B, H, T, E, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    # [B, T, H, E] memory viewed [B, H, T, E], as MLA's transposes hand them over
    q = (torch.randn(B, T, H, E, generator=g) * 2).to(device, dtype).transpose(1, 2)
    k = (torch.randn(B, T, H, E, generator=g) * 2).to(device, dtype).transpose(1, 2)
    # a large logit late in one sequence, between a query and an earlier key, and a larger one that is not causal
    q[0, 0, T - 2] = 4.0
    k[0, 0, T - 5] = 4.0
    k[0, 1, T - 1] = 8.0
    q[0, 1, T - 3] = 8.0
    return q, k


CASES = {  # (B, H, T, E, bounds)
    "packed": (1, 3, 70, 24, [0, 17, 17, 18, 51, 70]),
    "one-sequence-wide-head": (1, 2, 40, 192, [0, 40]),
    "batch-rows": (2, 2, 33, 40, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_kernel_matches_eager_and_fp64(device, monkeypatch, case, dtype):
    B, H, T, E, bounds = CASES[case]
    q, k = _inputs(B, H, T, E, dtype, device, seed=len(case))
    scale = E**-0.5
    monkeypatch.setattr(fused, "MODE", "off")
    eager = causal_max_logit(q, k, bounds, scale)
    monkeypatch.setattr(fused, "MODE", "on")
    got = causal_max_logit(q, k, bounds, scale)
    ref = _fp64_max(q, k, bounds, scale)
    assert got.dtype == torch.float32 and got.shape == (H,)
    # the same bf16/fp32 products summed in another order: fp32 rounding only
    torch.testing.assert_close(got.cpu().double(), eager.cpu().double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_a_non_causal_pair_never_counts(device, monkeypatch):
    monkeypatch.setattr(fused, "MODE", "on")
    q = torch.zeros(1, 1, 20, 16, device=device)
    k = torch.zeros(1, 1, 20, 16, device=device)
    q[0, 0, 3, 0] = 1.0
    k[0, 0, 9, 0] = 100.0  # key after the query: masked
    k[0, 0, 2, 0] = 2.0
    assert causal_max_logit(q, k, [0, 20], 1.0).item() == 2.0
    # the same key in an earlier packed sequence is masked too
    assert causal_max_logit(q, k, [0, 3, 20], 1.0).item() == 0.0


def test_bad_arguments(device):
    q = torch.zeros(1, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match="k_BHSE"):
        causal_max_logit(q, torch.zeros(1, 2, 4, 16, device=device), None, 1.0)
    with pytest.raises(ValueError, match="bounds"):
        causal_max_logit(q, q, [0, 5], 1.0)
