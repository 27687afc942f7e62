"""Inter-chunk state recurrences of the training backward on the chunked layout: the state recompute (``h``,
``v_new``) and the reverse gradient pass (``dh``, ``dv_new``, ``dh0``).

Both work on the chunked layout of ``flashkda.bwd.layout``: every tensor is ``[NC, HV, C, D]`` (chunk, value
head, position in chunk, feature), sequence ``n`` owns chunks ``chunk_offsets[n] .. chunk_offsets[n + 1]``, and the
chunk-local quantities come from the backward prologue or ``flashkda.bwd.local.chunk_local_prepare``:

* ``qg = scale * q * exp(G)``, ``w = T (k * exp(G))``, ``u = T v`` with ``T = (I + L)^-1 Diag(beta)``,
* ``Aqk`` (lower triangular, scale folded in), ``kend = k * exp(G_C - G)``, ``dec = exp(G_C)``,

where ``G`` is the in-chunk cumulative sum of the log-space gate. Per chunk (``S`` is the ``[K, V]`` state at the
chunk start)::

    v_new = u - w S
    S'    = Diag(dec) S + kend^T v_new

The reverse pass walks the chunks backwards with ``dS`` (gradient of the loss w.r.t. the state at the chunk end)::

    dv_new = Aqk^T do + kend dS
    dS    <- Diag(dec) dS + qg^T do - w^T dv_new

One program owns one (sequence, value head, V-block) and keeps its fp32 state in registers for the whole sequence
as up to four ``[BKB, BV]`` tiles of 64 rows (K <= 256). Operands needed transposed are loaded as ``[BKB, C]``
tiles straight from memory, and every load depends on the chunk index only, so the software pipeliner can prefetch
the next chunk's tiles (2 stages up to K = 128).

The forward's state pass (``flashkda.fwd.state.state_pass``) is the same recurrence on the token layout ``[B, T, HV,
D]`` with the gate as per-chunk sums; this one reads the per-slice chunked copies the backward prologue writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashkda.rounding import PREC_BF16, PREC_IEEE, cast_for_store, dot_acc, operand_split

__all__ = ["chunk_kda_bwd_dh", "chunk_kda_recompute_h", "state_launch", "store_state_tiles"]


@triton.jit
def _dot(b_a, b_x, b_acc, PREC: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ x`` for fp32 ``a``, ``x`` and ``acc``, the operands at ``PREC`` (``flashkda.fwd.state``'s
    ``PREC_*``): 0 exact, 1 tf32, 2 bf16 ``a`` times the bf16 hi/lo split of ``x``, 3 both rounded to bf16; the
    `flashkda.rounding.operand_split` and `flashkda.rounding.dot_acc` (bf16 held as fp32 and rounded to nearest on the
    interpreter)."""
    b_hi, b_lo = operand_split(b_x, PREC, EMULATE)
    return dot_acc(b_a, b_hi, b_lo, b_acc, PREC, EMULATE)


@triton.jit
def _ck(p, o_c, o_k, K: tl.constexpr):
    """``[C, BKB]`` fp32 tile (columns ``o_k``) of the ``[C, K]`` chunk operand at ``p``."""
    return tl.load(p + o_c[:, None] * K + o_k[None, :]).to(tl.float32)


@triton.jit
def _kc(p, o_c, o_k, K: tl.constexpr):
    """The same tile transposed, ``[BKB, C]``, read as such from memory (no transpose in registers)."""
    return tl.load(p + o_k[:, None] + o_c[None, :] * K).to(tl.float32)


@triton.jit
def _state_tile(p, m, BKB: tl.constexpr, BV: tl.constexpr, LOAD: tl.constexpr):
    """``[BKB, BV]`` fp32 state tile read at ``p`` (masked by ``m``), or zeros without ``LOAD``."""
    b = tl.zeros([BKB, BV], dtype=tl.float32)
    if LOAD:
        b += tl.load(p, mask=m, other=0.0).to(tl.float32)
    return b


