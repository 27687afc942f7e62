"""Peak bytes of a no-grad prefill forward (serving), phase by phase, as ``k3infra.model`` computes it.

A prefill keeps nothing for backward, so its peak is what one phase of one layer holds at once: the residual
stream alive across layers (the AttnRes sources: embedding, finished block sums, the running block sum), the
layer's own inputs and the locals its code still references, and the widest transient of the phase. Per phase
(bytes per token unless noted; d hidden, D = H·K KDA width, ℓ latent, m expert width, k top-k, E experts):

- KDA (FlashKDA's bf16 split path): the three projections kept for the conv cache, q/k/v, the fp32 decay and its
  bf16 copy, β, the intra stage's w/kg/qg/u and Aqk ``[T, H, 64]``, the state pass's per-chunk states and
  ``v_new``, the output: ``30·D + 134·H + H·K/16 + H·K·V/32``.
- MLA (fused attention: no ``[T, S]`` scores, output ``[B, T, H, d_v]`` so no copy to gather heads): q, the
  up-projected k/v, the concatenated k, the output and the gate's two tensors: ``2·H·(3n + 2r + 4·d_v)`` (the
  latent is the cache).
- MoE (local experts): the widest of router (fp32 x and logits), grouped GEMMs (dispatched ``[T·k, ℓ]`` rows,
  gate/up/activation ``[T·k, m]`` and `SITU_FP32_TEMPS` fp32 blocks of SiTU-GLU), the weighted output and its
  gather, and the combine (gathered outputs, their fp32 copy and the fp32 sum); routing indices stay alive.
- Dense SiTU-GLU: gate, up, activation and the fp32 blocks.

SiTU-GLU makes its fp32 temporaries in row blocks of `SITU_BLOCK_ELEMENTS` elements, so that part stops growing
with the token count.
"""

from __future__ import annotations

from k3infra.plan.model import ModelSpec

__all__ = ["SITU_BLOCK_ELEMENTS", "SITU_FP32_TEMPS", "prefill_peak", "kda_prefill", "mla_prefill", "moe_prefill"]

SITU_BLOCK_ELEMENTS = 1 << 24
"""Elements per fp32 row block of the model's SiTU-GLU (``k3infra.model.layers.SITU_BLOCK_ELEMENTS``)."""
SITU_FP32_TEMPS = 5
"""fp32 blocks SiTU-GLU holds at once: both inputs' fp32 copies plus two factors and their product."""
NORM_TEMPS = 12.0
"""Bytes per element of an RMSNorm's transients: the fp32 copy, ``x·rstd`` and ``·weight`` (4 B each)."""
ATTN_RES_TEMPS = 8.0
"""Bytes per element of an AttnRes site's transients: one source's fp32 copy and its square."""
FLASHKDA_CHUNK = 64


def _situ_blocks(rows: float, width: int) -> float:
    """Bytes of SiTU-GLU's fp32 temporaries for ``rows`` rows of ``width`` (capped by the row block)."""
    block_rows = max(1, SITU_BLOCK_ELEMENTS // width)
    return SITU_FP32_TEMPS * 4.0 * min(rows, block_rows) * width


def kda_prefill(model: ModelSpec) -> float:
    """Bytes per token a KDA layer's mixer holds at its peak (beyond its normed input)."""
    k = model.kda
    H, K = k.heads, k.head_dim
    D = H * K
    return 30.0 * D + 134.0 * H + H * K * 4.0 / FLASHKDA_CHUNK + 2.0 * H * K * K / FLASHKDA_CHUNK


def mla_prefill(model: ModelSpec) -> float:
    """Bytes per token an MLA layer holds at its peak (beyond its normed input; the latent is the cache)."""
    a = model.mla
    return 2.0 * a.heads * (3 * a.nope + 2 * a.rope + 4 * a.v_dim)


def _gqa_prefill(model: ModelSpec) -> float:
    g = model.gqa
    return 2.0 * g.head_dim * (3 * g.heads + 2 * g.kv_heads)


def moe_prefill(model: ModelSpec, tokens: float) -> float:
    """Bytes a MoE FFN holds at its peak for ``tokens`` tokens (beyond its normed input)."""
    e, d = model.moe, model.hidden
    k, lat, m, n = e.top_k, e.latent, e.width, tokens
    # top-(k+1) indices (the k-wide view keeps them), scaled weights, the latent input (when projected)
    base = n * ((k + 1) * 8.0 + k * 4.0 + (2.0 * lat if e.has_latent else 0.0))
    order = n * k * (3 * 8.0 + 4.0)  # flattened ids, their sort order, token of each slot, slot weights
    router = n * (4.0 * d + 4.0 * e.experts)
    gemm = order + n * k * (2.0 * lat + 6.0 * m) + _situ_blocks(n * k, m)
    weighted = order + n * k * (6.0 * lat + 6.0 * m)  # x, gate, up, act, act·w, output, its masked copy
    combine = order + n * k * (8.0 + 8.0 * lat) + n * 4.0 * lat  # unsort, y, y gathered, fp32 copy, fp32 sum
    tail = n * (4.0 * lat + 2.0 * lat + NORM_TEMPS * lat) if e.has_latent else 0.0
    shared = n * (2.0 * d + 6.0 * e.shared_width) + _situ_blocks(n, e.shared_width) if e.shared_width else 0.0
    return base + max(router, gemm, weighted, combine, tail, shared)


def _dense_prefill(model: ModelSpec, tokens: float) -> float:
    F = model.dense_width
    return tokens * 6.0 * F + _situ_blocks(tokens, F)


def _stream(model: ModelSpec, index: int) -> tuple[float, float]:
    """Residual-stream bytes per token alive during layer ``index``'s ``(attention, ffn)`` phase, its inputs
    included: AttnRes sources, the site's output, the normed input (and in the FFN phase the mixer output)."""
    d2 = 2.0 * model.hidden
    size = model.attn_res_block_size
    if not size:  # plain residual: x, the normed input, in the FFN phase also the attention output
        return 2 * d2, 3 * d2
    blocks = 1 + index // size
    running = 1 if index % size else 0
    attn = d2 * (blocks + running + (1 if blocks + running > 1 else 0) + 1)
    # blocks, site output, normed input, the new running sum; mid-block also the mixer output and the old running
    # sum (the decoder's loop still holds it until the layer returns)
    ffn = d2 * (blocks + 3 + 2 * running)
    return attn, ffn


def layer_prefill(model: ModelSpec, index: int, tokens: float) -> float:
    """Bytes layer ``index`` holds at its peak in a prefill of ``tokens`` tokens, residual stream included."""
    attn_kind, ffn_kind = model.layers[index]
    attn_stream, ffn_stream = _stream(model, index)
    d = model.hidden
    mixer = {"kda": kda_prefill, "mla": mla_prefill, "gqa": _gqa_prefill}[attn_kind](model)
    site = ATTN_RES_TEMPS * d if model.attn_res_block_size else 0.0
    attn = tokens * (attn_stream + max(mixer, NORM_TEMPS * d, site))
    ffn_work = moe_prefill(model, tokens) if ffn_kind == "moe" else _dense_prefill(model, tokens)
    ffn = ffn_stream * tokens + max(ffn_work, tokens * NORM_TEMPS * d, tokens * site)
    return max(attn, ffn)


def prefill_peak(model: ModelSpec, layers: tuple[int, ...], tokens: float) -> float:
    """Peak activation bytes of a no-grad prefill of ``tokens`` tokens (all sequences of the forward) through
    ``layers``; caches are not included (they are their own terms)."""
    return max(layer_prefill(model, i, tokens) for i in layers)
