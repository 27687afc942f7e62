"""The chunk-32 workspace of the v2 forward: what the 32-token prepare writes and the chunk-32 recurrence reads.

The fields and meaning of the chunk-16 `workspace.Workspace`, with 32-token chunks and 32x32 tiles::

    kd, qd, kr   [T_total, H, 128] bf16   k * 2^G,  q * 2^G * scale,  k * 2^(Glast - G)   (k, q L2-normed)
    inv          [NT, H, 32, 32]   bf16   (I + L)^-1,  L = strict_lower(diag(beta) k_i k_j 2^(G_i - G_j))
    mqk          [NT, H, 32, 32]   bf16   lower_incl_diag(q_i k_j 2^(G_i - G_j) * scale)
    glast        [NT, H, 128]      fp32   2^Glast
    beta         [T_total, H]      fp32   sigmoid(beta)
    chunk_index  [NT, 3]           int32  (sequence id, first token row, valid tokens); (-1, 0, 0) past the last chunk
    seq_chunks   [N + 1]           int32  first chunk of each sequence

``G`` is the in-chunk cumsum of the gate in log2 units from the chunk start. With ``lower_bound = -5`` it reaches
``-231``: ``2^G`` may underflow (to bf16 subnormals or zero; the true factor is below ``2^-126`` of the terms it
is added to, so nothing is lost), but ``2^-G`` would overflow, so ``ki = k 2^-G`` is never formed. The prepare
builds ``L`` and ``Mqk`` by 16-token halves, each with its own reference (``r = G[15]`` for the second half; the
cross block ``L21 = (k 2^(G - r))_B (k 2^(r - G))_A^T``), so every factor stays within ``2^115`` and every output
depends only on the gates up to its token (see `emulate32`).
"""

from __future__ import annotations

import torch

from flashkda.fwd.v2.workspace import HEAD_DIM, ChunkLayout, Workspace
from flashkda.index import build_chunk_index
from flashkda.seqlens import IdentityCache

__all__ = ["CHUNK32", "REF_TOKEN", "allocate_workspace32", "build_chunk_layout32", "cached_chunk_layout32"]

CHUNK32 = 32
#: The token whose cumulative gate is the reference ``r`` of the second half's exponents in the prepare.
REF_TOKEN = 15


def build_chunk_layout32(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkLayout:
    """The 32-token chunk layout of ``B`` sequences of ``T`` tokens or of the varlen batch ``cu_seqlens``.

    Same fields and device-only construction as `workspace.build_chunk_layout` (which builds 16-token chunks);
    ``max_chunks_per_seq`` is ``ceil(T / 32)``.
    """
    C = CHUNK32
    index = build_chunk_index(B, T, cu_seqlens, C)
    nts = -(-T // C)
    ids = torch.arange(index.num_chunks, dtype=torch.int32, device=device)
    if index.is_varlen:
        cu, seq_chunks, seq = index.cu_seqlens, index.chunk_offsets, index.chunk_map
        live = seq >= 0
        safe = torch.where(live, seq, torch.zeros_like(seq)).long()
        first = cu[safe] + (ids - seq_chunks[safe]) * C
        valid = torch.where(live, torch.clamp(cu[safe + 1] - first, max=C), torch.zeros_like(first))
        first = torch.where(live, first, torch.zeros_like(first))
    else:
        cu = torch.arange(B + 1, dtype=torch.int32, device=device) * T
        seq_chunks = torch.arange(B + 1, dtype=torch.int32, device=device) * nts
        seq = ids // max(nts, 1)
        within = (ids - seq * nts) * C
        first = seq * T + within
        valid = torch.clamp(T - within, max=C)
    chunk_index = torch.stack([seq, first, valid], 1).to(torch.int32).contiguous()
    order = None
    if index.is_varlen and index.num_seqs > 1:
        order = torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)
    return ChunkLayout(num_seqs=index.num_seqs, num_chunks=index.num_chunks, total_tokens=B * T,
                       max_chunks_per_seq=nts, chunk_index=chunk_index, seq_chunks=seq_chunks.contiguous(),
                       cu_seqlens=cu.contiguous(), seq_order=order)


_LAYOUTS32 = IdentityCache(size=8)


def cached_chunk_layout32(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkLayout:
    """`build_chunk_layout32`, reused across calls like ``workspace.cached_chunk_layout``: per ``(B, T, device)``
    for fixed length, per ``cu_seqlens`` tensor object (while unmodified in place) for varlen."""
    device = torch.device(device)
    key_tensor = cu_seqlens if cu_seqlens is not None else _FIXED_KEY
    layout = _LAYOUTS32.get(key_tensor, B, T, device)
    if layout is None:
        layout = _LAYOUTS32.put(key_tensor, build_chunk_layout32(B, T, cu_seqlens, device), B, T, device)
    return layout


#: the cache key tensor of every fixed-length layout (the key is then ``(B, T, device)``)
_FIXED_KEY = torch.zeros(1)


def allocate_workspace32(layout: ChunkLayout, H: int, device: torch.device) -> Workspace:
    """Uninitialised chunk-32 workspace for ``layout`` (from `build_chunk_layout32`) and ``H`` heads.

    Returns:
        `workspace.Workspace` with ``kd, qd, kr`` ``[T_total, H, 128]`` bf16, ``inv, mqk`` ``[NT, H, 32, 32]`` bf16,
        ``glast`` ``[NT, H, 128]`` fp32, ``beta`` ``[T_total, H]`` fp32.
    """
    T_total, NT = layout.total_tokens, layout.num_chunks

    def tokens():
        return torch.empty(T_total, H, HEAD_DIM, dtype=torch.bfloat16, device=device)

    def tiles():
        return torch.empty(NT, H, CHUNK32, CHUNK32, dtype=torch.bfloat16, device=device)

    return Workspace(kd=tokens(), qd=tokens(), kr=tokens(), inv=tiles(), mqk=tiles(),
                     glast=torch.empty(NT, H, HEAD_DIM, dtype=torch.float32, device=device),
                     beta=torch.empty(T_total, H, dtype=torch.float32, device=device), layout=layout)
