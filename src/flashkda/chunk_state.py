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

Split path (``chunk_kda_fwd_kernel_h`` then ``chunk_kda_fwd_kernel_o``), used when there are fewer fused programs
than SMs (``prefer_split``): the serial kernel carries only ``v_new`` and ``S`` (reads w, kg, u, Γ_C) and stores the
state at every chunk start (bf16 for half input) and ``v_new`` (fp32); the output of all chunks is then one parallel
kernel. On the H200 this took the H32-T131072 stage from 12.9 to 9.7 ms and left H64-T8192 unchanged
(benchmarks/kda/NOTES.md).
"""

import torch
import triton
import triton.language as tl

from flashkda.chunk_intra import CHUNK_SIZE, chunk_span


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


@triton.jit
def _seq_start(i_n, i_v, i_hv, h0, cu_seqlens, chunk_offsets, T, NTS, HV: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
               STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence ``i_n``'s token span ``[bos, eos)`` and first global chunk ``c0``, the offsets ``o_s`` of this
    program's ``[BK, BV]`` state tile inside one head's state (either layout) from ``i_s``, and the initial tile."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * NTS
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    if STATE_V_FIRST:
        o_s = o_v[None, :] * K + o_k[:, None]
    else:
        o_s = o_k[:, None] * V + o_v[None, :]
    i_s = (i_n.to(tl.int64) * HV + i_hv) * K * V
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + i_s + o_s, mask=m_kv, other=0.0).to(tl.float32)
    return bos, eos, c0, o_s, i_s, b_S


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_kernel_state_o(
    w, u, qg, kg, Aqk, gC, o, h0, ht, h, cu_seqlens, chunk_offsets,
    T, NTS, PROGRAMS,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STORE_H: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DT: tl.constexpr,
):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # [BK, BV] state tile
    bos, eos, c0, o_s, i_s, b_S = _seq_start(i_n, i_v, i_hv, h0, cu_seqlens, chunk_offsets, T, NTS, HV, K, V, BK,
                                             BV, USE_INITIAL_STATE, STATE_V_FIRST, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    o_k, o_v, o_c = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

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


@triton.jit
def _bf16_split(b_x, EMULATE: tl.constexpr):
    """``x = hi + lo`` with both parts bf16 (16 significant bits together); fp32-held bf16 values on the
    interpreter, whose bf16 products are not reliable."""
    b_hi = b_x.to(tl.bfloat16)
    b_lo = (b_x - b_hi.to(tl.float32)).to(tl.bfloat16)
    if EMULATE:
        return b_hi.to(tl.float32), b_lo.to(tl.float32)
    return b_hi, b_lo


@triton.jit
def _mma(b_a, b_b, HILO: tl.constexpr, EMULATE: tl.constexpr, DOT_PREC: tl.constexpr):
    """``a @ b`` with fp32 accumulation, ``a`` holding bf16 values (w, kg as stored) and ``b`` fp32.

    ``HILO``: two bf16 tensor-core products over the hi/lo split of ``b`` (16 significant bits, more than tf32's
    11, at half of tf32's operand bytes and twice its rate); otherwise one product with fp32 operands at
    ``DOT_PREC``.
    """
    if HILO:
        b_hi, b_lo = _bf16_split(b_b, EMULATE)
        if EMULATE:
            b_a = b_a.to(tl.float32)
            return (tl.dot(b_a, b_hi, input_precision="ieee")
                    + tl.dot(b_a, b_lo, input_precision="ieee"))
        b_a = b_a.to(tl.bfloat16)
        return tl.dot(b_a, b_lo, tl.dot(b_a, b_hi))
    return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), input_precision=DOT_PREC)


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_kernel_h(
    w, u, kg, gC, h, vn, h0, ht, cu_seqlens, chunk_offsets,
    T, NTS, PROGRAMS,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    IS_VARLEN: tl.constexpr, HILO: tl.constexpr, EMULATE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """State-only recurrence, one program per (V block, sequence, head): per chunk it stores the state at the chunk
    start ``h`` and ``v_new = u - w S``, then ``S = Diag(e^{Γ_C}) S + kgᵀ v_new``. Only w, kg, u and Γ_C are read
    per step (no qg, Aqk or o), so the serial chain carries two products."""
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # [BK, BV] state tile
    bos, eos, c0, o_s, i_s, b_S = _seq_start(i_n, i_v, i_hv, h0, cu_seqlens, chunk_offsets, T, NTS, HV, K, V, BK,
                                             BV, USE_INITIAL_STATE, STATE_V_FIRST, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    o_k, o_v, o_c = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

    Tn = (eos - bos).to(tl.int32)
    w_h = w + (bos * HV + i_hv) * K
    kg_h = kg + (bos * HV + i_hv) * K
    u_h = u + (bos * HV + i_hv) * V
    vn_h = vn + (bos * HV + i_hv) * V
    h_h = h + (c0 * HV + i_hv) * K * V
    gC_c = gC + (c0 * HV + i_hv) * K
    o_hs = o_k[:, None] * V + o_v[None, :]
    for i_t in range(0, NT):
        o_t = i_t * BT + o_c
        m_t = o_t < Tn
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        # loads depend on i_t only, so the pipeliner may issue them a chunk ahead (num_stages > 1)
        b_w = tl.load(w_h + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_kg = tl.load(kg_h + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(u_h + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0)
        b_gC = tl.load(gC_c + i_t * (HV * K) + o_k, mask=m_k, other=0.0)
        tl.store(h_h + i_t * (HV * K * V) + o_hs, b_S.to(h.dtype.element_ty), mask=m_kv)
        # [BT, BV]
        b_vn = b_u.to(tl.float32) - _mma(b_w, b_S, HILO, EMULATE, DOT_PREC)
        tl.store(vn_h + o_t[:, None] * (HV * V) + o_v[None, :], b_vn.to(vn.dtype.element_ty), mask=m_tv)
        # [BK, BV]
        b_S = b_S * tl.exp(b_gC)[:, None] + _mma(tl.trans(b_kg), b_vn, HILO, EMULATE, DOT_PREC)

    if STORE_FINAL_STATE:
        tl.store(ht + i_s + o_s, b_S, mask=m_kv)


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_kernel_o(
    qg, Aqk, h, vn, o, cu_seqlens, chunk_offsets, chunk_map,
    T, NTS,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Output of every chunk in parallel, one program per (V block, chunk, head): ``o = qg h + Aqk v_new`` with
    fp32 qg/Aqk at ``DOT_PREC`` (h and v_new as stored, exactly widened to fp32)."""
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
        b_o += tl.dot(b_q.to(tl.float32), b_h.to(tl.float32), input_precision=DOT_PREC)
    # only the lower triangle of Aqk was written
    b_A = tl.load(Aqk + (t0 * HV + i_hv) * BT + o_c[:, None] * (HV * BT) + o_c[None, :],
                  mask=m_t[:, None] & (o_c[:, None] >= o_c[None, :]), other=0.0)
    b_vn = tl.load(vn + (t0 * HV + i_hv) * V + o_c[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0)
    b_o += tl.dot(b_A.to(tl.float32), b_vn.to(tl.float32), input_precision=DOT_PREC)
    tl.store(o + (t0 * HV + i_hv) * V + o_c[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_tv)


#: Tile configurations tried on first use of each shape class on a GPU (V tile, warps, pipeline stages); the choice
#: depends on how many (sequence, head) programs there are, hence the PROGRAMS key. Measured at H64-T8192
#: (benchmarks/kda/NOTES.md): 2 stages, a register prefetch of the next chunk and a bf16 hi/lo split of the chain
#: products were all slower or failed, so none of them is offered.
STATE_CONFIGS = [(16, 4, 1), (32, 4, 1), (64, 8, 1)]
chunk_kda_fwd_kernel_state_o_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns) for bv, nw, ns in STATE_CONFIGS],
    key=["PROGRAMS", "HV", "K", "V", "IS_VARLEN", "STATE_V_FIRST", "DOT_PREC"],
)(chunk_kda_fwd_kernel_state_o)