@triton.jit
def _tile_offsets(i_v, V: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr):
    """Offsets of a program's state tiles: ``o_v`` ``[BV]`` (its V block), the row offsets ``o_k1`` .. ``o_k4``
    ``[BKB]`` of tiles 1..4, and the offsets ``o_s`` and mask ``m_s`` ``[BKB, BV]`` of tile 1 in one head's
    ``[K, V]`` state (tile j sits at ``o_s + (j - 1) BKB V``)."""
    o_v = i_v * BV + tl.arange(0, BV)
    o_k1 = tl.arange(0, BKB)
    o_s = o_k1[:, None] * V + o_v[None, :]
    m_s = (o_k1[:, None] < BKB) & (o_v < V)[None, :]
    return o_v, o_k1, BKB + o_k1, 2 * BKB + o_k1, 3 * BKB + o_k1, o_s, m_s


@triton.jit
def _state_tiles(p, m, V: tl.constexpr, BKB: tl.constexpr, BV: tl.constexpr, NKB: tl.constexpr, LOAD: tl.constexpr):
    """Tiles 1..4 (``[BKB, BV]`` fp32) of the state at ``p`` (tile j at ``p + (j - 1) BKB V``, masked by ``m``);
    zeros without ``LOAD`` and past ``NKB`` (where the kernels never read them)."""
    return (_state_tile(p, m, BKB, BV, LOAD), _state_tile(p + BKB * V, m, BKB, BV, LOAD and NKB > 1),
            _state_tile(p + 2 * BKB * V, m, BKB, BV, LOAD and NKB > 2),
            _state_tile(p + 3 * BKB * V, m, BKB, BV, LOAD and NKB > 3))


@triton.jit
def store_state_tiles(p, b_1, b_2, b_3, b_4, m, V: tl.constexpr, BKB: tl.constexpr, NKB: tl.constexpr):
    """Stores the first ``NKB`` tiles where `_state_tiles` reads them, cast to ``p``'s dtype (`cast_for_store`)."""
    tl.store(p, cast_for_store(b_1, p.dtype.element_ty), mask=m)
    if NKB > 1:
        tl.store(p + BKB * V, cast_for_store(b_2, p.dtype.element_ty), mask=m)
    if NKB > 2:
        tl.store(p + 2 * BKB * V, cast_for_store(b_3, p.dtype.element_ty), mask=m)
    if NKB > 3:
        tl.store(p + 3 * BKB * V, cast_for_store(b_4, p.dtype.element_ty), mask=m)


