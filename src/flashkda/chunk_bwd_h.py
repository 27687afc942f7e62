"""Inter-chunk state recurrences for training: the forward state pass (``h``, ``v_new``, ``o``) and the reverse
gradient pass (``dh``, ``dv_new``, ``dh0``).

Both work on the chunked layout of ``flashkda.chunk_bwd_layout``: every tensor is ``[NC, HV, C, D]`` (chunk, value
head, position in chunk, feature), sequence ``n`` owns chunks ``chunk_offsets[n] .. chunk_offsets[n + 1]``, and the
chunk-local quantities come from ``flashkda.chunk_bwd_local.chunk_local_prepare``:

* ``qg = scale * q * exp(G)``, ``w = T (k * exp(G))``, ``u = T v`` with ``T = (I + L)^-1 Diag(beta)``,
* ``Aqk`` (lower triangular, scale folded in), ``kend = k * exp(G_C - G)``, ``dec = exp(G_C)``,

where ``G`` is the in-chunk cumulative sum of the log-space gate. Per chunk (``S`` is the ``[K, V]`` state at the
chunk start)::

    v_new = u - w S
    o     = qg S + Aqk v_new
    S'    = Diag(dec) S + kend^T v_new

The reverse pass walks the chunks backwards with ``dS`` (gradient of the loss w.r.t. the state at the chunk end)::

    dv_new = Aqk^T do + kend dS
    dS    <- Diag(dec) dS + qg^T do - w^T dv_new

One program owns one (sequence, value head, V-block) and keeps its ``[K, BV]`` fp32 state in registers for the
whole sequence, so the state never round-trips through HBM except where it is stored for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_kda_bwd_dh", "chunk_kda_fwd_h"]


@triton.jit
def chunk_kda_fwd_kernel_h(
    w,
    u,
    qg,
    aqk,
    kend,
    dec,
    h0,
    h,
    v_new,
    o,
    ht,
    chunk_offsets,
    HV: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_H: tl.constexpr,
    STORE_O: tl.constexpr,
    STORE_HT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DT: tl.constexpr,
):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c_start = tl.load(chunk_offsets + i_n).to(tl.int64)
    c_end = tl.load(chunk_offsets + i_n + 1).to(tl.int64)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = (o_k[:, None] < K) & m_v[None, :]
    m_cv = (o_c[:, None] < C) & m_v[None, :]
    # [K, BV]
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        p_h0 = h0 + (i_n * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(p_h0, mask=m_kv, other=0.0).to(tl.float32)
    for i_c in range(c_start, c_end):
        i_ch = i_c * HV + i_h
        if STORE_H:
            p_h = h + i_ch * K * V + o_k[:, None] * V + o_v[None, :]
            tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=m_kv)
        # [C, K]
        b_w = tl.load(w + i_ch * C * K + o_c[:, None] * K + o_k[None, :]).to(tl.float32)
        # [C, BV]
        b_u = tl.load(u + i_ch * C * V + o_c[:, None] * V + o_v[None, :], mask=m_cv, other=0.0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w.to(DT), b_h.to(DT), input_precision=DOT_PRECISION)
        tl.store(v_new + i_ch * C * V + o_c[:, None] * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty), mask=m_cv)
        if STORE_O:
            # [C, K], [C, C]
            b_q = tl.load(qg + i_ch * C * K + o_c[:, None] * K + o_k[None, :]).to(tl.float32)
            b_a = tl.load(aqk + i_ch * C * C + o_c[:, None] * C + o_c[None, :]).to(tl.float32)
            b_o = tl.dot(b_q.to(DT), b_h.to(DT), input_precision=DOT_PRECISION)
            b_o += tl.dot(b_a.to(DT), b_vn.to(DT), input_precision=DOT_PRECISION)
            tl.store(o + i_ch * C * V + o_c[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_cv)
        # [C, K], [K]
        b_ke = tl.load(kend + i_ch * C * K + o_c[:, None] * K + o_k[None, :]).to(tl.float32)
        b_d = tl.load(dec + i_ch * K + o_k).to(tl.float32)
        b_h = b_h * b_d[:, None] + tl.dot(tl.trans(b_ke.to(DT)), b_vn.to(DT), input_precision=DOT_PRECISION)
    if STORE_HT:
        p_ht = ht + (i_n * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_kv)


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
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DT: tl.constexpr,
):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c_start = tl.load(chunk_offsets + i_n).to(tl.int64)
    c_end = tl.load(chunk_offsets + i_n + 1).to(tl.int64)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = (o_k[:, None] < K) & m_v[None, :]
    m_cv = (o_c[:, None] < C) & m_v[None, :]
    # [K, BV]: gradient w.r.t. the state at the end of the current chunk
    b_dh = tl.zeros([K, BV], dtype=tl.float32)
    if USE_DHT:
        p_dht = dht + (i_n * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_dh = tl.load(p_dht, mask=m_kv, other=0.0).to(tl.float32)
    for i_r in range(0, c_end - c_start):
        i_ch = (c_end - 1 - i_r) * HV + i_h
        p_dhe = dhe + i_ch * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_dhe, b_dh.to(p_dhe.dtype.element_ty), mask=m_kv)
        # [C, BV], [C, C], [C, K]
        b_do = tl.load(do + i_ch * C * V + o_c[:, None] * V + o_v[None, :], mask=m_cv, other=0.0).to(tl.float32)
        b_a = tl.load(aqk + i_ch * C * C + o_c[:, None] * C + o_c[None, :]).to(tl.float32)
        b_ke = tl.load(kend + i_ch * C * K + o_c[:, None] * K + o_k[None, :]).to(tl.float32)
        b_dvn = tl.dot(tl.trans(b_a.to(DT)), b_do.to(DT), input_precision=DOT_PRECISION)
        b_dvn += tl.dot(b_ke.to(DT), b_dh.to(DT), input_precision=DOT_PRECISION)
        tl.store(
            dv_new + i_ch * C * V + o_c[:, None] * V + o_v[None, :], b_dvn.to(dv_new.dtype.element_ty), mask=m_cv
        )
        b_q = tl.load(qg + i_ch * C * K + o_c[:, None] * K + o_k[None, :]).to(tl.float32)
        b_w = tl.load(w + i_ch * C * K + o_c[:, None] * K + o_k[None, :]).to(tl.float32)
        b_d = tl.load(dec + i_ch * K + o_k).to(tl.float32)
        b_dh = (
            b_dh * b_d[:, None]
            + tl.dot(tl.trans(b_q.to(DT)), b_do.to(DT), input_precision=DOT_PRECISION)
            - tl.dot(tl.trans(b_w.to(DT)), b_dvn.to(DT), input_precision=DOT_PRECISION)
        )
    if STORE_DH0:
        p_dh0 = dh0 + (i_n * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_dh0, b_dh.to(p_dh0.dtype.element_ty), mask=m_kv)


def _block_v(K: int, V: int, programs_per_block: int) -> int:
    # Keep the [K, BV] fp32 state at <= 8K elements per program so it stays in registers, and split V finer when
    # (sequences x heads) alone would leave most of the GPU's ~132 SMs idle (each program walks its whole sequence).
    bv = max(16, min(triton.next_power_of_2(V), 8192 // K, 64))
    while bv > 16 and programs_per_block * triton.cdiv(V, bv) < 256:
        bv //= 2
    return bv


def _operands(dot_precision: str) -> dict:
    # "tf32" marks a bf16/fp16 caller: the state-pass products then take bf16 operands with fp32 accumulation (the
    # configuration the forward kernels run on Hopper), otherwise exact fp32 products.
    if dot_precision == "tf32":
        return dict(DOT_PRECISION="ieee", DT=tl.bfloat16)
    return dict(DOT_PRECISION=dot_precision, DT=tl.float32)


def chunk_kda_fwd_h(
    w: torch.Tensor,
    u: torch.Tensor,
    qg: torch.Tensor,
    aqk: torch.Tensor,
    kend: torch.Tensor,
    dec: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_offsets: torch.Tensor,
    *,
    store_o: bool,
    store_h: bool,
    store_final_state: bool,
    dot_precision: str = "ieee",
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    assert all(x.is_contiguous() for x in (w, u, qg, aqk, kend, dec)), "chunked inputs must be contiguous"
    NC, HV, C, K = w.shape
    V = u.shape[-1]
    N = chunk_offsets.numel() - 1
    BV = _block_v(K, V, N * HV)
    v_new = torch.empty_like(u)
    o = torch.empty_like(u) if store_o else None
    h = w.new_empty(NC, HV, K, V) if store_h else None
    ht = w.new_empty(N, HV, K, V) if store_final_state else None
    dummy = v_new
    grid = (N, HV, triton.cdiv(V, BV))
    chunk_kda_fwd_kernel_h[grid](
        w,
        u,
        qg,
        aqk,
        kend,
        dec,
        initial_state if initial_state is not None else dummy,
        h if h is not None else dummy,
        v_new,
        o if o is not None else dummy,
        ht if ht is not None else dummy,
        chunk_offsets,
        HV=HV,
        C=C,
        K=K,
        V=V,
        BV=BV,
        USE_H0=initial_state is not None,
        STORE_H=store_h,
        STORE_O=store_o,
        STORE_HT=store_final_state,
        **_operands(dot_precision),
        num_warps=4 if K <= 64 or BV <= 32 else 8,
        # The loop carries several [C, K] fp32 dot operands; software pipelining would multiply their shared-memory
        # footprint past the H200's 227 KiB (372 KiB at K = 128 with 3 stages).
        num_stages=1,
    )
    return o, ht, h, v_new


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    assert all(x.is_contiguous() for x in (qg, aqk, kend, dec, w, do)), "chunked inputs must be contiguous"
    NC, HV, C, K = w.shape
    V = do.shape[-1]
    N = chunk_offsets.numel() - 1
    BV = _block_v(K, V, N * HV)
    dv_new = torch.empty_like(do, dtype=w.dtype)  # do may be kept in its bf16/fp16 dtype (exact), dv_new not
    dhe = w.new_empty(NC, HV, K, V)
    dh0 = w.new_empty(N, HV, K, V) if store_dh0 else None
    grid = (N, HV, triton.cdiv(V, BV))
    chunk_kda_bwd_kernel_dh[grid](
        qg,
        aqk,
        kend,
        dec,
        w,
        do,
        dht if dht is not None else dv_new,
        dhe,
        dv_new,
        dh0 if dh0 is not None else dv_new,
        chunk_offsets,
        HV=HV,
        C=C,
        K=K,
        V=V,
        BV=BV,
        USE_DHT=dht is not None,
        STORE_DH0=store_dh0,
        **_operands(dot_precision),
        num_warps=4 if K <= 64 or BV <= 32 else 8,
        # The loop carries several [C, K] fp32 dot operands; software pipelining would multiply their shared-memory
        # footprint past the H200's 227 KiB (372 KiB at K = 128 with 3 stages).
        num_stages=1,
    )
    return dv_new, dhe, dh0
