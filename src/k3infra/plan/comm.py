"""Communication bytes per GPU per step, per collective and link class (``nvlink`` inside an NVLink domain,
``network`` between domains).

Placement: ranks are numbered TP fastest, then CP, DP, PP; the EP group is ``ep`` consecutive ranks of one
stage. A ring collective (all-reduce, reduce-scatter, all-gather) over a group that leaves the NVLink domain is
charged entirely to the network (each GPU has its own NIC); an all-to-all splits its bytes by the share of peers
inside the domain. Bytes are what one GPU sends; ring collectives move ``(n−1)/n`` of the buffer per
reduce-scatter or all-gather.
"""

from __future__ import annotations

from k3infra.plan.cluster import ClusterSpec
from k3infra.plan.memory import GRAD_BYTES, WEIGHT_TRAIN_BYTES, _params, stages
from k3infra.plan.model import ModelSpec
from k3infra.plan.workload import Layout, ServeWorkload, TrainWorkload

__all__ = ["train_comm", "serve_comm", "peers_in_domain"]


def peers_in_domain(size: int, stride: int, per_node: int) -> int:
    """Members of a group (``size`` ranks, ``stride`` apart) that share one NVLink domain with a given member."""
    if stride >= per_node:
        return 1
    return max(1, min(size, per_node // stride))


def _ring(bytes_: float, size: int, stride: int, per_node: int) -> tuple[str, float]:
    link = "nvlink" if peers_in_domain(size, stride, per_node) >= size else "network"
    return link, bytes_ * (size - 1) / size


def _all_to_all(bytes_: float, size: int, per_node: int) -> dict[str, float]:
    """Bytes leaving one GPU in an all-to-all over ``size`` consecutive ranks, split by link class."""
    if size == 1:
        return {}
    inside = peers_in_domain(size, 1, per_node)
    return {"nvlink": bytes_ * (inside - 1) / size, "network": bytes_ * (size - inside) / size}


def _add(out: dict[str, dict[str, float]], name: str, link: str, value: float) -> None:
    if value > 0:
        out.setdefault(name, {"nvlink": 0.0, "network": 0.0})[link] += value


def train_comm(model: ModelSpec, layout: Layout, work: TrainWorkload, cluster: ClusterSpec, micro_batches: int
               ) -> dict[str, dict[str, float]]:  # fmt: skip
    """``{collective: {"nvlink": bytes, "network": bytes}}`` per GPU per step, for the busiest pipeline rank."""
    L, g, d = layout, cluster.per_node, model.hidden
    m = micro_batches
    tokens = work.micro_batch * work.seq_len / (L.cp * L.tp)
    slices = stages(len(model.layers), L.pp, L.vp)
    sl = max(slices, key=lambda s: len(s.layers))
    n_layers = len(sl.layers)
    out: dict[str, dict[str, float]] = {}
    if L.tp > 1:  # sequence parallel: all-gather + reduce-scatter around attention and FFN, forward and backward
        ops = 4 + (2 if L.recompute == "full" else 0)
        link, b = _ring(tokens * L.tp * d * 2.0, L.tp, 1, g)
        _add(out, "tp_allgather_reducescatter", link, n_layers * m * ops * b)
    moe_layers = sum(1 for i in sl.layers if model.layers[i][1] == "moe")
    if moe_layers and L.ep > 1:
        e = model.moe
        dispatch = 1.0 if work.precision == "fp8" else 2.0
        sends = 2 * dispatch + 2 * 2.0 + (dispatch if L.recompute != "none" else 0.0)  # fwd d+c, bwd c+d, re-send
        for link, b in _all_to_all(tokens * e.top_k * e.latent * sends, L.ep, g).items():
            _add(out, "ep_all_to_all", link, moe_layers * m * b)
    ne, ex, _ = _params(model, sl)
    ne, ex = ne / L.tp, ex / L.ep
    for name, params, size, stride in (("dp_dense", ne, L.dp * L.cp, L.tp), ("dp_expert", ex, L.edp, L.ep)):
        if size == 1 or params == 0:
            continue
        grads = params * (WEIGHT_TRAIN_BYTES if L.zero >= 1 else GRAD_BYTES)  # RS of bf16 grads, or AR
        link, rs = _ring(grads, size, stride, g)
        ag = _ring(params * WEIGHT_TRAIN_BYTES, size, stride, g)[1] if L.zero >= 1 else rs
        per_mb = 2 * m * ag if L.zero >= 3 else 0.0  # FSDP re-gathers weights in forward and backward
        _add(out, name + "_reduce_gather", link, rs + ag + per_mb)
    if L.pp > 1:
        boundary = tokens * d * 2.0 + (d * 2.0 * tokens if model.attn_res_blocks else 0.0)  # + new block sum
        link = "nvlink" if L.tp * L.cp * L.dp * L.pp <= g else "network"
        _add(out, "pp_p2p", link, 2 * L.vp * m * boundary)
    if L.cp > 1:
        link, _ = _ring(1.0, L.cp, L.tp, g)
        kinds = [model.layers[i][0] for i in sl.layers]
        cp_bytes = 0.0
        if model.kda:  # transition M and zero-start state S̃ per head, fp32, all-gathered; backward twice
            k = model.kda
            cp_bytes += kinds.count("kda") * 3 * 2 * (k.heads / L.tp) * k.head_dim**2 * 4.0 * (L.cp - 1)
        if model.mla:  # latent KV all-gathered in forward, its gradient reduce-scattered in backward
            cp_bytes += kinds.count("mla") * 2 * tokens * L.tp * (model.mla.kv_rank + model.mla.rope) * 2 * (L.cp - 1)
        if model.gqa:
            kv = 2 * model.gqa.kv_heads * model.gqa.head_dim / min(L.tp, model.gqa.kv_heads)
            cp_bytes += kinds.count("gqa") * 2 * tokens * L.tp * kv * 2 * (L.cp - 1)
        _add(out, "cp_allgather", link, m * cp_bytes)
    return out


def serve_comm(model: ModelSpec, layout: Layout, work: ServeWorkload, cluster: ClusterSpec
               ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Bytes per GPU for one decode step of the rank's sequences (one token each)."""
    L, g, d = layout, cluster.per_node, model.hidden
    tokens = -(-work.concurrency // L.dp)
    sl = max(stages(len(model.layers), L.pp, 1), key=lambda s: len(s.layers))
    out: dict[str, dict[str, float]] = {}
    if L.tp > 1:
        link, b = _ring(tokens * d * 2.0, L.tp, 1, g)
        _add(out, "tp_allreduce", link, len(sl.layers) * 2 * 2 * b)
    moe_layers = sum(1 for i in sl.layers if model.layers[i][1] == "moe")
    if moe_layers and L.ep > 1:
        e = model.moe
        for link, b in _all_to_all(tokens / L.tp * e.top_k * e.latent * 2.0 * 2, L.ep, g).items():
            _add(out, "ep_all_to_all", link, moe_layers * b)
    if L.pp > 1:
        link = "nvlink" if L.world <= g else "network"
        _add(out, "pp_p2p", link, tokens * d * 2.0)
    return out
