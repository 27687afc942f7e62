"""Step-time estimates from FLOPs, bandwidths and an explicit overlap rule.

Training step = GEMM time at ``efficiency`` × peak (FP8 peak for the ``6·N`` GEMMs when training in FP8) +
pipeline bubble ``(pp−1)/(vp·m)`` of it + communication that is not hidden + the optimizer update
(`optimizer.update_seconds`: Muon's Newton–Schulz at the same efficiency, element-wise passes at HBM
bandwidth). ``overlap``: ``none`` hides nothing; ``dp`` hides data-parallel reduce/gather behind compute
(bucketed during backward); ``all`` also hides EP, PP and CP traffic (DualPipe-style), up to the compute time.
TP traffic is never hidden.
Decode step = max(HBM bytes / bandwidth, FLOPs / peak) per pipeline stage + its communication.
"""

from __future__ import annotations

from k3infra.plan.cluster import ClusterSpec
from k3infra.plan.memory import KDA_CHUNK
from k3infra.plan.model import ModelSpec
from k3infra.plan.optimizer import update_seconds
from k3infra.plan.workload import WEIGHT_BYTES, Layout, ServeWorkload, TrainWorkload

__all__ = ["model_flops_per_token", "train_time", "serve_time"]



def model_flops_per_token(model: ModelSpec, seq_len: int) -> tuple[float, float]:
    """``(gemm, attention)`` model FLOPs per trained token, forward + backward (``K3_MODEL.md`` §5, PaLM
    convention: the full attention matrix is counted)."""
    _, _, active = model.count()
    attn = 0.0
    if model.mla:
        a = model.mla
        attn += 6 * model.n_attention("mla") * a.heads * (a.nope + a.rope + a.v_dim) * seq_len
    if model.gqa:
        attn += 6 * model.n_attention("gqa") * model.gqa.heads * 2 * model.gqa.head_dim * seq_len
    if model.kda:
        k = model.kda
        attn += 6 * model.n_attention("kda") * k.heads * (3 * k.head_dim**2 + 4 * KDA_CHUNK * k.head_dim)
    return 6.0 * active, attn


def _link_seconds(entry: dict[str, float], cluster: ClusterSpec) -> float:
    return entry.get("nvlink", 0.0) / cluster.gpu.nvlink_bw + entry.get("network", 0.0) / cluster.gpu.network_bw


def train_time(model: ModelSpec, layout: Layout, work: TrainWorkload, cluster: ClusterSpec, micro_batches: int,
               comm: dict[str, dict[str, float]], *, efficiency: float = 0.5, overlap: str = "dp",
               ep_imbalance: float = 1.0) -> dict[str, float]:  # fmt: skip
    """Seconds per step and throughput.

    Args:
        efficiency: fraction of the dense peak a GEMM reaches (an assumption shown in the report).
        ep_imbalance: slowest EP rank's expert work ÷ the mean, without MoonEP redundancy (with it, 1).

    Returns:
        ``compute_s, bubble_s, comm_s`` (all traffic), ``exposed_comm_s``, ``update_s`` (the optimizer),
        ``step_s``, ``tokens_per_s``,
        ``mfu`` (model FLOPs ÷ world·bf16 peak) and one ``<collective>_s`` per entry of ``comm``.
    """
    gpu = cluster.gpu
    gemm, attn = model_flops_per_token(model, work.seq_len)
    tokens_gpu = work.global_batch_tokens / layout.world
    if layout.recompute == "full":
        gemm, attn = gemm * 4 / 3, attn * 4 / 3
    if model.moe and layout.redundant == 0 and layout.ep > 1:
        _, _, active = model.count()
        routed = model.n_moe_layers * model.moe.top_k * model.moe.expert_params / active
        gemm *= 1 + routed * (ep_imbalance - 1)
    gemm_peak = gpu.fp8_flops if work.precision == "fp8" else gpu.bf16_flops
    compute = tokens_gpu * (gemm / gemm_peak + attn / gpu.bf16_flops) / efficiency
    bubble = compute * (layout.pp - 1) / (layout.vp * micro_batches)
    seconds = {name: _link_seconds(entry, cluster) for name, entry in comm.items()}
    hidden_names = {"none": (), "dp": ("dp_",), "all": ("dp_", "ep_", "pp_", "cp_")}[overlap]
    hidden = sum(s for n, s in seconds.items() if n.startswith(hidden_names)) if hidden_names else 0.0
    exposed = sum(seconds.values()) - hidden + max(0.0, hidden - compute)
    update = update_seconds(model, layout, work, cluster, efficiency=efficiency)
    step = compute + bubble + exposed + update
    model_flops = sum(model_flops_per_token(model, work.seq_len)) * work.global_batch_tokens
    result = {
        "compute_s": compute, "bubble_s": bubble, "comm_s": sum(seconds.values()), "exposed_comm_s": exposed,
        "update_s": update, "step_s": step, "tokens_per_s": work.global_batch_tokens / step,
        "mfu": model_flops / step / (layout.world * gpu.bf16_flops),
    }  # fmt: skip
    result.update({f"{n}_s": s for n, s in seconds.items()})
    return result


