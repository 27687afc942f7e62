"""The MoE layer trains: outputs and every gradient match a single-process reference MoE (gloo, 2 and 4 ranks).

Also checks `prefetch_weight`/`reduce_grad` directly with payloads that encode (rank, expert): redundant
copies hold their home's weights exactly, and their gradients arrive home exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3infra.testing import run_ranks
from moonep import Buffer
from moonep.layer import MoELayer
from moonep.reference import reference_moe
from moonep.skew import make_routing

pytestmark = pytest.mark.multiproc

S, H, FI, K, P, SHARED = 10, 8, 6, 3, 3, 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _global_params(world: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    E = P * world
    return {
        "router": torch.randn(E, H, generator=gen) * H**-0.5,
        "w1": torch.randn(E, FI, H, generator=gen) * H**-0.5,
        "w2": torch.randn(E, H, FI, generator=gen) * FI**-0.5,
        "sw1": torch.randn(SHARED * FI, H, generator=gen) * H**-0.5,
        "sw2": torch.randn(H, SHARED * FI, generator=gen) * FI**-0.5,
        # Rank 0's experts get a selection bonus, so the balanced plan must place redundant copies.
        "bias": torch.cat([torch.full((P,), 0.3), torch.zeros(E - P)]),
    }


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(S, H, generator=gen), torch.randn(S, H, generator=gen)


def _reference(world: int, params: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    p = {k: v.clone().requires_grad_(k != "bias") for k, v in params.items()}
    xs = [_tokens(r)[0].requires_grad_() for r in range(world)]
    outs, loss = [], 0.0
    for r, x in enumerate(xs):
        scores = torch.sigmoid(x @ p["router"].t())
        idx = (scores.detach() + p["bias"]).topk(K, dim=1).indices
        w = scores.gather(1, idx)
        w = w / w.sum(1, keepdim=True)
        out = F.silu(x @ p["sw1"].t()) @ p["sw2"].t() + reference_moe(x, idx, w, p["w1"], p["w2"])
        outs.append(out.detach())
        loss = loss + (out * _tokens(r)[1]).sum()
    loss.backward()
    grads = {k: v.grad for k, v in p.items() if k != "bias"}
    grads.update({f"x{r}": x.grad for r, x in enumerate(xs)})
    return outs, grads


def _check_layer(rank: int, world: int, balanced: bool, combine_path: str = "all_to_all") -> int:
    params = _global_params(world)
    buffer = Buffer(
        None, S, H, K, P * world, dtype=torch.float32, balanced=balanced, num_redundant_slots=P * world - P,
        combine_path=combine_path,
    )  # fmt: skip
    layer = MoELayer(buffer, FI, num_shared=SHARED)
    home = slice(rank * P, (rank + 1) * P)
    with torch.no_grad():
        layer.router.weight_EH.copy_(params["router"])
        layer.router.bias_E.copy_(params["bias"])
        layer.w1_PFH.copy_(params["w1"][home])
        layer.w2_PHF.copy_(params["w2"][home])
        layer.shared_w1_FH.copy_(params["sw1"])
        layer.shared_w2_HF.copy_(params["sw2"])
    x, g = _tokens(rank)
    x.requires_grad_()
    # The remote-only buffer also takes the plan-ahead path: routing and plan made before forward.
    result = layer(x, planned=layer.plan_ahead(x)) if combine_path == "remote_only" else layer(x)
    (result.out_sH * g).sum().backward()
    ref_outs, ref_grads = _reference(world, params)
    assert _rel(result.out_sH.detach(), ref_outs[rank]) < 1e-5, "forward differs from the reference MoE"
    assert _rel(x.grad, ref_grads[f"x{rank}"]) < 1e-5, "grad x"
    assert _rel(layer.w1_PFH.grad, ref_grads["w1"][home]) < 1e-5, "grad w1 (home experts)"
    assert _rel(layer.w2_PHF.grad, ref_grads["w2"][home]) < 1e-5, "grad w2 (home experts)"
    for name, param in (("router", layer.router.weight_EH), ("sw1", layer.shared_w1_FH), ("sw2", layer.shared_w2_HF)):
        summed = param.grad.clone()
        dist.all_reduce(summed)
        assert _rel(summed, ref_grads[name]) < 1e-5, f"grad {name} (summed over ranks)"
    redundant = int(result.redundant_per_rank.sum())
    assert (redundant > 0) == balanced, f"redundant experts: {redundant}"
    buffer.destroy()
    return redundant


def _check_prefetch_reduce(rank: int, world: int) -> None:
    E = P * world
    idx, w = make_routing("hot_rank", S, K, E, world, rank=rank, seed=1)
    probe = Buffer(None, S, 1, K, E, dtype=torch.float32, num_redundant_slots=E - P)
    plan = probe.dispatch(torch.zeros(S, 1), idx, w).handle.plan
    probe.destroy()
    # A table narrower than E - P (exactly what the plan needs) exercises the sliced redundant table.
    N = int(plan.num_redundant_R.max())
    assert 0 < N < E - P
    buffer = Buffer(None, S, 1, K, E, dtype=torch.float32, num_redundant_slots=N)
    weight = torch.tensor([[1000.0 * rank + l, -1.0] for l in range(P)])  # [P, 2]: encodes its home
    fetched = buffer.prefetch_weight(plan, weight)
    ids = plan.redundant_ids_RN[rank, :N].tolist()
    for n, e in enumerate(ids):
        want = [1000.0 * (e // P) + e % P, -1.0] if e >= 0 else [0.0, 0.0]
        assert fetched[P + n].tolist() == want, f"redundant slot {n} (expert {e}) holds {fetched[P + n].tolist()}"
    into = torch.full((N, 2), float("nan"))
    assert torch.equal(buffer.prefetch_weight(plan, weight, out=into), fetched[P:])  # the copy-free form
    grad = torch.cat([torch.ones(P, 2), torch.tensor([[2.0**rank, float(n)] for n in range(N)])])
    home_grad = buffer.reduce_grad(plan, grad)
    in_place = grad.clone()
    assert torch.equal(buffer.reduce_grad(plan, in_place, inplace=True), home_grad)
    assert torch.equal(in_place[:P], home_grad)
    for l in range(P):
        e = rank * P + l
        holders = [(r, n) for r in range(world) for n, i in enumerate(plan.redundant_ids_RN[r].tolist()) if i == e]
        want = [1.0 + sum(2.0**r for r, _ in holders), 1.0 + sum(float(n) for _, n in holders)]
        assert home_grad[l].tolist() == want, f"expert {e}: {home_grad[l].tolist()} != {want}"
    assert int(plan.num_redundant_R.sum()) > 0
    buffer.destroy()


def _check_preplanned_grads(rank: int, world: int) -> None:
    """dispatch(plan=Buffer.plan(...)) + a remote-only combine: the same outputs and gradients, bit for bit,
    as a plain dispatch + all-to-all combine (both backward passes go through the other path's code)."""
    E = P * world
    idx, w0 = make_routing("hot_rank", S, K, E, world, rank=rank, seed=4)
    x0, g = _tokens(rank)
    scale_E = torch.arange(1.0, E + 1)  # "expert" e multiplies by e + 1
    results = []
    for preplanned, path in ((False, "all_to_all"), (True, "remote_only")):
        buffer = Buffer(None, S, H, K, E, dtype=torch.float32, combine_path=path)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        planned = buffer.plan(idx, w) if preplanned else None
        out = buffer.dispatch(x, idx, w, plan=planned)
        ids = torch.cat([torch.arange(P) + rank * P, out.handle.plan.redundant_ids_RN[rank]])
        slot_scale = scale_E[ids.clamp(min=0)].repeat_interleave(out.counts_L)
        y = out.x_CH * torch.cat([slot_scale, torch.zeros(buffer.capacity - slot_scale.numel())])[:, None]
        combined, _ = buffer.combine(y, out.handle)
        (combined * g).sum().backward()
        results.append((combined.detach(), x.grad, w.grad))
        buffer.destroy()
    for name, a, b in zip(("out", "grad x", "grad topk_weights"), *results):
        assert torch.equal(a, b), f"{name}: preplanned + remote-only differs by {(a - b).abs().max()}"
    want_w = ((x0 * g).sum(1, keepdim=True) * (idx + 1).float()) * (idx >= 0)
    torch.testing.assert_close(results[1][2], want_w)  # d out / d w[t, k] = x[t] * (e + 1)


def _all_checks(rank: int, world: int) -> list[int]:
    _check_prefetch_reduce(rank, world)
    _check_preplanned_grads(rank, world)
    layers = [_check_layer(rank, world, balanced) for balanced in (True, False)]
    return layers + [_check_layer(rank, world, True, "remote_only")]  # also planned ahead


@pytest.mark.parametrize("world", [2, 4], ids=["R2", "R4"])
def test_moe_layer_matches_reference_and_redundant_grads_reach_home(world: int) -> None:
    results = run_ranks(_all_checks, world, timeout_s=240)
    assert sum(r[0] for r in results) > 0
