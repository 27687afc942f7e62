"""Newton–Schulz with symmetric products (`train.newton_schulz`, Triton's interpreter on the CPU) against fp64:
the product kernel, the whole orthogonalisation next to the cuBLAS-product path, and Muon's dispatch to it."""

from __future__ import annotations

import pytest
import torch

from benchmarks.train.newton_schulz import fp64_newton_schulz
from k3infra.model import fused
from k3infra.train import optim
from k3infra.train.newton_schulz import newton_schulz, symmetric_product

COEFFICIENTS = (3.4445, -4.775, 2.0315)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("batch,m,k,transposed", [(2, 40, 70, False), (1, 130, 64, False), (2, 150, 48, True),
                                                  (1, 16, 8, False)])
def test_symmetric_product_matches_fp64(batch, m, k, transposed):
    torch.manual_seed(batch * 1000 + m)
    x = torch.randn(batch, k, m).bfloat16().mT if transposed else torch.randn(batch, m, k).bfloat16()
    gram = symmetric_product(x)
    ref = x.double() @ x.double().mT
    assert gram.shape == (batch, m, m) and gram.dtype == torch.bfloat16 and gram.is_contiguous()
    assert torch.equal(gram, gram.mT)
    assert _rel(gram, ref) < 4e-3  # one bf16 rounding of fp32 sums

    step = symmetric_product(gram, COEFFICIENTS[2], gram, COEFFICIENTS[1])
    g = gram.double()
    ref_step = COEFFICIENTS[1] * g + COEFFICIENTS[2] * g @ g
    assert torch.equal(step, step.mT)
    assert _rel(step, ref_step) < 4e-3


def test_symmetric_product_edge_shapes_and_errors():
    x = torch.randn(2, 20, 0).bfloat16()
    assert torch.equal(symmetric_product(x), torch.zeros(2, 20, 20, dtype=torch.bfloat16))
    add = torch.eye(20).expand(2, 20, 20).bfloat16().contiguous()
    assert torch.equal(symmetric_product(x, 1.0, add, 2.0), 2 * add)
    assert symmetric_product(torch.randn(0, 5, 7)).shape == (0, 5, 5)
    with pytest.raises(ValueError, match=r"`x` must be a \[B, m, k\]"):
        symmetric_product(torch.randn(5, 7))
    with pytest.raises(ValueError, match="`add` must be a contiguous"):
        symmetric_product(torch.randn(1, 5, 7), add=torch.randn(1, 5, 6))


@pytest.mark.parametrize("shape", [(3, 200, 96), (2, 48, 160)])
def test_symmetric_newton_schulz_as_accurate_as_cublas_path(shape, monkeypatch):
    torch.manual_seed(0)
    g = torch.randn(*shape)
    ref = fp64_newton_schulz(g, COEFFICIENTS, 5, 1e-7)
    monkeypatch.setattr(fused, "MODE", "off")
    plain = optim.zeropower_batched(g, COEFFICIENTS, 5, 1e-7)
    ours = newton_schulz(g, COEFFICIENTS, 5, 1e-7, symmetric=True)
    assert ours.shape == g.shape and ours.dtype == torch.bfloat16
    assert _rel(ours, ref) < 1.25 * _rel(plain, ref) + 1e-3


def test_muon_dispatches_large_slices_to_symmetric_products(monkeypatch):
    calls = []
    def spy(g, *args, symmetric):
        if symmetric:
            calls.append(tuple(g.shape))
        return newton_schulz(g, *args, symmetric=symmetric)

    monkeypatch.setattr(optim, "newton_schulz", spy)
    monkeypatch.setattr(optim.update_plan, "SYMMETRIC_MIN_SIDE", 32)
    monkeypatch.setattr(optim.update_plan, "SYMMETRIC_MIN_WORK", 2 * 40 * 40 * 48)
    g = torch.randn(2, 48, 40)
    monkeypatch.setattr(fused, "MODE", "off")
    optim.zeropower_batched(g, COEFFICIENTS, 5, 1e-7)
    assert calls == []
    monkeypatch.setattr(fused, "MODE", "on")
    optim.zeropower_batched(torch.randn(4, 16, 40), COEFFICIENTS, 5, 1e-7)  # smaller side below the threshold
    optim.zeropower_batched(g[:1], COEFFICIENTS, 5, 1e-7)  # too little work
    assert calls == []
    optim.zeropower_batched(g, COEFFICIENTS, 5, 1e-7)
    assert calls == [(2, 48, 40)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 640, 700), (2, 1024, 768)])