#: State-only recurrence configurations (V tile, warps, pipeline stages) the autotuner tries on a GPU. Measured at
#: H64-T8192 / H32-T131072 (NOTES.md, tf32 chain): 32:4:2 best at both (1.051 / 9.72 ms with the output kernel),
#: 32:4:1 1.099, 64:4:2 1.168, 16:4:2 1.362 / 10.78, 64:8:2 1.128.
H_CONFIGS = [(32, 4, 2), (64, 8, 2), (16, 4, 2)]
#: With the hi/lo bf16 chain products one pipeline stage crashed (CUDA illegal memory access, Triton 3.6, H200), so
#: only pipelined configurations are offered or accepted for it.
HILO_MIN_STAGES = 2
chunk_kda_fwd_kernel_h_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns) for bv, nw, ns in H_CONFIGS],
    key=["PROGRAMS", "HV", "K", "V", "IS_VARLEN", "STATE_V_FIRST", "HILO", "DOT_PREC"],
)(chunk_kda_fwd_kernel_h)
#: Output-kernel configurations (V tile, K slice, warps).
O_CONFIGS = [(64, 64, 4), (64, 64, 8), (128, 64, 8)]
chunk_kda_fwd_kernel_o_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv, "BK": bk}, num_warps=nw, num_stages=2) for bv, bk, nw in O_CONFIGS],
    key=["HV", "K", "V", "IS_VARLEN", "DOT_PREC"],
)(chunk_kda_fwd_kernel_o)


