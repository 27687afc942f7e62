"""Device tests (``-m gpu``, two CUDA devices, NCCL): the exact dispatch/combine cases, async overlap, and
the bf16 MoE layer (grouped GEMM path) against the reference."""

from __future__ import annotations

import pytest
import torch

from k3infra.testing import run_ranks
from moonep import Buffer
from moonep.layer import MoELayer
from moonep.reference import reference_moe
from moonep.skew import make_routing
from tests.moonep.test_dispatch_combine import CASES, _run_cases

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]


def _needs_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


@pytest.mark.parametrize("preplanned", [False, True], ids=["planned-in-dispatch", "preplanned-remote-combine"])
def test_dispatch_and_combine_exact_on_two_gpus(preplanned: bool) -> None:
    # preplanned: Buffer.plan on the communication stream, dispatch(plan=...), combine_path="remote_only".
    _needs_two_gpus()
    path = "remote_only" if preplanned else "all_to_all"
    results = run_ranks(_run_cases, 2, "cuda", None, (), "auto", preplanned, path, backend="nccl", timeout_s=300)
    assert results[0] == [c[0] for c in CASES]


def _async_and_layer(rank: int, world: int) -> float:
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    S, H, K, E = 256, 2048, 8, 64
    idx, w = (t.to(device) for t in make_routing("lognormal2", S, K, E, world, rank=rank, seed=2))
    x = torch.randn(S, H, device=device).to(torch.bfloat16)
    buffer = Buffer(None, S, H, K, E, device=device)
    sync = buffer.dispatch(x, idx, w)
    pending = buffer.dispatch(x, idx, w, async_finish=True)
    with pending.event:
        side = (x.float() @ x.float().t()).sum()  # overlapped work on the compute stream
    assert torch.isfinite(side)
    assert torch.equal(pending.x_CH, sync.x_CH)
    out, event = buffer.combine(pending.x_CH, pending.handle, pending.weights_C, async_finish=True)
    event.current_stream_wait()
    ideal = x.float() * w.float().sum(1, keepdim=True)
    assert float((out.float() - ideal).norm() / ideal.norm()) < 1e-2
    # The NVLink (symmetric memory) transport moves the same bytes to the same places.
    nv = Buffer(None, S, H, K, E, device=device, transport="nvlink")
    nv_out = nv.dispatch(x, idx, w)
    assert torch.equal(nv_out.x_CH, sync.x_CH)
    nv_y, _ = nv.combine(nv_out.x_CH, nv_out.handle, nv_out.weights_C)
    assert torch.equal(nv_y, buffer.combine(sync.x_CH, sync.handle, sync.weights_C)[0])
    nv.destroy()
    buffer.destroy()
    # bf16 layer through torch._grouped_mm against the fp32 reference on the same (bf16-rounded) weights.
    buffer = Buffer(None, S, H, K, E, device=device, num_redundant_slots=E - E // world)
    layer = MoELayer(buffer, 128, num_shared=0)
    result = layer(x)
    ws = [torch.empty_like(layer.w1_PFH) for _ in range(world)]
    torch.distributed.all_gather(ws, layer.w1_PFH.detach())
    w1 = torch.cat(ws).float()
    torch.distributed.all_gather(ws2 := [torch.empty_like(layer.w2_PHF) for _ in range(world)], layer.w2_PHF.detach())
    w2 = torch.cat(ws2).float()
    i2, w2k = layer.router(x)
    ref = reference_moe(x.float(), i2, w2k.detach(), w1, w2)
    rel = float((result.out_sH.float() - ref).norm() / ref.norm())
    result.out_sH.float().sum().backward()
    assert layer.w1_PFH.grad is not None and torch.isfinite(layer.w1_PFH.grad).all()
    buffer.destroy()
    return rel


def test_async_dispatch_overlaps_and_bf16_layer_matches_reference() -> None:
    _needs_two_gpus()
    rels = run_ranks(_async_and_layer, 2, backend="nccl", timeout_s=300)
    assert max(rels) < 2e-2, rels
