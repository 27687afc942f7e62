"""Chunk bookkeeping for fixed-length and varlen batches, computed on the device without host synchronisation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashkda.seqlens import IdentityCache


@dataclass(frozen=True)
class ChunkIndex:
    """Where each chunk of ``chunk_size`` tokens lives.

    Attributes:
        num_seqs: number of sequences ``N``.
        num_chunks: grid size of the per-chunk stage; for varlen an upper bound (surplus entries are ``-1``).
        chunks_per_seq: chunks per sequence for fixed-length input (0 for varlen).
        is_varlen: True when built from ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` int32 token offsets (varlen only).
        chunk_offsets: ``[N + 1]`` int32 first global chunk of each sequence (varlen only).
        chunk_map: ``[num_chunks]`` int32 sequence of each global chunk, ``-1`` past the last one (varlen only).
    """

    num_seqs: int
    num_chunks: int
    chunks_per_seq: int
    is_varlen: bool
    cu_seqlens: torch.Tensor | None = None
    chunk_offsets: torch.Tensor | None = None
    chunk_map: torch.Tensor | None = None


def build_chunk_index(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int) -> ChunkIndex:
    """Chunk index for ``B`` sequences of ``T`` tokens, or for the varlen batch ``cu_seqlens`` (then ``B == 1``).

    The varlen grid is sized by the static bound ``ceil(T / C) + N - 1`` (never more than ``T``), and every
    tensor is computed by device ops, so the call never waits for the device and can be captured in a CUDA graph.
    """
    if cu_seqlens is None:
        nts = -(-T // chunk_size)
        return ChunkIndex(num_seqs=B, num_chunks=B * nts, chunks_per_seq=nts, is_varlen=False)
    N = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int32)
    lens = cu[1:] - cu[:-1]
    chunks = (lens + chunk_size - 1) // chunk_size
    offsets = torch.zeros(N + 1, dtype=torch.int32, device=cu.device)
    offsets[1:] = torch.cumsum(chunks, 0)
    bound = min(-(-T // chunk_size) + N - 1, T) if N > 0 else 0
    ids = torch.arange(bound, dtype=torch.int32, device=cu.device)
    seq = torch.searchsorted(offsets[1:].contiguous(), ids, right=True).to(torch.int32)
    seq = torch.where(seq >= N, torch.full_like(seq, -1), seq)
    return ChunkIndex(num_seqs=N, num_chunks=bound, chunks_per_seq=0, is_varlen=True, cu_seqlens=cu,
                      chunk_offsets=offsets, chunk_map=seq)


_VARLEN_INDEXES = IdentityCache(size=8)


def cached_chunk_index(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int,
                       cu_seqlens_cpu: torch.Tensor | None = None) -> ChunkIndex:
    """`build_chunk_index`, kept while the same ``cu_seqlens`` object comes back unmodified (an inference-mode one:
    with the same ``cu_seqlens_cpu`` values; `flashkda.seqlens.IdentityCache`), so the layers of a model that share
    a batch build its index once instead of once per layer."""
    if cu_seqlens is None:
        return build_chunk_index(B, T, None, chunk_size)
    return _VARLEN_INDEXES.get_or_make(cu_seqlens, lambda: build_chunk_index(B, T, cu_seqlens, chunk_size), B, T,
                                       chunk_size, witness=cu_seqlens_cpu)
