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

from flashkda.fwd.v2.workspace import ChunkLayout, build_chunk_layout, cached_chunk_layout

__all__ = ["CHUNK32", "REF_TOKEN", "build_chunk_layout32", "cached_chunk_layout32"]

CHUNK32 = 32
#: The token whose cumulative gate is the reference ``r`` of the second half's exponents in the prepare.
REF_TOKEN = 15


def build_chunk_layout32(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkLayout:
    """`workspace.build_chunk_layout` with 32-token chunks (``max_chunks_per_seq`` is ``ceil(T / 32)``)."""
    return build_chunk_layout(B, T, cu_seqlens, device, CHUNK32)


def cached_chunk_layout32(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device,
                          cu_seqlens_cpu: torch.Tensor | None = None) -> ChunkLayout:
    """`workspace.cached_chunk_layout` with 32-token chunks."""
    return cached_chunk_layout(B, T, cu_seqlens, device, CHUNK32, cu_seqlens_cpu)