@triton.jit
def _program(chunk_offsets, HV: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
             BKB: tl.constexpr):
    """This program's (sequence, value head, V block) of a chunked state pass: the head ``i_h``, the sequence's
    chunk range ``[c_start, c_end)``, the offset ``i_s`` of its ``[K, V]`` state, the chunk rows ``o_c`` and the
    ``[C, BV]`` mask ``m_cv``, then `_tile_offsets`."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c_start = tl.load(chunk_offsets + i_n).to(tl.int64)
    c_end = tl.load(chunk_offsets + i_n + 1).to(tl.int64)
    o_c = tl.arange(0, C)
    o_v, o_k1, o_k2, o_k3, o_k4, o_s, m_s = _tile_offsets(i_v, V, BV, BKB)
    m_cv = (o_c[:, None] < C) & (o_v < V)[None, :]
    i_s = (i_n * HV + i_h).to(tl.int64) * K * V
    return i_h, c_start, c_end, i_s, o_c, m_cv, o_v, o_k1, o_k2, o_k3, o_k4, o_s, m_s


@triton.jit
def chunk_kda_recompute_kernel_h(
    w,
    u,
    kend,
    dec,
    h0,
    h,
    v_new,
    ht,
    chunk_offsets,
    HV: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    BKB: tl.constexpr,
    NKB: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_H: tl.constexpr,
    STORE_HT: tl.constexpr,
    PREC_WS: tl.constexpr,
    PREC_KV: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """State recompute with the state as ``NKB`` ``[BKB, BV]`` tiles (``b_h1`` .. ``b_h4``): ``w S`` is a sum of one
    product per tile, the state update one product per tile with ``kend`` read transposed. ``PREC_*``: operand
    precision (see ``_dot``) of ``w S`` and ``kend^T v_new``."""
    tl.static_assert(NKB * BKB == K and NKB <= 4)
    i_h, c_start, c_end, i_s, o_c, m_cv, o_v, o_k1, o_k2, o_k3, o_k4, o_s, m_s = _program(chunk_offsets, HV, C, K, V,
                                                                                          BV, BKB)
    # [BKB, BV] x NKB
    b_h1, b_h2, b_h3, b_h4 = _state_tiles(h0 + i_s + o_s, m_s, V, BKB, BV, NKB, USE_H0)
    for i_c in range(c_start, c_end):
        i_ch = i_c * HV + i_h
        w_c, ke_c, d_c = w + i_ch * C * K, kend + i_ch * C * K, dec + i_ch * K
        o_cv = i_ch * C * V + o_c[:, None] * V + o_v[None, :]
        if STORE_H:
            store_state_tiles(h + i_ch * K * V + o_s, b_h1, b_h2, b_h3, b_h4, m_s, V, BKB, NKB)
        # [C, BV]
        b_ws = _dot(_ck(w_c, o_c, o_k1, K), b_h1, tl.zeros([C, BV], dtype=tl.float32), PREC_WS, EMULATE)
        if NKB > 1:
            b_ws = _dot(_ck(w_c, o_c, o_k2, K), b_h2, b_ws, PREC_WS, EMULATE)
        if NKB > 2:
            b_ws = _dot(_ck(w_c, o_c, o_k3, K), b_h3, b_ws, PREC_WS, EMULATE)
        if NKB > 3:
            b_ws = _dot(_ck(w_c, o_c, o_k4, K), b_h4, b_ws, PREC_WS, EMULATE)
        b_vn = tl.load(u + o_cv, mask=m_cv, other=0.0).to(tl.float32) - b_ws
        tl.store(v_new + o_cv, b_vn.to(v_new.dtype.element_ty), mask=m_cv)
        # [BKB, BV] x NKB
        b_h1 = _dot(_kc(ke_c, o_c, o_k1, K), b_vn, b_h1 * tl.load(d_c + o_k1)[:, None], PREC_KV, EMULATE)
        if NKB > 1:
            b_h2 = _dot(_kc(ke_c, o_c, o_k2, K), b_vn, b_h2 * tl.load(d_c + o_k2)[:, None], PREC_KV, EMULATE)
        if NKB > 2:
            b_h3 = _dot(_kc(ke_c, o_c, o_k3, K), b_vn, b_h3 * tl.load(d_c + o_k3)[:, None], PREC_KV, EMULATE)
        if NKB > 3:
            b_h4 = _dot(_kc(ke_c, o_c, o_k4, K), b_vn, b_h4 * tl.load(d_c + o_k4)[:, None], PREC_KV, EMULATE)
    if STORE_HT:
        store_state_tiles(ht + i_s + o_s, b_h1, b_h2, b_h3, b_h4, m_s, V, BKB, NKB)


@triton.jit
def chunk_kda_bwd_kernel_dh(
    qg,
    aqk,
    kend,
    dec,
    w,
    do,
    dht,
    dhe,
    dv_new,
    dh0,
    chunk_offsets,
    HV: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    BKB: tl.constexpr,
    NKB: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    PREC_AD: tl.constexpr,
    PREC_KD: tl.constexpr,
    PREC_QD: tl.constexpr,
    PREC_WD: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Reverse state pass with ``dS`` as ``NKB`` ``[BKB, BV]`` tiles (``b_dh1`` .. ``b_dh4``): ``kend dS``
    is a sum of one product per tile, the update of each tile reads ``qg`` and ``w`` transposed, and ``Aqk^T do``
    reads ``Aqk`` transposed. ``PREC_*``: operand precision (see ``_dot``) of ``Aqk^T do``, ``kend dS``, ``qg^T do``
    and ``w^T dv_new``."""
    tl.static_assert(NKB * BKB == K and NKB <= 4)
    i_h, c_start, c_end, i_s, o_c, m_cv, o_v, o_k1, o_k2, o_k3, o_k4, o_s, m_s = _program(chunk_offsets, HV, C, K, V,
                                                                                          BV, BKB)
    # [BKB, BV] x NKB: gradient w.r.t. the state at the end of the current chunk
    b_dh1, b_dh2, b_dh3, b_dh4 = _state_tiles(dht + i_s + o_s, m_s, V, BKB, BV, NKB, USE_DHT)
    for i_r in range(0, c_end - c_start):
        i_ch = (c_end - 1 - i_r) * HV + i_h
        w_c, qg_c, ke_c, d_c = w + i_ch * C * K, qg + i_ch * C * K, kend + i_ch * C * K, dec + i_ch * K
        o_cv = i_ch * C * V + o_c[:, None] * V + o_v[None, :]
        store_state_tiles(dhe + i_ch * K * V + o_s, b_dh1, b_dh2, b_dh3, b_dh4, m_s, V, BKB, NKB)
        # [C, BV], [C, C] (Aqk^T)
        b_do = tl.load(do + o_cv, mask=m_cv, other=0.0).to(tl.float32)
        b_at = tl.load(aqk + i_ch * C * C + o_c[:, None] + o_c[None, :] * C).to(tl.float32)
        b_dvn = _dot(b_at, b_do, tl.zeros([C, BV], dtype=tl.float32), PREC_AD, EMULATE)
        b_dvn = _dot(_ck(ke_c, o_c, o_k1, K), b_dh1, b_dvn, PREC_KD, EMULATE)
        if NKB > 1:
            b_dvn = _dot(_ck(ke_c, o_c, o_k2, K), b_dh2, b_dvn, PREC_KD, EMULATE)
        if NKB > 2:
            b_dvn = _dot(_ck(ke_c, o_c, o_k3, K), b_dh3, b_dvn, PREC_KD, EMULATE)
        if NKB > 3:
            b_dvn = _dot(_ck(ke_c, o_c, o_k4, K), b_dh4, b_dvn, PREC_KD, EMULATE)
        tl.store(dv_new + o_cv, b_dvn.to(dv_new.dtype.element_ty), mask=m_cv)
        # w^T dv_new enters negated; bf16 rounding is symmetric, so this is exact
        b_ndvn = -b_dvn
        # [BKB, BV] x NKB
        b_dh1 = _dot(_kc(qg_c, o_c, o_k1, K), b_do, b_dh1 * tl.load(d_c + o_k1)[:, None], PREC_QD, EMULATE)
        b_dh1 = _dot(_kc(w_c, o_c, o_k1, K), b_ndvn, b_dh1, PREC_WD, EMULATE)
        if NKB > 1:
            b_dh2 = _dot(_kc(qg_c, o_c, o_k2, K), b_do, b_dh2 * tl.load(d_c + o_k2)[:, None], PREC_QD, EMULATE)
            b_dh2 = _dot(_kc(w_c, o_c, o_k2, K), b_ndvn, b_dh2, PREC_WD, EMULATE)
        if NKB > 2:
            b_dh3 = _dot(_kc(qg_c, o_c, o_k3, K), b_do, b_dh3 * tl.load(d_c + o_k3)[:, None], PREC_QD, EMULATE)
            b_dh3 = _dot(_kc(w_c, o_c, o_k3, K), b_ndvn, b_dh3, PREC_WD, EMULATE)
        if NKB > 3:
            b_dh4 = _dot(_kc(qg_c, o_c, o_k4, K), b_do, b_dh4 * tl.load(d_c + o_k4)[:, None], PREC_QD, EMULATE)
            b_dh4 = _dot(_kc(w_c, o_c, o_k4, K), b_ndvn, b_dh4, PREC_WD, EMULATE)
    if STORE_DH0:
        store_state_tiles(dh0 + i_s + o_s, b_dh1, b_dh2, b_dh3, b_dh4, m_s, V, BKB, NKB)


