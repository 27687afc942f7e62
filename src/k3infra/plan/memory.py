"""Per-GPU memory of a training or serving plan, term by term (bytes).

Training (``K3_MODEL.md`` §5): bf16 weights (2 B), fp32 gradients (4 B), fp32 master + optimizer states
(`OPTIMIZER_BYTES`), sharded by ZeRO stage over the data-parallel group (dense: DP·CP ranks; routed experts: EDP);
saved activations per layer kind and recompute policy, times the micro-batches a pipeline stage keeps in flight;
logits on the last stage; MoonEP redundant-expert prefetch and the S×K dispatch buffer. Serving: weights in the
chosen dtypes, MLA latent / GQA KV cache, KDA recurrent and conv state, the peak of one prefill forward
(`k3infra.plan.prefill`).
The peak is taken over pipeline stages (stage 0 keeps the most micro-batches, the last holds the logits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from k3infra.plan.model import ModelSpec
from k3infra.plan.prefill import prefill_peak
from k3infra.plan.workload import CACHE_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES, Layout, ServeWorkload, TrainWorkload

__all__ = ["KDA_CHUNK", "StageSlice", "stages", "layer_activation", "train_memory", "serve_memory", "cache_per_token",
           "kda_state_bytes", "weight_bytes"]  # fmt: skip

KDA_CHUNK = 64
"""Chunk length C of the chunked KDA form whose intermediates are saved (``K3_MODEL.md`` §5)."""
GRAD_BYTES = 4.0
WEIGHT_TRAIN_BYTES = 2.0
CE_CHUNK_BYTES = 2.0
"""Per token per vocabulary entry of one piece of the chunked cross-entropy (`k3infra.model.linear_ce`): the bf16
logits, turned into their gradient in place."""
CE_WEIGHT_GRAD_BYTES = 4.0
"""Per LM-head weight of the chunked cross-entropy: its fp32 gradient, formed in the forward and kept until the
backward reaches the loss."""


@dataclass(frozen=True)
class StageSlice:
    """The layers (0-based indices) one pipeline rank holds, over all its virtual chunks."""

    stage: int
    layers: tuple[int, ...]
    first: bool
    last: bool


@functools.lru_cache(maxsize=4096)
def stages(n_layers: int, pp: int, vp: int) -> list[StageSlice]:
    """Contiguous split of ``n_layers`` into ``pp·vp`` chunks (later chunks take the remainder); chunk ``c``
    runs on pipeline rank ``c mod pp``.

    Raises:
        ValueError: fewer layers than chunks.
    """
    chunks = pp * vp
    if n_layers < chunks:
        raise ValueError(f"pp·vp = {chunks} chunks exceed the model's {n_layers} layers")
    base, extra = divmod(n_layers, chunks)
    sizes = [base + (1 if c >= chunks - extra else 0) for c in range(chunks)]
    held: list[list[int]] = [[] for _ in range(pp)]
    start = 0
    for c, size in enumerate(sizes):
        held[c % pp].extend(range(start, start + size))
        start += size
    return tuple(StageSlice(s, tuple(held[s]), s == 0, s == pp - 1) for s in range(pp))


@functools.lru_cache(maxsize=65536)
def layer_activation(model: ModelSpec, index: int, recompute: str, act_bytes: float = 2.0) -> float:
    """Saved activation bytes per token of layer ``index`` (not yet divided by TP/CP).

    ``act_bytes`` is the storage of saved bf16 tensors (1 for FP8 storage). ``selective`` keeps the
    memory-efficient MoE (dispatched GEMM inputs re-sent in backward, no saved expert outputs), recomputes the
    KDA chunk intermediates and MLA's up-projected q/k; ``full`` keeps only the layer input (the working set of
    the layer being recomputed is added by the caller).
    """
    if recompute == "full":
        return 2.0 * model.hidden
    d = model.hidden
    attn, ffn = model.layers[index]
    selective = recompute == "selective"
    if attn == "kda":
        k = model.kda
        D = k.heads * k.head_dim
        attn_b = act_bytes * (2 * d + 10 * D) + 4 * D + (0 if selective else 8 * k.heads * KDA_CHUNK)
    elif attn == "mla":
        a = model.mla
        qk = 0 if selective else 2 * a.heads * (a.nope + a.rope)
        out = 4 * a.heads * a.v_dim if a.gated else act_bytes * a.heads * a.v_dim  # K3 keeps the output in fp32
        elems = 2 * d + 2 * a.q_rank + 2 * a.kv_rank + a.rope + qk + (3 if a.gated else 2) * a.heads * a.v_dim
        attn_b = act_bytes * elems + out
    else:
        g = model.gqa
        attn_b = act_bytes * (2 * d + 2 * (g.heads + 2 * g.kv_heads) * g.head_dim + g.heads * g.head_dim) + 4 * g.heads
    if ffn == "moe":
        e = model.moe
        routed = 3 * e.width if selective else 2 * e.latent + 3 * e.width
        elems = 2 * d + 3 * e.shared_width + (2 * e.latent if e.has_latent else 0) + e.top_k * routed
        ffn_b = act_bytes * elems + 4 * e.experts + (4 * e.latent if e.has_latent else 0)
    else:
        ffn_b = act_bytes * (2 * d + 3 * model.dense_width)
    return attn_b + ffn_b


@functools.lru_cache(maxsize=65536)
def _params(model: ModelSpec, sl: StageSlice) -> tuple[float, float, float]:
    """``(non_expert, expert, largest_layer)`` parameters held by a stage before TP/EP sharding."""
    ne = e = biggest = 0.0
    for i in sl.layers:
        a, b = model.layer_params(i)
        ne, e, biggest = ne + a, e + b, max(biggest, a + b)
    if sl.first:
        ne += model.embedding_params
    if sl.last:
        ne += model.head_params
    return ne, e, biggest


def in_flight(layout: Layout, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations a pipeline rank keeps at its peak (1F1B; interleaved adds
    ``(pp−1)/(pp·vp)``)."""
    base = min(micro_batches, layout.pp - stage)
    return base * (1 + (layout.pp - 1) / (layout.pp * layout.vp)) if layout.vp > 1 else base


