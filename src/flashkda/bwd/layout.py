"""The chunked layout used by the training path: ``[B, T, HV, D]`` (or varlen ``[1, T, HV, D]``) to
``[NC, HV, C, D]`` and back.

Each sequence is cut into ``ceil(len / C)`` chunks; the tail of its last chunk is zero padding. A padded token has
``k = v = g = beta = 0``, which leaves the state untouched (``exp(0) = 1`` decay, zero write), so the state after a
sequence's last chunk is exactly its final state. An empty sequence owns no chunk at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashkda.seqlens import IdentityCache, host_cu_seqlens

__all__ = ["ChunkLayout", "from_chunks", "make_layout", "to_chunks"]


@dataclass(frozen=True)
class ChunkLayout:
    """Where every chunk comes from."""

    B: int
    """Batch size of the token layout (1 with ``cu_seqlens``)."""
    T: int
    """Tokens per batch row."""
    C: int
    """Chunk size."""
    num_chunks: int
    """``NC``, chunks over all sequences."""
    chunk_offsets: torch.Tensor
    """``[N + 1]`` int32: sequence ``n`` owns chunks ``chunk_offsets[n] .. chunk_offsets[n + 1]``."""
    gather_index: torch.Tensor | None
    """Varlen only: ``[NC * C]`` int64 token index per chunk slot, ``T`` (a zero row) on padding."""
    scatter_index: torch.Tensor | None
    """Varlen only: ``[T]`` int64 chunk slot of every token."""


def make_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, C: int, device: torch.device,
                cu_seqlens_cpu: torch.Tensor | None = None) -> ChunkLayout:
    """Plan the chunked layout.

    Args:
        B: batch size (must be 1 with ``cu_seqlens``).
        T: sequence length (total tokens with ``cu_seqlens``).
        cu_seqlens: ``[N + 1]`` cumulative lengths, or None for ``B`` sequences of length ``T``.
        C: chunk size (a multiple of 16).
        device: where the index tensors live.
        cu_seqlens_cpu: the host copy of ``cu_seqlens``, if the caller has one.

    Returns:
        A `ChunkLayout`. Varlen needs ``cu_seqlens`` on the host: ``cu_seqlens_cpu``, or one read of the device
        tensor per tensor object (`flashkda.seqlens`); the layout of the last few ``cu_seqlens`` objects is kept, and
        the index tensors go to the device without waiting for it, so a training loop that reuses its
        ``cu_seqlens`` (or passes ``cu_seqlens_cpu``) never synchronises here.
    """
    if cu_seqlens is None:
        nt = -(-T // C)
        offsets = torch.arange(B + 1, dtype=torch.int32, device=device) * nt
        return ChunkLayout(B, T, C, B * nt, offsets, None, None)
    return _LAYOUTS.get_or_make(
        cu_seqlens, lambda: _varlen_layout(T, host_cu_seqlens(cu_seqlens, cu_seqlens_cpu), C, device), T, C,
        torch.device(device))


#: Varlen layouts of the last few ``cu_seqlens`` tensors (the index tensors are ~``T`` int64 each).
_LAYOUTS = IdentityCache(size=2)


def _varlen_layout(T: int, bounds: torch.Tensor, C: int, device: torch.device) -> ChunkLayout:
    lens = bounds[1:] - bounds[:-1]
    nts = (lens + C - 1) // C
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = nts.cumsum(0)
    num_chunks = int(offsets[-1])
    # Slot s of chunk c of sequence n holds token bos_n + (c - offsets[n]) * C + s, or padding past eos_n.
    seq_of_chunk = torch.repeat_interleave(torch.arange(len(lens)), nts)
    pos = (torch.arange(num_chunks) - offsets[:-1][seq_of_chunk]).unsqueeze(1) * C + torch.arange(C)
    tok = bounds[:-1][seq_of_chunk].unsqueeze(1) + pos
    valid = pos < lens[seq_of_chunk].unsqueeze(1)
    gather = torch.where(valid, tok, torch.full_like(tok, T)).reshape(-1)
    scatter = torch.nonzero(valid.reshape(-1)).squeeze(1)
    return ChunkLayout(1, T, C, num_chunks, _to_device(offsets.to(torch.int32), device), _to_device(gather, device),
                       _to_device(scatter, device))


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ``x`` on ``device``; to a GPU from pinned memory without waiting (a pageable copy synchronises)."""
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def to_chunks(x: torch.Tensor, layout: ChunkLayout, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, T, HV, D]`` to ``[NC, HV, C, D]`` (zero padded, contiguous), in ``dtype`` (default ``x``'s): the
    conversion happens in the final layout copy, not as a pass of its own. Differentiable."""
    B, T, HV, D = x.shape
    C = layout.C
    dtype = dtype or x.dtype
    if layout.gather_index is None:
        pad = layout.num_chunks // max(B, 1) * C - T
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return _contiguous(x.reshape(B, -1, C, HV, D).transpose(2, 3), dtype).view(layout.num_chunks, HV, C, D)
    x = torch.cat([x[0], x.new_zeros(1, HV, D)], dim=0)
    x = x.index_select(0, layout.gather_index)
    return _contiguous(x.reshape(layout.num_chunks, C, HV, D).transpose(1, 2), dtype)


def _contiguous(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # One copy either way (`.to` returns a strided `x` unchanged when the dtype already matches).
    return x.contiguous() if x.dtype == dtype else x.to(dtype, memory_format=torch.contiguous_format)


def from_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``[NC, HV, C, D]`` back to ``[B, T, HV, D]`` (padding dropped). Differentiable."""
    NC, HV, C, D = x.shape
    B, T = layout.B, layout.T
    if layout.gather_index is None:
        x = x.reshape(B, -1, HV, C, D).transpose(2, 3).reshape(B, -1, HV, D)
        return x[:, :T]
    x = x.transpose(1, 2).reshape(NC * C, HV, D)
    return x.index_select(0, layout.scatter_index).unsqueeze(0)