def pick_block_v(V: int, programs_per_block: int, num_sms: int) -> int:
    """Widest V block that still gives at least two programs per SM (down to 16)."""
    BV = min(64, triton.next_power_of_2(V))
    while BV > 16 and programs_per_block * triton.cdiv(V, BV) < 2 * num_sms:
        BV //= 2
    return BV


def chunk_kda_fwd_state_o(w, u, qg, kg, Aqk, gC, initial_state, output_final_state, state_v_first, index,
                          out_dtype, dot_prec, output_h=False, block_v=None, out=None, final_state=None,
                          num_warps=4, num_stages=1, split=None, o_config=None, hilo=False):
    """State recurrence and output from the intra stage's tensors.

    Args:
        w, kg: ``[B, T, HV, K]`` (work dtype); u: ``[B, T, HV, V]`` fp32; qg: ``[B, T, HV, K]`` fp32; Aqk:
            ``[B, T, HV, 64]`` fp32 (lower triangle); gC: ``[NC, HV, K]`` fp32 chunk gate sums.
        initial_state, output_final_state, state_v_first: as in ``flashkda.chunk_kda``.
        index: ``ChunkIndex`` of the batch. out_dtype: dtype of ``o``. dot_prec: ``"ieee"`` or ``"tf32"``.
        output_h: also return the fp32 states at chunk starts (fused kernel only).
        block_v, num_warps, num_stages: force one configuration of the recurrence kernel (None: autotuned on a
            GPU, a picked V tile on the interpreter).
        out, final_state: optional preallocated outputs.
        split: True runs the state-only recurrence (states stored bf16 for half input) and a parallel output
            kernel; False the fused recurrence with the output inside. None: ``prefer_split`` unless ``output_h``.
        o_config: ``(BV, BK, warps)`` forced for the output kernel of the split path (None: autotuned on a GPU).
        hilo: split path with bf16 ``w``/``kg``: the chain products as two bf16 products over a hi/lo split of the
            fp32 state and v_new instead of one tf32 product (7% faster on the H200, but one of its launch
            configurations crashed there, so it is opt-in).

    Returns:
        ``(o, final_state, h)`` as ``flashkda.chunk_fwd.chunk_kda_fwd``.
    """
    B, T, HV, K = w.shape
    V = u.shape[-1]
    N = index.num_seqs
    o = out if out is not None else torch.empty(B, T, HV, V, dtype=out_dtype, device=w.device)
    ht = final_state
    if ht is None and output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        ht = torch.empty(shape, dtype=torch.float32, device=w.device)
    if split is None:
        split = not output_h and prefer_split(N * HV, V, w, dot_prec)
    h = torch.empty(index.num_chunks, HV, K, V, dtype=torch.float32, device=w.device) if output_h else None
    if N == 0:
        return o, ht, h
    BK = max(16, triton.next_power_of_2(K))
    if split:
        if hilo and block_v is not None and num_stages < HILO_MIN_STAGES:
            raise ValueError(f"num_stages: the hi/lo chain products need >= {HILO_MIN_STAGES} pipeline stages "
                             f"(one stage crashed on the device), got {num_stages}")
        if output_h:
            raise ValueError("output_h: the split state path keeps its states in its own dtype; use split=False")
        _state_split(w, u, qg, kg, Aqk, gC, o, initial_state, ht, state_v_first, index, dot_prec, BK,
                     block_v, num_warps, num_stages, o_config, hilo and w.dtype == torch.bfloat16)
        return o, ht, h
    args = (w, u, qg, kg, Aqk, gC, o, initial_state, ht, h, index.cu_seqlens, index.chunk_offsets,
            T, index.chunks_per_seq, N * HV)
    meta = dict(HV=HV, K=K, V=V, BT=CHUNK_SIZE, BK=BK,
                USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=ht is not None, STORE_H=output_h,
                STATE_V_FIRST=state_v_first, IS_VARLEN=index.is_varlen, DOT_PREC=dot_prec, DT=tl.float32)
    if w.is_cuda and block_v is None and triton.next_power_of_2(V) >= 64:
        grid = lambda cfg: (triton.cdiv(V, cfg["BV"]), N, HV)  # noqa: E731
        chunk_kda_fwd_kernel_state_o_tuned[grid](*args, **meta)
    else:
        block_v = block_v or _default_block_v(V, N * HV, w)
        grid = (triton.cdiv(V, block_v), N, HV)
        chunk_kda_fwd_kernel_state_o[grid](*args, BV=block_v, **meta, num_warps=num_warps, num_stages=num_stages)
    return o, ht, h