def test_symmetric_products_on_cuda(shape, monkeypatch):
    torch.manual_seed(0)
    g = torch.randn(*shape, device="cuda")
    x = g.bfloat16().mT if shape[1] > shape[2] else g.bfloat16()
    gram = symmetric_product(x)
    assert torch.equal(gram, gram.mT)
    assert _rel(gram, x.double() @ x.double().mT) < 4e-3
    ref = fp64_newton_schulz(g, COEFFICIENTS, 5, 1e-7)
    monkeypatch.setattr(fused, "MODE", "off")
    plain = optim.zeropower_batched(g, COEFFICIENTS, 5, 1e-7)
    ours = newton_schulz(g, COEFFICIENTS, 5, 1e-7, symmetric=True)
    assert _rel(ours, ref) < 1.25 * _rel(plain, ref) + 1e-3


def test_bench_times_the_steps_slices_and_sums_what_muon_takes():
    from benchmarks.train.newton_schulz import measure, slice_groups
    from k3infra.model import K3Config, K3ForCausalLM

    groups = slice_groups("k3-debug", {})
    with torch.device("meta"):
        muon = optim.build_optimizers(K3ForCausalLM(K3Config.from_preset("k3-debug")), lr=1e-3)[0]
    assert sum(optim._newton_schulz_flops(torch.Size([count, n, m]), None, 5)
               for (n, m), count in groups.items()) == muon.newton_schulz_flops()

    rows = measure({(24, 64): 2, (40, 16): 1}, "cpu", rep=1, label="test")
    total = rows[-1]
    assert [row.case for row in rows] == ["ns-2x24x64", "ns-1x40x16", "ns-step-test"]
    assert total.baseline_ms == pytest.approx(sum(row.baseline_ms for row in rows[:-1]))
    assert total.extra["muon_ms"] == pytest.approx(total.baseline_ms)  # slices this small stay on cuBLAS's path
    for row in rows[:-1]:
        assert row.extra["muon_takes"] == "off"
        assert row.extra["ours_err_vs_fp64"] < 1.25 * row.extra["baseline_err_vs_fp64"] + 1e-3


def test_symmetric_product_splits_batches_past_the_grid_limit(monkeypatch):
    from k3infra.train import newton_schulz as kernels

    monkeypatch.setattr(kernels, "_MAX_GRID_Y", 2)
    x = torch.randn(5, 20, 24).bfloat16()
    gram = symmetric_product(x)
    step = symmetric_product(gram, 2.0, gram, -1.0)
    assert _rel(gram, x.double() @ x.double().mT) < 4e-3
    g = gram.double()
    assert _rel(step, 2 * g @ g - g) < 4e-3


@pytest.mark.gpu
def test_muon_step_with_symmetric_products_matches_cublas_path(monkeypatch):
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(1536, 1024, bias=False, device="cuda")
    grad = torch.randn_like(model.weight)
    after = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(fused, "MODE", mode)
        copy = nn.Linear(1536, 1024, bias=False, device="cuda")
        copy.weight.data.copy_(model.weight)
        copy.weight.grad = grad.clone()
        muon = optim.ShardedMuon([copy.weight], lr=1e-2)
        monkeypatch.setattr(optim.update_plan, "SYMMETRIC_MIN_WORK", 1)
        muon.step()
        after[mode] = copy.weight.detach().clone()
    step_off, step_on = after["off"] - model.weight, after["on"] - model.weight
    assert _rel(step_on, step_off.double()) < 3e-2  # two bf16 Newton-Schulz runs, summation orders apart
