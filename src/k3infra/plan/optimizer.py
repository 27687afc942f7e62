"""The optimizer update's share of a training step: Muon's Newton–Schulz GEMMs and the element-wise passes.

Muon (``K3_MODEL.md`` §4, `k3infra.train.optim`) orthogonalises every matrix slice on its own: each head's query,
key and value block, each expert's three matrices, every other weight matrix whole; five quintic Newton–Schulz
iterations of ``4a²b + 2a³`` FLOPs for an ``a x b`` slice (``a ≤ b``), the count `ShardedMuon.newton_schulz_flops`
gives for a K3 model. The time is charged for the FLOPs the trainer executes: Muon batches the slices of one shape,
and a batch that `takes_symmetric_products` computes its Gram ``X·Xᵀ`` and square ``A·A`` only on the tiles on and
below the diagonal (`k3infra.train.newton_schulz`): ``t(t + 1)/2`` of ``t²`` tiles, ``t = ⌈a / 128⌉``. The trainer
runs each slice once over the data-parallel group (`ShardedMuon`), so with sharded optimizer states (ZeRO ≥ 1) a
GPU takes ``1/world`` of them, assuming an even spread; with replicated states every rank orthogonalises the dense
matrices it holds, and the experts' replicas split theirs.

The element-wise passes move `ELEMENTWISE_BYTES` per weight a GPU updates: Muon's momentum, Nesterov update,
weight decay and subtraction with the fused kernels; AdamW's fp32 weight, gradient and two moments.
"""

from __future__ import annotations

import functools
import math

from k3infra.plan.cluster import ClusterSpec
from k3infra.plan.model import ModelSpec
from k3infra.plan.workload import Layout, TrainWorkload

__all__ = ["ELEMENTWISE_BYTES", "NEWTON_SCHULZ_STEPS", "SYMMETRIC_MIN_SIDE", "SYMMETRIC_MIN_WORK", "muon_batches",
           "muon_slices", "newton_schulz_flops", "takes_symmetric_products", "update_seconds"]

NEWTON_SCHULZ_STEPS = 5
SYMMETRIC_MIN_SIDE = 1024
"""Smallest side of a Newton–Schulz slice whose symmetric products skip the tiles above the diagonal
(`k3infra.train.newton_schulz`): below it the saving is a few tiles and cuBLAS's products were faster."""
SYMMETRIC_MIN_WORK = 2 ** 35
"""Smallest ``slices · a² · b`` (``a ≤ b``) of a Newton–Schulz batch that takes the symmetric products: smaller
batches are bound by kernel launches, where cuBLAS's were faster."""
_SYMMETRIC_TILE = 128
ELEMENTWISE_BYTES = {"muon": 34.0, "adamw": 28.0}
"""Bytes moved per weight and step outside Newton–Schulz, by count (`benchmarks.train.muon`; AdamW: read and write
the fp32 weight and both moments, read the fp32 gradient)."""


def _attention_slices(model: ModelSpec, kind: str) -> list[tuple[int, int, int]]:
    d = model.hidden
    if kind == "kda":
        k = model.kda
        D = k.heads * k.head_dim
        gate = [(1, k.gate_rank, d), (1, D, k.gate_rank)] if k.gate_rank else []
        return [(3 * k.heads, k.head_dim, d), (3, D, k.conv), *gate, (1, k.heads, d), (1, D, d), (1, d, D)]
    if kind == "mla":
        a = model.mla
        q = [(1, a.q_rank, d), (a.heads, a.nope + a.rope, a.q_rank)] if a.q_rank else [(a.heads, a.nope + a.rope, d)]
        gate = [(1, a.heads * a.v_dim, d)] if a.gated else []
        return [*q, (1, a.kv_rank + a.rope, d), (a.heads, a.nope, a.kv_rank), (a.heads, a.v_dim, a.kv_rank), *gate,
                (1, d, a.heads * a.v_dim)]
    g = model.gqa
    return [(1, g.heads * g.head_dim, d), (2, g.kv_heads * g.head_dim, d), (1, d, g.heads * g.head_dim)]


def _ffn_slices(model: ModelSpec, kind: str) -> list[tuple[int, int, int]]:
    d = model.hidden
    if kind == "dense":
        return [(2, model.dense_width, d), (1, d, model.dense_width)]
    e = model.moe
    slices = [(2 * e.experts, e.width, e.latent), (e.experts, e.latent, e.width)]
    if e.has_latent:
        slices += [(1, e.latent, d), (1, d, e.latent)]
    if e.shared_width:
        slices += [(2, e.shared_width, d), (1, d, e.shared_width)]
    return slices


