"""The training backward's reverse state pass over all value heads at once, on the forward's own tensors.

The per-slice pass (``flashkda.bwd.state.chunk_kda_bwd_dh``) reads fp32 chunked copies that the backward prologue
writes for one head slice at a time, so it runs once per slice with half (or a quarter) of the programs a launch
over all heads would have: each program walks its whole sequence, so the passes take about as long per slice as
one pass over all heads would.

For bf16 input the forward intra kernel already writes every operand of the pass for all heads, in the token layout
``[B, T, HV, D]`` and bf16 (see ``flashkda.fwd.intra``): ``qg = scale q e^Γ``, ``kg = k e^{Γ_C - Γ}`` (the
backward's ``kend``), ``w`` and ``Γ_C`` per chunk, and with ``store_local`` the chunk-local ``Aqk`` (zero above the
diagonal) in the slices' layout ``[slices, NC, HS, C, C]``. The training forward keeps them with
``disable_recompute`` (or `flashkda.bwd.recompute` rebuilds them) and this pass runs once, before the head slices,
writing ``dv_new`` (token layout, bf16 as fla stores it), the state gradient at every chunk end ``dhe`` (``[HV / HS,
NC, HS, K, V]``: head slice by head slice like ``Aqk``, so each slice of the backward reads its part in place,
without a copy) and ``dh0``. ``dhe`` stays fp32: in bf16 it costs ``dA_log``/``dt_bias`` (sums of ``dG`` over every
token) the 1e-2 bound (docs/flashkda-performance.md). Per chunk, walking back with ``dS`` (gradient of the state at
the chunk end)::

    dv_new = Aqk^T do + kend dS
    dS    <- Diag(e^{Γ_C}) dS + qg^T do - w^T dv_new

Traffic per (chunk, head), K = V = 128: reads qg, kg, w, do (4 x 16 KiB) and Aqk (8 KiB), writes dv_new (16 KiB) and
dhe (64 KiB). The chain of chunks is serial, so the pass is
latency-bound (one program per sequence, head and V block, as the forward's blocked state pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkda.bwd.state import _dot, _state_tiles, _tile_offsets, state_launch, store_state_tiles
from flashkda.fwd.intra import CHUNK_SIZE
from flashkda.fwd.state import _seq_span
from flashkda.index import ChunkIndex
from flashkda.rounding import PREC_BF16, cast_for_store

__all__ = ["chunk_kda_bwd_dh_tokens"]


@triton.jit
def _rows(p, o_t, m_t, o_k, HV: tl.constexpr, K: tl.constexpr):
    """``[BT, BKB]`` fp32 tile (rows ``o_t`` of one head, columns ``o_k``) of a token-layout ``[T, HV, K]`` operand
    at ``p``; rows past the sequence end are zero."""
    return tl.load(p + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)


@triton.jit
def _rows_t(p, o_t, m_t, o_k, HV: tl.constexpr, K: tl.constexpr):
    """The same tile transposed, ``[BKB, BT]``, read as such from memory."""
    return tl.load(p + o_t[None, :] * (HV * K) + o_k[:, None], mask=m_t[None, :], other=0.0).to(tl.float32)


@triton.jit
def _tile_update(b_dh, qg_h, w_h, gC_t, b_do, b_ndvn, o_t, m_t, o_k, HV: tl.constexpr, K: tl.constexpr,
                 PREC: tl.constexpr, EMULATE: tl.constexpr):
    """``Diag(e^{Γ_C}) dS + qg^T do - w^T dv_new`` on the state rows ``o_k`` (``dv_new`` given negated)."""
    b_acc = b_dh * tl.exp(tl.load(gC_t + o_k).to(tl.float32))[:, None]
    b_acc = _dot(_rows_t(qg_h, o_t, m_t, o_k, HV, K), b_do, b_acc, PREC, EMULATE)
    return _dot(_rows_t(w_h, o_t, m_t, o_k, HV, K), b_ndvn, b_acc, PREC, EMULATE)


@triton.jit(do_not_specialize=["T"])
def chunk_kda_bwd_kernel_dh_tokens(
    qg, kg, w, gC, aqk, do, dht, dhe, dv_new, dh0, cu_seqlens, chunk_offsets,
    T, NTS, NCL, NCD,
    HV: tl.constexpr, HS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKB: tl.constexpr,
    NKB: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, EMULATE: tl.constexpr,
):
    """One program per (V block, sequence, value head); ``dS`` as ``NKB`` ``[BKB, BV]`` fp32 tiles (``b_dh1`` ..
    ``b_dh4``). ``aqk`` is ``[HV / HS, NCL, HS, BT, BT]`` and ``dhe`` ``[HV / HS, NCD, HS, K, V]`` (head ``i_hv`` in
    slice ``i_hv // HS``)."""
    tl.static_assert(NKB * BKB == K and NKB <= 4)
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0 = _seq_span(i_n, cu_seqlens, chunk_offsets, T, NTS, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    Tn = (eos - bos).to(tl.int32)
    o_c = tl.arange(0, BT)
    o_v, o_k1, o_k2, o_k3, o_k4, o_s, m_s = _tile_offsets(i_v, V, BV, BKB)
    m_v = o_v < V
    i_s = (i_n.to(tl.int64) * HV + i_hv) * K * V
    # [BKB, BV] x NKB: gradient w.r.t. the state at the end of the current chunk
    b_dh1, b_dh2, b_dh3, b_dh4 = _state_tiles(dht + i_s + o_s, m_s, V, BKB, BV, NKB, USE_DHT)

    qg_h = qg + (bos * HV + i_hv) * K
    kg_h = kg + (bos * HV + i_hv) * K
    w_h = w + (bos * HV + i_hv) * K
    do_h = do + (bos * HV + i_hv) * V
    dvn_h = dv_new + (bos * HV + i_hv) * V
    # dhe is [HV / HS, NC, HS, K, V] like aqk (NC = NCD chunks): each head slice of the backward is one contiguous block
    dhe_h = dhe + (((i_hv // HS) * NCD + c0) * HS + i_hv % HS) * K * V
    gC_h = gC + (c0 * HV + i_hv) * K
    a_h = aqk + (((i_hv // HS) * NCL + c0) * HS + i_hv % HS) * BT * BT
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        o_t = i_t * BT + o_c
        m_t = o_t < Tn
        m_tv = m_t[:, None] & m_v[None, :]
        store_state_tiles(dhe_h + i_t * (HS * K * V) + o_s, b_dh1, b_dh2, b_dh3, b_dh4, m_s, V, BKB, NKB)
        # [BT, BV]; [BT, BT] = Aqk^T (columns past the sequence end masked: padding rows of Aqk are not relied on)
        b_do = tl.load(do_h + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        a_t = a_h + i_t * (HS * BT * BT)
        b_at = tl.load(a_t + o_c[:, None] + o_c[None, :] * BT, mask=m_t[None, :], other=0.0).to(tl.float32)
        b_dvn = _dot(b_at, b_do, tl.zeros([BT, BV], dtype=tl.float32), PREC, EMULATE)
        b_dvn = _dot(_rows(kg_h, o_t, m_t, o_k1, HV, K), b_dh1, b_dvn, PREC, EMULATE)
        if NKB > 1:
            b_dvn = _dot(_rows(kg_h, o_t, m_t, o_k2, HV, K), b_dh2, b_dvn, PREC, EMULATE)
        if NKB > 2:
            b_dvn = _dot(_rows(kg_h, o_t, m_t, o_k3, HV, K), b_dh3, b_dvn, PREC, EMULATE)
        if NKB > 3:
            b_dvn = _dot(_rows(kg_h, o_t, m_t, o_k4, HV, K), b_dh4, b_dvn, PREC, EMULATE)
        tl.store(dvn_h + o_t[:, None] * (HV * V) + o_v[None, :], cast_for_store(b_dvn, dv_new.dtype.element_ty),
                 mask=m_tv)
        # w^T dv_new enters negated; bf16 rounding is symmetric, so this is exact
        b_ndvn = -b_dvn
        gC_t = gC_h + i_t * (HV * K)
        b_dh1 = _tile_update(b_dh1, qg_h, w_h, gC_t, b_do, b_ndvn, o_t, m_t, o_k1, HV, K, PREC, EMULATE)
        if NKB > 1:
            b_dh2 = _tile_update(b_dh2, qg_h, w_h, gC_t, b_do, b_ndvn, o_t, m_t, o_k2, HV, K, PREC, EMULATE)
        if NKB > 2:
            b_dh3 = _tile_update(b_dh3, qg_h, w_h, gC_t, b_do, b_ndvn, o_t, m_t, o_k3, HV, K, PREC, EMULATE)
        if NKB > 3:
            b_dh4 = _tile_update(b_dh4, qg_h, w_h, gC_t, b_do, b_ndvn, o_t, m_t, o_k4, HV, K, PREC, EMULATE)
    if STORE_DH0:
        store_state_tiles(dh0 + i_s + o_s, b_dh1, b_dh2, b_dh3, b_dh4, m_s, V, BKB, NKB)


def chunk_kda_bwd_dh_tokens(
    qg: torch.Tensor,
    kg: torch.Tensor,
    w: torch.Tensor,
    gC: torch.Tensor,
    aqk: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    index: ChunkIndex,
    *,
    store_dh0: bool,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reverse state pass over all value heads (bf16 operands, fp32 accumulation and state gradient).

    Args:
        qg, kg, w: ``[B, T, HV, K]`` bf16, as the forward intra kernel writes them (``kg = k e^{Γ_C - Γ}``).
        gC: ``[NC, HV, K]`` fp32 ``Γ_C`` per chunk (``NC = index.num_chunks``).
        aqk: ``[HV / HS, NC', HS, 64, 64]`` the intra kernel's saved ``Aqk`` (``store_local``; zero above the
            diagonal, ``NC' >= NC``), any float dtype.
        do: ``[B, T, HV, V]`` gradient of the output (bf16 or fp32).
        dht: ``[N, HV, K, V]`` fp32 gradient of the final state, or None.
        index: the forward's ``ChunkIndex`` (``flashkda.index.build_chunk_index`` with chunk size 64).
        store_dh0: also return the gradient of the initial state.
        block_v, num_warps, num_stages: force the launch (None: `flashkda.bwd.state.state_launch`).

    Returns:
        ``(dv_new [B, T, HV, V] bf16, dhe [HV / HS, NC, HS, K, V] fp32, dh0 [N, HV, K, V] fp32 or None)`` with
        ``HS = aqk.shape[2]``; ``dhe[s, c, j]`` is the gradient of the state of head ``s * HS + j`` at the end of
        chunk ``c``.
    """
    B, T, HV, K = qg.shape
    V = do.shape[-1]
    N, NC = index.num_seqs, index.num_chunks
    if K > 256 or K < 16 or K & (K - 1):
        raise ValueError(f"the all-heads reverse state pass holds K in 16 .. 256 (a power of two), got K={K}")
    if aqk.dim() != 5 or aqk.shape[-1] != CHUNK_SIZE or HV % aqk.shape[2] or aqk.shape[0] * aqk.shape[2] != HV:
        raise ValueError(f"aqk must be [HV / HS, NC, HS, {CHUNK_SIZE}, {CHUNK_SIZE}] for HV={HV}, got "
                         f"{tuple(aqk.shape)}")
    assert all(x.is_contiguous() for x in (qg, kg, w, gC, aqk, do)), "operands must be contiguous"
    dv_new = torch.empty(B, T, HV, V, dtype=torch.bfloat16, device=qg.device)
    dhe = torch.empty(HV // aqk.shape[2], NC, aqk.shape[2], K, V, dtype=torch.float32, device=qg.device)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=qg.device) if store_dh0 else None
    if N == 0:
        return dv_new, dhe, dh0
    BV, warps, stages = state_launch(K, V, N * HV)
    BV = block_v or BV
    BKB = min(64, K)
    chunk_kda_bwd_kernel_dh_tokens[(triton.cdiv(V, BV), N, HV)](
        qg, kg, w, gC, aqk, do, dht if dht is not None else dh0 if dh0 is not None else dhe, dhe, dv_new,
        dh0 if dh0 is not None else dhe, index.cu_seqlens, index.chunk_offsets,
        T, index.chunks_per_seq, aqk.shape[1], NC,
        HV=HV, HS=aqk.shape[2], K=K, V=V, BT=CHUNK_SIZE, BKB=BKB, NKB=K // BKB, BV=BV,
        USE_DHT=dht is not None, STORE_DH0=store_dh0, IS_VARLEN=index.is_varlen, PREC=PREC_BF16,
        EMULATE=not qg.is_cuda, num_warps=num_warps or warps, num_stages=num_stages or stages,
    )
    return dv_new, dhe, dh0