# Operand precision of every product per caller precision: "tf32" marks a bf16/fp16 caller, whose state-pass
# products take bf16 operands with fp32 accumulation; "ieee" exact fp32 products.
_PRECS = {"tf32": PREC_BF16, "ieee": PREC_IEEE}


@dataclass(frozen=True)
class _Launch:
    """Launch configuration of one state pass."""

    BV: int
    num_warps: int
    num_stages: int


def state_launch(K: int, V: int, programs_per_head: int) -> tuple[int, int, int]:
    """``(V block, warps, pipeline stages)`` of a state pass: the widest V block up to 64 that still gives 128
    programs (about one per SM), 4 warps and 2 stages (K = 256: 8 warps, one stage). Forced, not autotuned:
    autotuning inside training steps costs too much (measurements: docs/flashkda-performance.md)."""
    BV = min(64, max(16, triton.next_power_of_2(V)))
    while BV > 16 and programs_per_head * triton.cdiv(V, BV) < 128:
        BV //= 2
    if K > 128:
        return BV, 8, 1
    return BV, 4, 2


def _launch(K: int, V: int, programs_per_head: int, dot_precision: str, block_v: int | None,
            num_warps: int | None, num_stages: int | None) -> _Launch:
    if K > 256:
        raise ValueError(f"K: the state passes hold K <= 256 (four 64-row tiles), got K={K}")
    if dot_precision not in _PRECS:
        raise ValueError(f"dot_precision: the state passes take 'ieee' or 'tf32', got {dot_precision!r}")
    if block_v is not None and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    BV, warps, stages = state_launch(K, V, programs_per_head)
    return _Launch(
        BV if block_v is None else block_v,
        warps if num_warps is None else num_warps,
        stages if num_stages is None else num_stages,
    )


