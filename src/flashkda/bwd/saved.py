"""What the training forward keeps for the backward, made into the backward's operands (fp32, one head slice).

* `SavedLocal`: the intra kernel's ``Aqk``, ``Akk`` and solved inverse, of which only the inverse needs fp32
  (`saved_inverse_fp32`, also ``M Diag(beta)``) for the torch GEMMs.
* The split state path's ``h`` (the state at every chunk start, ``[NC, HV, K, V]``, bf16 for bf16 input), which the
  backward takes instead of recomputing it with ``disable_recompute``. A head slice of it is a strided view;
  `widen_head_slice` copies it into a contiguous fp32 ``[NC, HS, K, V]`` in one pass.
* Token-layout tensors (``do``, the kept ``v_new``, the all-heads pass's ``dv_new``): `head_slice_to_chunks` cuts a
  head slice into the chunked layout ``[NC, HS, C, D]`` in the wanted dtype in one pass.

(torch's strided copies of such views were slow: docs/flashkda-performance.md.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashkda.bwd.layout import ChunkLayout

__all__ = ["SavedLocal", "head_slice_to_chunks", "saved_inverse_fp32", "widen_head_slice"]


@dataclass(frozen=True)
class SavedLocal:
    """The forward kernels' chunk-local matrices for the heads of one backward slice, contiguous ``[NC, HS, C, C]``
    blocks in their stored dtype (bf16 for bf16 input; see ``flashkda.fwd.intra.chunk_kda_fwd_intra``'s
    ``store_local``). The Triton passes read ``aqk`` and ``akk`` as they are (they load into fp32 registers); the
    torch GEMMs need ``minv`` in fp32, converted where it is read (`saved_inverse_fp32`)."""

    aqk: torch.Tensor
    """``scale * sum_d q_td k_id exp(G_td - G_id)`` for ``i <= t``, zero elsewhere."""
    akk: torch.Tensor
    """``sum_d k_td k_id exp(G_td - G_id)`` for ``i < t``, zero elsewhere."""
    minv: torch.Tensor
    """``(I + Diag(beta) Akk)^-1``."""


@triton.jit
def widen_head_slice_kernel(x, out, hv0, HV, HS, BLOCK: tl.constexpr, E: tl.constexpr):
    # program (chunk c, head j of the slice, block b): E = elements per (chunk, head) matrix
    i_ch, i_b = tl.program_id(0), tl.program_id(1)
    i_c, i_j = i_ch // HS, i_ch % HS
    o = i_b * BLOCK + tl.arange(0, BLOCK)
    m = o < E
    b_x = tl.load(x + (i_c.to(tl.int64) * HV + hv0 + i_j) * E + o, mask=m).to(tl.float32)
    tl.store(out + i_ch.to(tl.int64) * E + o, b_x, mask=m)


def widen_head_slice(x: torch.Tensor, hv0: int, hv1: int, num_chunks: int) -> torch.Tensor:
    """``x[:num_chunks, hv0:hv1]`` as a contiguous fp32 tensor.

    Args:
        x: ``[NC', HV, ...]`` contiguous (``NC' >= num_chunks``; varlen forwards allocate an upper bound), any float
            dtype.
        hv0, hv1: the head slice, ``0 <= hv0 < hv1 <= HV``.
        num_chunks: chunks to keep.

    Returns:
        ``[num_chunks, hv1 - hv0, ...]`` fp32.
    """
    assert x.is_contiguous() and 0 <= hv0 < hv1 <= x.shape[1] and num_chunks <= x.shape[0], "bad head slice"
    HV, HS = x.shape[1], hv1 - hv0
    E = x[0, 0].numel()
    out = torch.empty((num_chunks, HS, *x.shape[2:]), dtype=torch.float32, device=x.device)
    if num_chunks and E:
        BLOCK = min(4096, triton.next_power_of_2(E))
        widen_head_slice_kernel[(num_chunks * HS, triton.cdiv(E, BLOCK))](x, out, hv0, HV, HS, BLOCK=BLOCK, E=E,
                                                                          num_warps=4)
    return out


@triton.jit
def saved_inverse_fp32_kernel(m, beta, out, C: tl.constexpr, HAS_BETA: tl.constexpr):
    # one [C, C] matrix per program: out = m (as fp32), times beta on its columns with HAS_BETA
    i_b = tl.program_id(0)
    o = tl.arange(0, C)
    p = i_b.to(tl.int64) * C * C + o[:, None] * C + o[None, :]
    b_m = tl.load(m + p).to(tl.float32)
    if HAS_BETA:
        b_m = b_m * tl.load(beta + i_b.to(tl.int64) * C + o).to(tl.float32)[None, :]
    tl.store(out + p, b_m)


def saved_inverse_fp32(m: torch.Tensor, beta: torch.Tensor | None = None) -> torch.Tensor:
    """``M`` or ``M Diag(beta)`` in fp32 from the forward's saved inverse, in one pass.

    Args:
        m: ``[..., C, C]`` contiguous, any float dtype (bf16 for bf16 callers).
        beta: ``[..., C]`` or None.

    Returns:
        ``[..., C, C]`` fp32, contiguous.
    """
    assert m.is_contiguous() and m.shape[-1] == m.shape[-2], "need contiguous square blocks"
    C = m.shape[-1]
    assert C == triton.next_power_of_2(C), f"chunk size must be a power of two, got {C}"
    if beta is not None:
        beta = beta.contiguous()
        assert beta.shape == m.shape[:-1], f"beta {tuple(beta.shape)} vs m {tuple(m.shape)}"
    out = torch.empty(m.shape, dtype=torch.float32, device=m.device)
    nb = m.numel() // (C * C)
    if nb:
        saved_inverse_fp32_kernel[(nb,)](m, m if beta is None else beta, out, C=C, HAS_BETA=beta is not None,
                                         num_warps=4)
    return out


@triton.jit
def head_slice_to_chunks_kernel(x, tok, out, hv0, HV, HS, C: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    # program (chunk c, head j of the slice, feature block): out[c, j] = x[tokens of c, hv0 + j] (zero on padding)
    i_ch, i_d = tl.program_id(0), tl.program_id(1)
    i_c, i_j = i_ch // HS, i_ch % HS
    o_s = tl.arange(0, C)
    o_d = i_d * BD + tl.arange(0, BD)
    b_tok = tl.load(tok + i_c.to(tl.int64) * C + o_s)
    m_s = b_tok >= 0
    m_d = o_d < D
    b_x = tl.load(x + (tl.where(m_s, b_tok, 0)[:, None] * HV + hv0 + i_j) * D + o_d[None, :],
                  mask=m_s[:, None] & m_d[None, :], other=0.0)
    tl.store(out + (i_ch.to(tl.int64) * C + o_s[:, None]) * D + o_d[None, :], b_x.to(out.dtype.element_ty),
             mask=m_d[None, :])


def head_slice_to_chunks(x: torch.Tensor, layout: ChunkLayout, tok: torch.Tensor, hv0: int, hv1: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """``to_chunks(x[:, :, hv0:hv1], layout, dtype)`` in one Triton pass.

    Args:
        x: ``[B, T, HV, D]`` (``[1, T, HV, D]`` for varlen layouts), any float dtype; made contiguous if it is not.
        layout: the chunked layout of ``x``'s tokens (`flashkda.bwd.layout.make_layout`).
        tok: ``flashkda.bwd.prologue.slot_tokens(layout)``: the flattened token of every chunk slot, -1 on
            padding.
        hv0, hv1: the head slice, ``0 <= hv0 < hv1 <= HV``.
        dtype: dtype of the result (the conversion happens in the copy).

    Returns:
        ``[NC, hv1 - hv0, C, D]`` contiguous, zero on the padding slots of each sequence's last chunk.
    """
    HV, D = x.shape[2], x.shape[3]
    if not 0 <= hv0 < hv1 <= HV:
        raise ValueError(f"head slice {hv0}:{hv1} is outside 0:{HV}")
    x = x.contiguous()
    HS, C, NC = hv1 - hv0, layout.C, layout.num_chunks
    out = torch.empty(NC, HS, C, D, dtype=dtype, device=x.device)
    if NC and D:
        BD = min(128, triton.next_power_of_2(D))
        head_slice_to_chunks_kernel[(NC * HS, triton.cdiv(D, BD))](x, tok, out, hv0, HV, HS, C=C, D=D, BD=BD,
                                                                   num_warps=4)
    return out
