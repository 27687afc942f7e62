"""The Triton combine reduction equals the torch reduction (Triton's interpreter on CPU; real kernel on GPU)."""

from __future__ import annotations

import pytest
import torch

from moonep.ops import reduce_slots

pytest.importorskip("triton")

CASES = [
    # (T, K, C, H, weighted, dtype)
    pytest.param(7, 3, 9, 5, True, torch.float32, id="T7-K3-C9-H5-w-fp32"),
    pytest.param(12, 4, 20, 33, False, torch.float32, id="T12-K4-C20-H33-fp32"),
    pytest.param(5, 2, 6, 40, True, torch.bfloat16, id="T5-K2-C6-H40-w-bf16"),
    pytest.param(0, 2, 4, 8, True, torch.float32, id="T0-empty"),
]


def _case(T: int, K: int, C: int, H: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(T * 31 + H)
    y = torch.randn(C, H, generator=gen).to(dtype)
    w = torch.rand(C, generator=gen)
    slots = torch.randint(-1, C, (T, K), generator=gen)  # -1: the hit is on another rank
    return y.to(device), slots.to(device), w.to(device)


@pytest.mark.parametrize(("T", "K", "C", "H", "weighted", "dtype"), CASES)
def test_triton_reduce_slots_matches_torch(T, K, C, H, weighted, dtype, device) -> None:
    from moonep.kernels import reduce_slots_triton

    y, slots, w = _case(T, K, C, H, dtype, device)
    got = reduce_slots_triton(y, slots, w if weighted else None, dtype)
    want = reduce_slots(y.cpu(), slots.cpu(), w.cpu() if weighted else None, dtype)
    # fp32: the GPU contracts w*y+acc into one FMA, so allow an ulp.
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 1e-2)