def ep_buffer_slots(model: ModelSpec, layout: Layout, tokens: float) -> float:
    """Token slots of the static dispatch buffer: S×K with MoonEP redundancy (every rank computes exactly S·K),
    else the worst case a rank may receive, S·EP·min(K, E/EP)."""
    e = model.moe
    if layout.redundant > 0 or layout.ep == 1:
        return tokens * e.top_k
    return tokens * layout.ep * min(e.top_k, e.experts // layout.ep)


@functools.lru_cache(maxsize=16384)
def _stage_table(model: ModelSpec, pp: int, vp: int, recompute: str, act_bytes: float) -> tuple:
    """Per pipeline rank: ``(slice, non_expert, expert, largest_layer, saved, working, has_moe)``; ``saved``
    bytes per token per micro-batch in flight, ``working`` bytes per token once (full recompute)."""
    rows = []
    for sl in stages(len(model.layers), pp, vp):
        ne, e, biggest = _params(model, sl)
        saved = sum(layer_activation(model, i, recompute, act_bytes) for i in sl.layers)
        working = 0.0
        if recompute == "full" and sl.layers:
            # One layer at a time is recomputed: its working set replaces its checkpoint, for one micro-batch.
            working = max(layer_activation(model, i, "selective", act_bytes) for i in sl.layers) - 2.0 * model.hidden
        rows.append((sl, ne, e, biggest, saved, working, any(model.layers[i][1] == "moe" for i in sl.layers)))
    return tuple(rows)


def train_memory(model: ModelSpec, layout: Layout, work: TrainWorkload, micro_batches: int) -> dict[str, float]:
    """Per-GPU bytes of the most loaded pipeline rank, one entry per term (and ``stage``: which rank).

    Args:
        micro_batches: micro-batches per step per data-parallel rank (gradient accumulation steps).
    """
    L = layout
    act_bytes = 1.0 if work.precision == "fp8" else 2.0
    opt = OPTIMIZER_BYTES[work.optimizer]
    dense_group, expert_group = L.dp * L.cp, L.edp
    w_shard = (dense_group, expert_group) if L.zero >= 3 else (1, 1)
    g_shard = (dense_group, expert_group) if L.zero >= 2 else (1, 1)
    o_shard = (dense_group, expert_group) if L.zero >= 1 else (1, 1)
    tokens = work.micro_batch * work.seq_len / (L.cp * L.tp)  # tokens per GPU per micro-batch (sequence parallel)
    attn_res = (model.attn_res_blocks + 1) * model.hidden * 2.0 if model.attn_res_blocks else 0.0
    if work.chunked_ce:  # one piece's logits at a time; the head's input gradient replaces the saved input
        logits = (min(tokens, work.ce_chunk_tokens) * model.vocab * CE_CHUNK_BYTES
                  + model.vocab * model.hidden * CE_WEIGHT_GRAD_BYTES)
    else:  # bf16 logits, fp32 log-probabilities and their fp32 gradient for every token
        logits = tokens * model.vocab * 10.0
    best: dict[str, float] | None = None
    for sl, ne, e, biggest, saved, working, has_moe in _stage_table(model, L.pp, L.vp, L.recompute, act_bytes):
        # Without full recompute each AttnRes site also keeps the running block sum it mixes: two per layer.
        partials = 2 * len(sl.layers) * model.hidden * 2.0 if model.attn_res_blocks and L.recompute != "full" else 0.0
        ne, e = ne / L.tp, e / L.ep
        flight = in_flight(L, sl.stage, micro_batches)
        terms = {
            "weights": WEIGHT_TRAIN_BYTES * (ne / w_shard[0] + e / w_shard[1]),
            "buffers": buffer_bytes(model, sl.layers),
            "gradients": GRAD_BYTES * (ne / g_shard[0] + e / g_shard[1]),
            "optimizer": opt * (ne / o_shard[0] + e / o_shard[1]),
            # FSDP gathers one layer while prefetching the next.
            "fsdp_gather": 2 * WEIGHT_TRAIN_BYTES * biggest / L.tp if L.zero >= 3 else 0.0,
            "activations": tokens * (saved * flight + working),
            "attn_res": tokens * (attn_res + partials) * flight,
            # One micro-batch of logits, vocab-parallel over TP, all of the CP rank's tokens.
            "logits": logits if sl.last else 0.0,
            "ep_buffer": ep_buffer_slots(model, L, tokens) * model.moe.latent * 2.0 if has_moe else 0.0,
            "moonep_prefetch": L.redundant * model.moe.expert_params * WEIGHT_TRAIN_BYTES if has_moe else 0.0,
        }
        total = sum(terms.values())
        if best is None or total > best["total"]:
            best = {**terms, "total": total, "stage": float(sl.stage)}
    return best


def buffer_bytes(model: ModelSpec, layers: tuple[int, ...]) -> float:
    """fp32 buffer bytes of ``layers`` (replicated on every rank of the stage)."""
    return float(sum(model.layer_buffer_bytes[i] for i in layers)) if model.layer_buffer_bytes else 0.0


def cache_per_token(model: ModelSpec, cache_dtype: str = "bf16") -> float:
    """Bytes of attention cache per token over the whole model: MLA latent ``(r_kv + r)`` per MLA layer, GQA
    ``2·kv_heads·head_dim`` per layer (KDA layers keep no per-token cache)."""
    b = CACHE_BYTES[cache_dtype]
    total = 0.0
    if model.mla:
        total += model.n_attention("mla") * (model.mla.kv_rank + model.mla.rope) * b
    if model.gqa:
        total += model.n_attention("gqa") * 2 * model.gqa.kv_heads * model.gqa.head_dim * b
    return total


def weight_bytes(model: ModelSpec, expert_dtype: str = "bf16", dense_dtype: str = "bf16") -> float:
    """Bytes of all weights: routed experts in ``expert_dtype``, everything else in ``dense_dtype``."""
    total, expert, _ = model.count()
    return expert * WEIGHT_BYTES[expert_dtype] + (total - expert) * WEIGHT_BYTES[dense_dtype]


def kda_state_bytes(model: ModelSpec) -> tuple[float, float]:
    """``(recurrent, conv)`` KDA state bytes per sequence: fp32 ``H·d_h²`` and bf16 ``3·D·(w−1)`` per layer."""
    if not model.kda:
        return 0.0, 0.0
    k, n = model.kda, model.n_attention("kda")
    D = k.heads * k.head_dim
    return n * k.heads * k.head_dim**2 * 4.0, n * 3 * D * (k.conv - 1) * 2.0


def serve_memory(model: ModelSpec, layout: Layout, work: ServeWorkload) -> dict[str, float]:
    """Per-GPU serving bytes of the most loaded pipeline rank, one entry per term."""
    L = layout
    seqs = -(-work.concurrency // L.dp)
    best: dict[str, float] | None = None
    for sl in stages(len(model.layers), L.pp, 1):
        ne, e, _ = _params(model, sl)
        terms = {
            "weights": ne / L.tp * WEIGHT_BYTES[work.dense_weight_dtype] + e / L.ep * WEIGHT_BYTES[work.weight_dtype],
            "buffers": buffer_bytes(model, sl.layers),
        }
        kinds = [model.layers[i][0] for i in sl.layers]
        b = CACHE_BYTES[work.cache_dtype]
        cache = 0.0
        if model.mla:  # one latent for all heads: TP ranks split it by tokens (decode context parallel)
            cache += kinds.count("mla") * (model.mla.kv_rank + model.mla.rope) * b / L.tp
        if model.gqa:
            g = model.gqa
            cache += kinds.count("gqa") * 2 * g.kv_heads * g.head_dim * b / min(L.tp, g.kv_heads)
        terms["kv_cache"] = seqs * work.context / L.cp * cache
        if model.kda:
            k = model.kda
            n = kinds.count("kda")
            state = n * (k.heads * k.head_dim**2 * 4.0 + 3 * k.heads * k.head_dim * (k.conv - 1) * 2.0)
            terms["kda_state"] = seqs * state / L.tp
        else:
            terms["kda_state"] = 0.0
        chunk = min(work.prefill_chunk, work.context) / (L.tp * L.cp)
        tokens = chunk * min(work.prefill_batch, seqs)  # every sequence prefilled in one forward
        terms["activations"] = prefill_peak(model, sl.layers, tokens)
        terms["logits"] = seqs * model.vocab / L.tp * 4.0 if sl.last else 0.0
        n_moe = sum(1 for i in sl.layers if model.layers[i][1] == "moe")
        if n_moe:  # with EP 1 the dispatched rows are the MoE working set (in activations)
            terms["ep_buffer"] = ep_buffer_slots(model, L, tokens) * model.moe.latent * 2.0 if L.ep > 1 else 0.0
            terms["redundant_experts"] = L.redundant * n_moe * model.moe.expert_params * WEIGHT_BYTES[work.weight_dtype]
        else:
            terms["ep_buffer"] = terms["redundant_experts"] = 0.0
        total = sum(terms.values())
        if best is None or total > best["total"]:
            best = {**terms, "total": total, "stage": float(sl.stage)}
    return best