def muon_slices(model: ModelSpec) -> list[tuple[int, int, int, bool]]:
    """``(count, rows, cols, routed)`` for every matrix slice a Muon step orthogonalises (embeddings, output head,
    router, norms and vectors go to AdamW); ``routed`` marks the routed experts' slices."""
    slices = []
    for attention, ffn in model.layers:
        slices += [(*s, False) for s in _attention_slices(model, attention)]
        ffn_slices = _ffn_slices(model, ffn)
        slices += [(*s, ffn == "moe" and i < 2) for i, s in enumerate(ffn_slices)]
    return slices


def muon_batches(model: ModelSpec) -> dict[tuple[int, int], int]:
    """``{(rows, cols): slices}``: the batches a Muon step orthogonalises, every slice of one shape together, as the
    trainer's Muon batches them."""
    return _batches(muon_slices(model))


def _batches(slices: list[tuple[int, int, int, bool]]) -> dict[tuple[int, int], int]:
    batch: dict[tuple[int, int], int] = {}
    for count, rows, cols, _ in slices:
        batch[rows, cols] = batch.get((rows, cols), 0) + count
    return batch


def takes_symmetric_products(slices: int, rows: int, cols: int) -> bool:
    """Whether a Newton–Schulz batch of ``slices`` ``rows x cols`` slices takes the symmetric products
    (`SYMMETRIC_MIN_SIDE`, `SYMMETRIC_MIN_WORK`); the trainer's Muon applies the same rule where its fused kernels
    run."""
    a, b = sorted((rows, cols))
    return a >= SYMMETRIC_MIN_SIDE and slices * a * a * b >= SYMMETRIC_MIN_WORK


def _flops(count: int, rows: int, cols: int, symmetric: bool = False) -> float:
    a, b = sorted((rows, cols))
    t = math.ceil(a / _SYMMETRIC_TILE)
    lower = t * (t + 1) / (2 * t * t) if symmetric else 1.0
    return count * NEWTON_SCHULZ_STEPS * (2.0 * a * a * b * (1 + lower) + 2.0 * a ** 3 * lower)


def newton_schulz_flops(model: ModelSpec, *, executed: bool = False) -> tuple[float, float]:
    """``(dense, routed)`` Newton–Schulz FLOPs of one Muon step over the whole model: the plain products
    (`ShardedMuon.newton_schulz_flops`), or with ``executed`` those the symmetric products leave."""
    totals = _muon_totals(model)
    return totals[2:4] if executed else totals[:2]


@functools.lru_cache(maxsize=64)
def _muon_totals(model: ModelSpec) -> tuple[float, float, float, float, int]:
    """``(dense, routed FLOPs, dense, routed FLOPs executed, Muon weights)``, once per model: the search asks for
    every layout."""
    slices = muon_slices(model)
    batch = _batches(slices)
    plain = {False: 0.0, True: 0.0}
    executed = {False: 0.0, True: 0.0}
    weights = 0
    for count, rows, cols, is_routed in slices:
        plain[is_routed] += _flops(count, rows, cols)
        symmetric = takes_symmetric_products(batch[rows, cols], rows, cols)
        executed[is_routed] += _flops(count, rows, cols, symmetric)
        weights += count * rows * cols
    return plain[False], plain[True], executed[False], executed[True], weights


def update_seconds(model: ModelSpec, layout: Layout, work: TrainWorkload, cluster: ClusterSpec, *,
                   efficiency: float) -> float:
    """Seconds of one optimizer update on one GPU: Newton–Schulz at ``efficiency`` of the bf16 peak (Muon only)
    plus the element-wise passes at the HBM bandwidth, over the weights that GPU updates."""
    gpu = cluster.gpu
    total, routed, _ = model.count()
    sharded = layout.zero >= 1
    dense_share = layout.world if sharded else layout.tp * layout.pp
    routed_share = layout.world if sharded else layout.ep * layout.pp
    muon = work.optimizer == "muon"
    seconds = dense_muon = 0.0
    if muon:
        _, _, dense_ns, routed_ns, muon_weights = _muon_totals(model)
        seconds = (dense_ns / dense_share + routed_ns / layout.world) / (efficiency * gpu.bf16_flops)
        dense_muon = muon_weights - routed
    moved = (ELEMENTWISE_BYTES["muon"] * dense_muon / dense_share
             + ELEMENTWISE_BYTES["adamw"] * (total - routed - dense_muon) / dense_share
             + ELEMENTWISE_BYTES["muon" if muon else "adamw"] * routed / routed_share)
    return seconds + moved / gpu.hbm_bw