def _blocked_meta(K: int, dot_precision: str, names: tuple[str, ...], device: torch.device) -> dict:
    BKB = min(64, max(16, triton.next_power_of_2(K)))
    meta = dict(BKB=BKB, NKB=triton.cdiv(K, BKB), EMULATE=device.type != "cuda")
    meta.update({name: _PRECS[dot_precision] for name in names})
    return meta


def chunk_kda_recompute_h(
    w: torch.Tensor,
    u: torch.Tensor,
    kend: torch.Tensor,
    dec: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_offsets: torch.Tensor,
    *,
    store_h: bool,
    store_final_state: bool,
    dot_precision: str = "ieee",
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """State recompute: ``(final_state [N, HV, K, V] or None, h [NC, HV, K, V] or None, v_new [NC, HV, C, V])``.

    ``w``, ``kend`` ``[NC, HV, C, K]``, ``u`` ``[NC, HV, C, V]``, ``dec`` ``[NC, HV, K]`` (contiguous, one float
    dtype; outputs in it); ``block_v``, ``num_warps`` and ``num_stages`` force the launch (None: `_launch`'s)."""
    assert all(x.is_contiguous() for x in (w, u, kend, dec)), "chunked inputs must be contiguous"
    NC, HV, C, K = w.shape
    V = u.shape[-1]
    N = chunk_offsets.numel() - 1
    cfg = _launch(K, V, N * HV, dot_precision, block_v, num_warps, num_stages)
    v_new = torch.empty_like(u)
    h = w.new_empty(NC, HV, K, V) if store_h else None
    ht = w.new_empty(N, HV, K, V) if store_final_state else None
    dummy = v_new
    grid = (N, HV, triton.cdiv(V, cfg.BV))
    chunk_kda_recompute_kernel_h[grid](
        w, u, kend, dec, initial_state if initial_state is not None else dummy, h if h is not None else dummy,
        v_new, ht if ht is not None else dummy, chunk_offsets,
        HV=HV, C=C, K=K, V=V, BV=cfg.BV, USE_H0=initial_state is not None, STORE_H=store_h,
        STORE_HT=store_final_state, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_blocked_meta(K, dot_precision, ("PREC_WS", "PREC_KV"), w.device),
    )
    return ht, h, v_new


def chunk_kda_bwd_dh(
    qg: torch.Tensor,
    aqk: torch.Tensor,
    kend: torch.Tensor,
    dec: torch.Tensor,
    w: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    chunk_offsets: torch.Tensor,
    *,
    store_dh0: bool,
    dot_precision: str = "ieee",
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reverse state pass: ``(dv_new [NC, HV, C, V], dh at every chunk end [NC, HV, K, V], dh0 or None)``;
    ``aqk`` ``[NC, HV, C, C]``, ``do`` ``[NC, HV, C, V]``, the rest as in `chunk_kda_recompute_h`."""
    assert all(x.is_contiguous() for x in (qg, aqk, kend, dec, w, do)), "chunked inputs must be contiguous"
    NC, HV, C, K = w.shape
    V = do.shape[-1]
    N = chunk_offsets.numel() - 1
    cfg = _launch(K, V, N * HV, dot_precision, block_v, num_warps, num_stages)
    dv_new = torch.empty_like(do, dtype=w.dtype)
    dhe = w.new_empty(NC, HV, K, V)
    dh0 = w.new_empty(N, HV, K, V) if store_dh0 else None
    grid = (N, HV, triton.cdiv(V, cfg.BV))
    chunk_kda_bwd_kernel_dh[grid](
        qg, aqk, kend, dec, w, do, dht if dht is not None else dv_new, dhe, dv_new,
        dh0 if dh0 is not None else dv_new, chunk_offsets,
        HV=HV, C=C, K=K, V=V, BV=cfg.BV, USE_DHT=dht is not None, STORE_DH0=store_dh0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_blocked_meta(K, dot_precision, ("PREC_AD", "PREC_KD", "PREC_QD", "PREC_WD"), w.device),
    )
    return dv_new, dhe, dh0
