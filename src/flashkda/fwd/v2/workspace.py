"""The workspace that the v2 prepare kernel (K1) writes and the recurrence kernel (K2) reads, and its chunk index.

Layout (all tensors contiguous, token-major like the inputs; ``T_total = B * T`` token rows; ``H`` value heads;
``NT`` 16-token chunks, for varlen a static upper bound whose surplus rows are marked ``-1``)::

    kd, qd, kr   [T_total, H, 128] bf16   k * 2^G,  q * 2^G * scale,  k * 2^(Glast - G)   (k, q L2-normed)
    inv          [NT, H, 16, 16]   bf16   (I + L)^-1,  L = strict_lower(diag(beta) kd ki^T),  ki = k * 2^-G
    mqk          [NT, H, 16, 16]   bf16   lower_incl_diag(qd ki^T)
    glast        [NT, H, 128]      fp32   2^Glast, the per-channel decay of the whole chunk
    beta         [T_total, H]      fp32   sigmoid(beta)
    chunk_index  [NT, 3]           int32  (sequence id, first token row, valid tokens); (-1, 0, 0) past the last chunk
    seq_chunks   [N + 1]           int32  first chunk of each sequence (prefix sum of chunks per sequence)

``G`` is the in-chunk cumsum of the gate in log2 units (``cumsum(g) * log2(e)``), restarting at every chunk;
``Glast`` is ``G`` at the chunk's last valid token. Chunks never straddle sequences: a sequence's last chunk may
hold fewer than 16 tokens, and rows past its end are zero in ``inv``/``mqk`` (the token rows simply do not exist).
The chunks of sequence ``n`` are ``seq_chunks[n] .. seq_chunks[n + 1] - 1``, in token order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from flashkda.index import build_chunk_index
from flashkda.seqlens import IdentityCache

__all__ = ["CHUNK", "HEAD_DIM", "HEAD_DIMS", "ChunkLayout", "Workspace", "allocate_workspace", "build_chunk_layout",
           "cached_chunk_layout", "longest_first_order"]

CHUNK = 16
HEAD_DIM = 128
#: The head widths ``K = V`` the 16-token-chunk kernels take (K1, K2, B2, B3); the 32-token ones take `HEAD_DIM`.
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class ChunkLayout:
    """Where the 16-token chunks of a batch live.

    Attributes:
        num_seqs: number of sequences ``N`` (``B`` for fixed length).
        num_chunks: ``NT``, rows of ``chunk_index``; exact for fixed length, an upper bound for varlen.
        total_tokens: ``T_total = B * T``.
        max_chunks_per_seq: an upper bound of chunks in one sequence (``ceil(T / 16)``).
        chunk_index: ``[NT, 3]`` int32 ``(sequence id, first token row, valid tokens)``, ``(-1, 0, 0)`` when unused.
        seq_chunks: ``[N + 1]`` int32 first chunk of each sequence, ``seq_chunks[N]`` = chunks in use.
        cu_seqlens: ``[N + 1]`` int32 token offsets of the sequences (built for fixed length too).
        seq_order: ``[N]`` int32 sequence ids longest first (the recurrence's launch order), None for one sequence.
        chunk: tokens per chunk.
        dense: every token row lies in a chunk and every chunk row is in use (fixed length); a varlen layout may
            have rows past the last sequence and unused chunk rows.
    """

    num_seqs: int
    num_chunks: int
    total_tokens: int
    max_chunks_per_seq: int
    chunk_index: torch.Tensor
    seq_chunks: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_order: torch.Tensor | None = None
    chunk: int = CHUNK
    dense: bool = False
    _derived: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def derived(self, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``build()``, a tensor computed from this layout alone, kept with the layout under ``key``: a model's layers
        share one cached layout (`cached_chunk_layout`), so the small kernels that derive per-chunk tables from it
        run once per batch. The tensor must never be written."""
        value = self._derived.get(key)
        if value is None:
            value = self._derived[key] = build()
        return value


def longest_first_order(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence ids sorted by length, longest first (``[N]`` int32, device ops only, no host sync)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)


def build_chunk_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device,
                       chunk: int = CHUNK) -> ChunkLayout:
    """The chunk layout of ``B`` sequences of ``T`` tokens, or of the varlen batch ``cu_seqlens`` (``B == 1``).

    Every tensor is made by device ops from ``cu_seqlens`` (no host synchronisation, CUDA-graph safe); the varlen
    chunk count is the static bound ``min(ceil(T / chunk) + N - 1, T)``.

    Args:
        B, T: batch size and padded length of the ``[B, T, ...]`` inputs.
        cu_seqlens: ``[N + 1]`` int32/int64 cumulative lengths (varlen, ``B == 1``), or None.
        device: where the index tensors live (the inputs' device).
        chunk: tokens per chunk (16, or 32 for `flashkda.fwd.v2.workspace32`).

    Returns:
        `ChunkLayout`.
    """
    index = build_chunk_index(B, T, cu_seqlens, chunk)
    nts = -(-T // chunk)
    ids = torch.arange(index.num_chunks, dtype=torch.int32, device=device)
    if index.is_varlen:
        cu, seq_chunks = index.cu_seqlens, index.chunk_offsets
        seq = index.chunk_map
        live = seq >= 0
        safe = torch.where(live, seq, torch.zeros_like(seq)).long()
        first = cu[safe] + (ids - seq_chunks[safe]) * chunk
        valid = torch.clamp(cu[safe + 1] - first, max=chunk)
        first = torch.where(live, first, torch.zeros_like(first))
        valid = torch.where(live, valid, torch.zeros_like(valid))
    else:
        cu = torch.arange(B + 1, dtype=torch.int32, device=device) * T
        seq_chunks = torch.arange(B + 1, dtype=torch.int32, device=device) * nts
        seq = ids // max(nts, 1)
        within = (ids - seq * nts) * chunk
        first = seq * T + within
        valid = torch.clamp(T - within, max=chunk)
    chunk_index = torch.stack([seq, first, valid], 1).to(torch.int32).contiguous()
    return ChunkLayout(num_seqs=index.num_seqs, num_chunks=index.num_chunks, total_tokens=B * T,
                       max_chunks_per_seq=nts, chunk_index=chunk_index, seq_chunks=seq_chunks.contiguous(),
                       cu_seqlens=cu.contiguous(), seq_order=longest_first_order(cu) if index.num_seqs > 1 else None,
                       chunk=chunk, dense=not index.is_varlen)


_FIXED_LAYOUTS: dict[tuple, ChunkLayout] = {}
_VARLEN_LAYOUTS = IdentityCache(size=8)
#: fixed-length layouts kept (oldest dropped first)
_FIXED_LAYOUTS_MAX = 16


def cached_chunk_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device,
                        chunk: int = CHUNK, cu_seqlens_cpu: torch.Tensor | None = None) -> ChunkLayout:
    """`build_chunk_layout`, reused across calls: per ``(B, T, device, chunk)`` for fixed length, per ``cu_seqlens``
    tensor object (while unmodified in place) for varlen; an inference-mode ``cu_seqlens`` has no modification
    counter, so its layout is kept per tensor object and ``cu_seqlens_cpu`` values when the caller passes that CPU
    copy, else built on every call (`flashkda.seqlens.IdentityCache`).

    Building a layout launches about twenty small kernels; a model's KDA layers all see the same batch, so every
    layer after the first reuses its layout. The cached tensors are never written after they are built.
    """
    device = torch.device(device)
    if cu_seqlens is None:
        key = (B, T, device, chunk)
        layout = _FIXED_LAYOUTS.get(key)
        if layout is None:
            layout = build_chunk_layout(B, T, None, device, chunk)
            _FIXED_LAYOUTS[key] = layout
            while len(_FIXED_LAYOUTS) > _FIXED_LAYOUTS_MAX:
                del _FIXED_LAYOUTS[next(iter(_FIXED_LAYOUTS))]
        return layout
    return _VARLEN_LAYOUTS.get_or_make(cu_seqlens, lambda: build_chunk_layout(B, T, cu_seqlens, device, chunk), B, T,
                                       device, chunk, witness=cu_seqlens_cpu)


