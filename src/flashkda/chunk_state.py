"""Inter-chunk stage: the state recurrence with the output fused in, one program per (V block, sequence, head).

Per chunk, with the state ``S`` (``[K, BV]``, fp32, in registers for the whole sequence)::

    v_new = u - w S
    o     = qg S + Aqk v_new
    S     = Diag(e^{Γ_C}) S + kgᵀ v_new

Fusing the output here means the per-chunk states never go to memory (fla writes them out, ``NT x K x V`` per
head, and reads them back in a third kernel). Splitting V into ``BV``-wide blocks multiplies the number of
independent programs by ``V / BV``, which is what keeps an H200 busy when there are few heads and sequences.

Products take fp32 operands (tf32 tensor cores for half inputs): rounding the state to bf16 for ``w S`` and
``qg S`` alone costs ~1e-3 of RMS error against fp64, a fifth of the bf16 budget.

Traffic per (chunk, head), bf16 with K = V = 128: reads w, qg, kg, u, Aqk (74 KiB, shared by the V blocks through
L2) and writes o (16 KiB); the chain of chunks is sequential, so short rows of work are latency-bound.
"""

import torch
import triton
import triton.language as tl

from flashkda.chunk_intra import CHUNK_SIZE


@triton.jit
def _load_chunk(w_h, u_h, qg_h, kg_h, A_h, gC_c, i_t, Tn, o_c, o_k, o_v, m_k, m_v, m_causal,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Chunk ``i_t``'s tiles in their stored dtypes: u ``[BT, BV]``, w ``[BT, BK]``, Aqk ``[BT, BT]`` (causal),
    qg and kg ``[BT, BK]``, Γ_C ``[BK]`` (all zero past the sequence end)."""
    o_t = i_t * BT + o_c
    m_t = o_t < Tn
    m_tk = m_t[:, None] & m_k[None, :]
    b_u = tl.load(u_h + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    b_w = tl.load(w_h + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
    # only the lower triangle was written
    b_A = tl.load(A_h + o_t[:, None] * (HV * BT) + o_c[None, :], mask=m_t[:, None] & m_causal, other=0.0)
    b_qg = tl.load(qg_h + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
    b_kg = tl.load(kg_h + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
    b_gC = tl.load(gC_c + i_t * (HV * K) + o_k, mask=m_k & (i_t * BT + 0 * o_k < Tn), other=0.0)
    return b_u, b_w, b_A, b_qg, b_kg, b_gC


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_kernel_state_o(
    w, u, qg, kg, Aqk, gC, o, h0, ht, h, cu_seqlens, chunk_offsets,
    T, NTS, PROGRAMS,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STORE_H: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DT: tl.constexpr,
):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * NTS
    NT = tl.cdiv(eos - bos, BT)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, BT)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # Offsets of the [BK, BV] state tile inside one head's state, in either layout.
    if STATE_V_FIRST:
        o_s = o_v[None, :] * K + o_k[:, None]
    else:
        o_s = o_k[:, None] * V + o_v[None, :]
    i_s = (i_n.to(tl.int64) * HV + i_hv) * K * V

    # [BK, BV]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + i_s + o_s, mask=m_kv, other=0.0).to(tl.float32)

    # Scalar base pointers per (sequence, head) and int32 offsets inside: int64 element pointers for [BT, BK]
    # tiles cost 128 registers a thread and made the loop spill.
    Tn = (eos - bos).to(tl.int32)
    w_h = w + (bos * HV + i_hv) * K
    qg_h = qg + (bos * HV + i_hv) * K
    kg_h = kg + (bos * HV + i_hv) * K
    u_h = u + (bos * HV + i_hv) * V
    o_h = o + (bos * HV + i_hv) * V
    A_h = Aqk + (bos * HV + i_hv) * BT
    m_causal = o_c[:, None] >= o_c[None, :]
    gC_c = gC + (c0 * HV + i_hv) * K
    for i_t in range(0, NT):
        if STORE_H:
            tl.store(h + ((c0 + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], b_S, mask=m_kv)
        b_u, b_w, b_A, b_qg, b_kg, b_gC = _load_chunk(w_h, u_h, qg_h, kg_h, A_h, gC_c, i_t, Tn, o_c, o_k, o_v, m_k,
                                                      m_v, m_causal, HV, K, V, BT)
        o_t = i_t * BT + o_c
        m_tv = (o_t < Tn)[:, None] & m_v[None, :]
        b_Sd = b_S.to(DT)
        # [BT, BV]
        b_vn = b_u.to(tl.float32) - tl.dot(b_w.to(DT), b_Sd, input_precision=DOT_PREC)
        b_vnd = b_vn.to(DT)
        b_o = tl.dot(b_qg.to(DT), b_Sd, input_precision=DOT_PREC)
        b_o += tl.dot(b_A.to(DT), b_vnd, input_precision=DOT_PREC)
        tl.store(o_h + o_t[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        # [BK, BV]
        b_S = b_S * tl.exp(b_gC)[:, None] + tl.dot(tl.trans(b_kg.to(DT)), b_vnd, input_precision=DOT_PREC)

    if STORE_FINAL_STATE:
        tl.store(ht + i_s + o_s, b_S, mask=m_kv)


#: Tile configurations tried on first use of each shape class on a GPU (V tile, warps, pipeline stages); the choice
#: depends on how many (sequence, head) programs there are, hence the PROGRAMS key. Measured at H64-T8192
#: (benchmarks/kda/NOTES.md): 2 stages, a register prefetch of the next chunk and a bf16 hi/lo split of the chain
#: products were all slower or failed, so none of them is offered.
STATE_CONFIGS = [(16, 4, 1), (32, 4, 1), (64, 8, 1)]
chunk_kda_fwd_kernel_state_o_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns) for bv, nw, ns in STATE_CONFIGS],
    key=["PROGRAMS", "HV", "K", "V", "IS_VARLEN", "STATE_V_FIRST", "DOT_PREC"],
)(chunk_kda_fwd_kernel_state_o)


def pick_block_v(V: int, programs_per_block: int, num_sms: int) -> int:
    """Widest V block that still gives at least two programs per SM (down to 16)."""
    BV = min(64, triton.next_power_of_2(V))
    while BV > 16 and programs_per_block * triton.cdiv(V, BV) < 2 * num_sms:
        BV //= 2
    return BV


def chunk_kda_fwd_state_o(w, u, qg, kg, Aqk, gC, initial_state, output_final_state, state_v_first, index,
                          out_dtype, dot_prec, output_h=False, block_v=None, out=None, final_state=None,
                          num_warps=4, num_stages=1):
    B, T, HV, K = w.shape
    V = u.shape[-1]
    N = index.num_seqs
    o = out if out is not None else torch.empty(B, T, HV, V, dtype=out_dtype, device=w.device)
    ht = final_state
    if ht is None and output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        ht = torch.empty(shape, dtype=torch.float32, device=w.device)
    h = torch.empty(index.num_chunks, HV, K, V, dtype=torch.float32, device=w.device) if output_h else None
    if N == 0:
        return o, ht, h
    args = (w, u, qg, kg, Aqk, gC, o, initial_state, ht, h, index.cu_seqlens, index.chunk_offsets,
            T, index.chunks_per_seq, N * HV)
    meta = dict(HV=HV, K=K, V=V, BT=CHUNK_SIZE, BK=max(16, triton.next_power_of_2(K)),
                USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=ht is not None, STORE_H=output_h,
                STATE_V_FIRST=state_v_first, IS_VARLEN=index.is_varlen, DOT_PREC=dot_prec, DT=tl.float32)
    if w.is_cuda and block_v is None and triton.next_power_of_2(V) >= 64:
        grid = lambda cfg: (triton.cdiv(V, cfg["BV"]), N, HV)  # noqa: E731
        chunk_kda_fwd_kernel_state_o_tuned[grid](*args, **meta)
    else:
        if block_v is None:
            num_sms = torch.cuda.get_device_properties(w.device).multi_processor_count if w.is_cuda else 1
            block_v = pick_block_v(V, N * HV, num_sms)
        grid = (triton.cdiv(V, block_v), N, HV)
        chunk_kda_fwd_kernel_state_o[grid](*args, BV=block_v, **meta, num_warps=num_warps, num_stages=num_stages)
    return o, ht, h
