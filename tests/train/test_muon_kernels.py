"""The fused Muon element-wise kernels (`train.muon_kernels`, Triton's interpreter on the CPU) against the torch ops
they replace, and `ShardedMuon` with them against itself without them: plain, per-head, stacked-expert, tall and
wide matrices, and FSDP2-sharded (DTensor) parameters over two gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3infra.model import fused
from k3infra.testing import run_ranks
from k3infra.train.muon_kernels import decay_and_subtract, momentum_update
from k3infra.train.optim import ShardedMuon


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("momentum", [0.95, 0.3])
def test_momentum_update_matches_torch_lerp(nesterov, momentum):
    torch.manual_seed(0)
    grad, buf = torch.randn(3, 1000), torch.randn(3, 1000)
    ref_buf = buf.clone().lerp_(grad, 1 - momentum)
    ref = (grad.lerp(ref_buf, momentum) if nesterov else ref_buf).bfloat16()
    out = momentum_update(grad, buf, momentum, nesterov)
    torch.testing.assert_close(buf, ref_buf, rtol=1e-6, atol=1e-6)
    assert out.dtype == torch.bfloat16
    # rounded to nearest like torch's cast; torch's CPU lerp uses a fused multiply-add, so a rare bf16 differs
    assert (out != ref).float().mean() < 1e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=0)
    fp32_out = momentum_update(grad, buf.clone(), momentum, nesterov, out=torch.empty_like(grad))
    assert fp32_out.dtype == torch.float32


@pytest.mark.parametrize("shape", [(40, 24), (3, 24, 40)])
def test_decay_and_subtract_takes_transposed_updates(shape):
    torch.manual_seed(1)
    param = torch.randn(shape)
    ortho = torch.randn(*shape[:-2], shape[-1], shape[-2]).bfloat16().mT  # a tall matrix's update, transposed
    ref = param.clone().mul_(0.99).add_(ortho, alpha=-0.3)
    decay_and_subtract(param, ortho, 0.99, 0.3)
    torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-6)


def test_fused_kernels_reject_mismatched_tensors():
    with pytest.raises(ValueError, match="`buf` must be a contiguous"):
        momentum_update(torch.zeros(4, 4), torch.zeros(4, 5), 0.9, True)
    with pytest.raises(ValueError, match="`momentum` must be in"):
        momentum_update(torch.zeros(4, 4), torch.zeros(4, 4), 1.0, True)
    with pytest.raises(ValueError, match="`param` and `ortho`"):
        decay_and_subtract(torch.zeros(4, 4), torch.zeros(4, 5), 0.9, 0.1)


def _steps(monkeypatch, mode: str, weights, grads, head_rows, steps: int = 3):
    monkeypatch.setattr(fused, "MODE", mode)
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = ShardedMuon([{"params": params, "head_rows": head_rows}], lr=0.05, weight_decay=0.1,
                      adjust_lr_fn="match_rms_adamw")
    for step in range(steps):
        for p, g in zip(params, grads):
            p.grad = g * (step + 1)
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params]


@pytest.mark.parametrize("head_rows", [None, (4,), (4, 2)])
def test_sharded_muon_with_fused_kernels_steps_as_without(monkeypatch, head_rows):
    torch.manual_seed(2)
    shapes = [(12, 10), (24, 6)] if head_rows else [(12, 10), (3, 16, 10), (3, 10, 16), (30, 8)]
    weights = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    eager, eager_bufs = _steps(monkeypatch, "off", weights, grads, head_rows)
    ours, ours_bufs = _steps(monkeypatch, "on", weights, grads, head_rows)
    for a, b, w in zip(ours, eager, weights):
        assert not torch.equal(a, w)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)  # lerp's fused multiply-add may flip a bf16 rounding
    for a, b in zip(ours_bufs, eager_bufs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _sharded_steps(rank: int, world: int) -> dict[str, list]:
    from torch.distributed.fsdp import fully_shard

    result = {}
    for mode in ("off", "on"):
        fused.MODE = mode
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(10, 13, bias=False), nn.Linear(13, 7, bias=False))
        fully_shard(model)  # 13 rows over 2 ranks: uneven shards
        opt = ShardedMuon(list(model.parameters()), lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        for step in range(3):
            x = torch.randn(5, 10, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        result[mode] = [p.full_tensor().tolist() for p in model.parameters()]  # plain lists cross the queue
    return result


@pytest.mark.multiproc
def test_sharded_parameters_step_as_without_fused_kernels():
    for result in run_ranks(_sharded_steps, 2, timeout_s=240):
        for fused_param, eager_param in zip(result["on"], result["off"]):
            torch.testing.assert_close(torch.tensor(fused_param), torch.tensor(eager_param), rtol=0, atol=2e-3)


@pytest.mark.gpu
def test_fused_muon_step_on_gpu_matches_torch_ops(monkeypatch):
    torch.manual_seed(6)
    shapes = [(256, 512), (8, 128, 512), (8, 512, 128)]
    weights = [torch.randn(s, device="cuda") for s in shapes]
    grads = [torch.randn(s, device="cuda") for s in shapes]
    eager, eager_bufs = _steps(monkeypatch, "off", weights, grads, None)
    ours, ours_bufs = _steps(monkeypatch, "on", weights, grads, None)
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    for a, b in zip(ours_bufs, eager_bufs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