def prefer_split(programs_per_block: int, V: int, w: torch.Tensor, dot_prec: str = "ieee") -> bool:
    """Split (state-only recurrence + parallel output kernel) when the fused recurrence would have fewer 32-wide
    programs than SMs, i.e. when the serial chain, not the per-chunk work, sets the time.

    Measured on the H200 (NOTES.md): H32-T131072 (128 programs) fused 12.94 ms vs split 9.72 ms; H64-T8192 (256
    programs) fused 1.035 vs split 1.051 ms, where the fused stage also keeps no per-chunk states in memory. The
    interpreter (CPU tensors) always splits, so the CPU suite runs the split path everywhere (the fused one in its
    forced-configuration tests).

    fp16 input (fp32 work tensors with tf32 products) keeps the fused path on CUDA: with the split path its fp64
    GPU case (T300-H1-HV2-K256-V64-float16-bounded-noA) failed on the H200 (2026-12-01 02:13 UTC, h then stored
    bf16); h is fp32 for fp16 input since, but that is not verified on a device.
    """
    if not w.is_cuda:
        return True
    if w.dtype == torch.float32 and dot_prec != "ieee":
        return False
    num_sms = torch.cuda.get_device_properties(w.device).multi_processor_count
    return programs_per_block * triton.cdiv(V, 32) < num_sms


def _default_block_v(V, programs_per_block, w):
    num_sms = torch.cuda.get_device_properties(w.device).multi_processor_count if w.is_cuda else 1
    return pick_block_v(V, programs_per_block, num_sms)


