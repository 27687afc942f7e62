"""Output stage of the split state path: ``o = qg h + Aqk v_new`` for every chunk in parallel, one program per
(V block, chunk, value head), from the states ``h`` at chunk starts and ``v_new`` that the state-only pass
(`flashkda.fwd.state.state_pass`) stored.
"""

import torch
import triton
import triton.language as tl

from flashkda.fwd.intra import CHUNK_SIZE, chunk_span
from flashkda.rounding import PREC_BF16, cast_for_store, dot_acc, operand_split

__all__ = ["O_CONFIGS", "state_output"]

#: bf16 operands for `operand_split`/`dot_acc` (a jit function can read only constexpr globals).
BF16_PRODUCTS = tl.constexpr(PREC_BF16)


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_kernel_o(
    qg, Aqk, h, vn, o, cu_seqlens, chunk_offsets, chunk_map,
    T, NTS,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, HILO: tl.constexpr, EMULATE: tl.constexpr,
    HALF_IN: tl.constexpr = False,
):
    """Output of every chunk in parallel, one program per (V block, chunk, head): ``o = qg h + Aqk v_new`` (h and
    v_new as stored). The products take fp32 operands at ``DOT_PREC``, or with ``HILO`` (only for ``HALF_IN``: qg,
    Aqk, v_new and h all stored bf16) one bf16 product each, on the tensor cores' 16-bit path, which takes either
    operand layout. (A hi/lo split of fp32 v_new is not offered: Triton 3.6 compiled it wrong, see
    docs/flashkda-performance.md.)"""
    tl.static_assert(HALF_IN or not HILO, "HILO products need bf16 qg, Aqk and v_new (HALF_IN)")
    i_v, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, t0, eos = chunk_span(i_c, cu_seqlens, chunk_offsets, chunk_map, T, NTS, BT, IS_VARLEN)
    if i_n < 0:
        return
    o_c = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_c < eos - t0
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    h_c = h + (i_c.to(tl.int64) * HV + i_hv) * K * V
    qg_c = qg + (t0 * HV + i_hv) * K
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(qg_c + o_c[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_h = tl.load(h_c + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        if HILO:
            b_qh, b_ql = operand_split(b_q.to(tl.float32), BF16_PRODUCTS, EMULATE)
            b_o = dot_acc(b_h, b_qh, b_ql, b_o, BF16_PRODUCTS, EMULATE, LEFT=False)
        else:
            b_o += tl.dot(b_q.to(tl.float32), b_h.to(tl.float32), input_precision=DOT_PREC)
    # only the lower triangle of Aqk was written
    b_A = tl.load(Aqk + (t0 * HV + i_hv) * BT + o_c[:, None] * (HV * BT) + o_c[None, :],
                  mask=m_t[:, None] & (o_c[:, None] >= o_c[None, :]), other=0.0)
    b_vn = tl.load(vn + (t0 * HV + i_hv) * V + o_c[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0)
    if HILO:
        b_vh, b_vl = operand_split(b_vn.to(tl.float32), BF16_PRODUCTS, EMULATE)
        b_o = dot_acc(b_A, b_vh, b_vl, b_o, BF16_PRODUCTS, EMULATE)
    else:
        b_o += tl.dot(b_A.to(tl.float32), b_vn.to(tl.float32), input_precision=DOT_PREC)
    tl.store(o + (t0 * HV + i_hv) * V + o_c[:, None] * (HV * V) + o_v[None, :],
             cast_for_store(b_o, o.dtype.element_ty), mask=m_tv)


#: Output-kernel configurations (V tile, K slice, warps).
O_CONFIGS = [(64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 64, 4), (64, 128, 4), (32, 64, 4)]
chunk_kda_fwd_kernel_o_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv, "BK": bk}, num_warps=nw, num_stages=2) for bv, bk, nw in O_CONFIGS],
    key=["HV", "K", "V", "IS_VARLEN", "DOT_PREC", "HILO"],
)(chunk_kda_fwd_kernel_o)
#: With every operand stored bf16 the autotuner also picks between tf32 and bf16 products (both exact on bf16 values).
chunk_kda_fwd_kernel_o_tuned_bf16 = triton.autotune(
    configs=[triton.Config({"BV": bv, "BK": bk, "HILO": hilo}, num_warps=nw, num_stages=2)
             for bv, bk, nw in O_CONFIGS for hilo in (False, True)],
    key=["HV", "K", "V", "IS_VARLEN", "DOT_PREC"],
)(chunk_kda_fwd_kernel_o)


def state_output(qg, Aqk, h, vn, o, index, dot_prec, BK, o_config=None, o_hilo=None):
    """``o = qg h + Aqk v_new`` for every chunk in parallel (``chunk_kda_fwd_kernel_o``; ``h`` ``[NC, HV, K, V]``,
    ``vn`` ``[B, T, HV, V]``); separate from ``_state_split`` so the benchmarks can time it alone.

    ``o_config``: ``(BV, BK, warps[, stages])`` forced (None: autotuned on a GPU). ``o_hilo``: bf16 products, taken
    only when ``qg``, ``Aqk``, ``vn`` and ``h`` are all stored bf16 (None: autotuned on a GPU, on in the interpreter);
    otherwise the products take fp32 operands at ``dot_prec``."""
    T, HV, K = qg.shape[1:]
    V = vn.shape[-1]
    half_in = all(x.dtype == torch.bfloat16 for x in (qg, Aqk, vn, h))
    args = (qg, Aqk, h, vn, o, index.cu_seqlens, index.chunk_offsets, index.chunk_map, T, index.chunks_per_seq)
    meta = dict(HV=HV, K=K, V=V, BT=CHUNK_SIZE, IS_VARLEN=index.is_varlen, DOT_PREC=dot_prec, EMULATE=not qg.is_cuda,
                HALF_IN=half_in)
    if qg.is_cuda and o_config is None and triton.next_power_of_2(V) >= 64:
        grid = lambda cfg: (triton.cdiv(V, cfg["BV"]), index.num_chunks, HV)  # noqa: E731
        if half_in and o_hilo is None:
            chunk_kda_fwd_kernel_o_tuned_bf16[grid](*args, **meta)
        else:
            chunk_kda_fwd_kernel_o_tuned[grid](*args, **meta, HILO=bool(o_hilo) and half_in)
    else:
        hilo = half_in and (o_hilo is None or bool(o_hilo))
        bv, bk, nw, ns = (*o_config, 2)[:4] if o_config else (min(64, triton.next_power_of_2(V)), min(64, BK), 4, 2)
        chunk_kda_fwd_kernel_o[(triton.cdiv(V, bv), index.num_chunks, HV)](*args, BV=bv, BK=bk, **meta, HILO=hilo,
                                                                          num_warps=nw, num_stages=ns)