def serve_time(model: ModelSpec, layout: Layout, work: ServeWorkload, cluster: ClusterSpec, memory: dict[str, float],
               comm: dict[str, dict[str, float]], *, efficiency: float = 0.5) -> dict[str, float]:  # fmt: skip
    """Decode round time, decode throughput and a prefill (time to first token) estimate for one sequence.

    A replica's ``⌈concurrency/DP⌉`` sequences are split into ``n = min(PP, sequences)`` decode micro-batches.
    For one micro-batch a stage reads its dense weights, the experts its tokens touch (expected distinct experts
    of ``E`` hit by ``T`` tokens choosing ``k``: ``E·(1 − (1 − k/E)^T)``), their cache and KDA state (read and
    written), and sends its share of the step's traffic. Every sequence gains one token per round of ``PP``
    stage times (``n ≤ PP`` micro-batches each pass every stage once).
    """
    L, gpu = layout, cluster.gpu
    seqs = -(-work.concurrency // L.dp)
    n_mb = min(L.pp, seqs)
    mb = seqs / n_mb
    total, expert, active = model.count()
    dense_w = (total - expert) / (L.tp * L.pp) * WEIGHT_BYTES[work.dense_weight_dtype]
    expert_read = 0.0
    if model.moe:
        e = model.moe
        tokens_ep = mb * max(1.0, L.ep / (L.tp * L.cp))
        touched = e.experts * (1 - (1 - e.top_k / e.experts) ** tokens_ep)
        expert_read = model.n_moe_layers / L.pp * touched / L.ep * e.expert_params * WEIGHT_BYTES[work.weight_dtype]
    hbm = dense_w + expert_read + (memory["kv_cache"] + 2 * memory["kda_state"]) / n_mb
    flops = mb * 2.0 * active / (L.tp * L.cp * L.pp)
    if model.mla:
        a = model.mla
        attention = 2 * a.heads * (2 * a.kv_rank + a.rope) * work.context * model.n_attention("mla")
        flops += mb * attention / (L.tp * L.cp * L.pp)
    stage = max(hbm / gpu.hbm_bw, flops / (gpu.bf16_flops * efficiency))
    stage += sum(_link_seconds(entry, cluster) for entry in comm.values()) / n_mb
    round_s = stage * L.pp
    gemm, attn = model_flops_per_token(model, work.context)
    prefill = work.context * (gemm + attn) / 3 / ((L.world // L.dp) * gpu.bf16_flops * efficiency)
    return {
        "decode_step_s": round_s, "hbm_bytes": hbm, "decode_tokens_per_s": work.concurrency / round_s,
        "prefill_s": prefill,
    }  # fmt: skip