def _state_split(w, u, qg, kg, Aqk, gC, o, initial_state, ht, state_v_first, index, dot_prec, BK, block_v,
                 num_warps, num_stages, o_config, hilo):
    """The split path: ``chunk_kda_fwd_kernel_h`` then ``chunk_kda_fwd_kernel_o`` (see their docstrings).

    bf16 input: h is stored bf16 (only ``qg h`` reads it: +0.4e-3 RMS error on o, measured
    on the CPU against fp64) while v_new stays fp32 (in bf16, as fla stores it, ``Aqk v_new`` nearly doubled the
    error of o to ~6e-3, over the 5e-3 budget). The chain products keep fp32 state operands (tf32, or the bf16
    hi/lo split): with the state and v_new rounded to bf16 for them, as fla does, the final-state error doubled
    (3.2e-3 -> 5.9e-3 in the softplus case). fp32 input keeps fp32 everywhere with exact products.
    """
    B, T, HV, K = w.shape
    V = u.shape[-1]
    N = index.num_seqs
    half = dot_prec != "ieee"
    h_dtype = torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32  # fp16 input: fp32 h (see prefer_split)
    h = torch.empty(index.num_chunks, HV, K, V, dtype=h_dtype, device=w.device)
    vn = torch.empty(B, T, HV, V, dtype=torch.float32, device=w.device)
    args = (w, u, kg, gC, h, vn, initial_state, ht, index.cu_seqlens, index.chunk_offsets, T, index.chunks_per_seq,
            N * HV)
    meta = dict(HV=HV, K=K, V=V, BT=CHUNK_SIZE, BK=BK, USE_INITIAL_STATE=initial_state is not None,
                STORE_FINAL_STATE=ht is not None, STATE_V_FIRST=state_v_first, IS_VARLEN=index.is_varlen,
                HILO=half and hilo, EMULATE=not w.is_cuda, DOT_PREC=dot_prec)
    if w.is_cuda and block_v is None and triton.next_power_of_2(V) >= 64:
        grid = lambda cfg: (triton.cdiv(V, cfg["BV"]), N, HV)  # noqa: E731
        chunk_kda_fwd_kernel_h_tuned[grid](*args, **meta)
    else:
        block_v = block_v or _default_block_v(V, N * HV, w)
        chunk_kda_fwd_kernel_h[(triton.cdiv(V, block_v), N, HV)](*args, BV=block_v, **meta, num_warps=num_warps,
                                                                    num_stages=num_stages)
    state_output(qg, Aqk, h, vn, o, index, dot_prec, BK, o_config)


def state_output(qg, Aqk, h, vn, o, index, dot_prec, BK, o_config=None):
    """``o = qg h + Aqk v_new`` for every chunk in parallel (``chunk_kda_fwd_kernel_o``; ``h`` ``[NC, HV, K, V]``,
    ``vn`` ``[B, T, HV, V]``); separate from ``_state_split`` so the benchmarks can time it alone."""
    T, HV, K = qg.shape[1:]
    V = vn.shape[-1]
    args = (qg, Aqk, h, vn, o, index.cu_seqlens, index.chunk_offsets, index.chunk_map, T, index.chunks_per_seq)
    meta = dict(HV=HV, K=K, V=V, BT=CHUNK_SIZE, IS_VARLEN=index.is_varlen, DOT_PREC=dot_prec)
    if qg.is_cuda and o_config is None and triton.next_power_of_2(V) >= 64:
        grid = lambda cfg: (triton.cdiv(V, cfg["BV"]), index.num_chunks, HV)  # noqa: E731
        chunk_kda_fwd_kernel_o_tuned[grid](*args, **meta)
    else:
        bv, bk, nw = o_config or (min(64, triton.next_power_of_2(V)), min(64, BK), 4)
        chunk_kda_fwd_kernel_o[(triton.cdiv(V, bv), index.num_chunks, HV)](*args, BV=bv, BK=bk, **meta, num_warps=nw,
                                                                          num_stages=2)