@dataclass(frozen=True)
class Workspace:
    """K1's outputs, K2's inputs (shapes and meaning in the module docstring)."""

    kd: torch.Tensor
    qd: torch.Tensor
    kr: torch.Tensor
    inv: torch.Tensor
    mqk: torch.Tensor
    glast: torch.Tensor
    beta: torch.Tensor
    layout: ChunkLayout

    @property
    def num_heads(self) -> int:
        return self.kd.shape[1]


def allocate_workspace(layout: ChunkLayout, H: int, device: torch.device, head_dim: int = HEAD_DIM) -> Workspace:
    """Uninitialised workspace for ``layout`` and ``H`` heads (K1 writes every element K2 reads).

    Args:
        layout: from `build_chunk_layout`.
        H: number of heads.
        device: the inputs' device.
        head_dim: ``K`` (the kernels: 64 or 128; the torch emulation also takes other widths).

    Returns:
        `Workspace` with ``kd, qd, kr`` ``[T_total, H, K]`` bf16, ``inv, mqk`` ``[NT, H, C, C]`` bf16 (``C`` the
        layout's chunk), ``glast`` ``[NT, H, K]`` fp32, ``beta`` ``[T_total, H]`` fp32.
    """
    T_total, NT, C = layout.total_tokens, layout.num_chunks, layout.chunk

    def tokens():
        return torch.empty(T_total, H, head_dim, dtype=torch.bfloat16, device=device)

    def tiles():
        return torch.empty(NT, H, C, C, dtype=torch.bfloat16, device=device)

    return Workspace(
        kd=tokens(), qd=tokens(), kr=tokens(), inv=tiles(), mqk=tiles(),
        glast=torch.empty(NT, H, head_dim, dtype=torch.float32, device=device),
        beta=torch.empty(T_total, H, dtype=torch.float32, device=device),
        layout=layout,
    )
