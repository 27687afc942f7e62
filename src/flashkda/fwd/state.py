"""Inter-chunk stage: the state recurrence and the output, one program per (V block, sequence, head).

Per chunk, with the state ``S`` (``[K, BV]``, fp32, in registers for the whole sequence)::

    v_new = u - w S
    o     = qg S + Aqk v_new
    S     = Diag(e^{Γ_C}) S + kgᵀ v_new

Fusing the output here means the per-chunk states never go to memory (fla writes them out, ``NT x K x V`` per
head, and reads them back in a third kernel). Splitting V into ``BV``-wide blocks multiplies the number of
independent programs by ``V / BV``, which is what keeps a GPU busy when there are few heads and sequences.

The fused kernel (``chunk_kda_fwd_kernel_state_o``) takes fp32 operands (tf32 tensor cores for half inputs).
Traffic per (chunk, head), bf16 with K = V = 128: reads w, qg, kg, u, Aqk (74 KiB, shared by the V blocks through
L2) and writes o (16 KiB); the chain of chunks is sequential, so short rows of work are latency-bound.

Split path (``chunk_kda_fwd_kernel_h`` then ``chunk_kda_fwd_kernel_o``; `prefer_split` chooses): the serial kernel
carries only ``v_new`` and ``S`` (reads w, kg, u, Γ_C) as up to four 64-row state tiles and stores the state at
every chunk start (bf16 for bf16 input) and ``v_new``; the output of all chunks is then one parallel kernel.
"""

import torch
import triton
import triton.language as tl

from flashkda.fwd.intra import CHUNK_SIZE
from flashkda.fwd.output import state_output
from flashkda.rounding import PREC_BF16, PREC_HILO, PREC_IEEE, PREC_TF32, cast_for_store, dot_acc, operand_split


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
def _seq_span(i_n, cu_seqlens, chunk_offsets, T, NTS, IS_VARLEN: tl.constexpr):
    """Sequence ``i_n``'s token span ``[bos, eos)`` and first global chunk ``c0`` (int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * NTS
    return bos, eos, c0


@triton.jit
def _seq_start(i_n, i_v, i_hv, h0, cu_seqlens, chunk_offsets, T, NTS, HV: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
               STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence ``i_n``'s token span ``[bos, eos)`` and first global chunk ``c0``, the offsets ``o_s`` of this
    program's ``[BK, BV]`` state tile inside one head's state (either layout) from ``i_s``, and the initial tile."""
    bos, eos, c0 = _seq_span(i_n, cu_seqlens, chunk_offsets, T, NTS, IS_VARLEN)
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
        tl.store(o_h + o_t[:, None] * (HV * V) + o_v[None, :], cast_for_store(b_o, o.dtype.element_ty), mask=m_tv)
        # [BK, BV]
        b_S = b_S * tl.exp(b_gC)[:, None] + tl.dot(tl.trans(b_kg.to(DT)), b_vnd, input_precision=DOT_PREC)

    if STORE_FINAL_STATE:
        tl.store(ht + i_s + o_s, b_S, mask=m_kv)


@triton.jit
def _state_offsets(o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Offsets and mask of the ``[BKB, BV]`` tile at rows ``o_k``, columns ``o_v`` of one head's state."""
    m = (o_k < K)[:, None] & (o_v < V)[None, :]
    if STATE_V_FIRST:
        return o_v[None, :] * K + o_k[:, None], m
    return o_k[:, None] * V + o_v[None, :], m


@triton.jit
def _state_in(h0, i_s, o_k, o_v, K: tl.constexpr, V: tl.constexpr, BKB: tl.constexpr, BV: tl.constexpr,
              USE_INITIAL_STATE: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """``[BKB, BV]`` fp32 initial state tile (this head's state starts at ``h0 + i_s``), zero without one."""
    b_S = tl.zeros([BKB, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        o_s, m_s = _state_offsets(o_k, o_v, K, V, STATE_V_FIRST)
        b_S += tl.load(h0 + i_s + o_s, mask=m_s, other=0.0).to(tl.float32)
    return b_S


@triton.jit
def _state_out(ht, b_S, o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    o_s, m_s = _state_offsets(o_k, o_v, K, V, STATE_V_FIRST)
    tl.store(ht + o_s, b_S, mask=m_s)


@triton.jit
def _ws_block(w_t, b_S, b_acc, o_t, m_t, o_k, HV: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr,
              EMULATE: tl.constexpr):
    """``acc + w[:, o_k] S_block`` for the chunk rows ``o_t``; ``[BT, BV]``."""
    b_w = tl.load(w_t + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
    b_hi, b_lo = operand_split(b_S, PREC, EMULATE)
    return dot_acc(b_w, b_hi, b_lo, b_acc, PREC, EMULATE)


@triton.jit
def _update_block(kg_t, gC_t, b_S, b_hi, b_lo, o_t, m_t, o_k, HV: tl.constexpr, K: tl.constexpr,
                  PREC: tl.constexpr, EMULATE: tl.constexpr):
    """``Diag(e^{Γ_C}) S_block + kg[:, o_k]ᵀ v_new`` (v_new given as ``(hi, lo)``); kg is loaded transposed,
    ``[BKB, BT]``, straight from memory."""
    m_k = o_k < K
    b_kt = tl.load(kg_t + o_t[None, :] * (HV * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
    b_gC = tl.load(gC_t + o_k, mask=m_k, other=0.0)
    return dot_acc(b_kt, b_hi, b_lo, b_S * tl.exp(b_gC)[:, None], PREC, EMULATE)


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_kernel_h(
    w, u, kg, gC, h, vn, h0, ht, cu_seqlens, chunk_offsets,
    T, NTS, PROGRAMS,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKB: tl.constexpr, NKB: tl.constexpr,
    BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, PREC_WS: tl.constexpr, PREC_KV: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """State-only recurrence: per chunk it stores the state at the chunk start ``h`` and ``v_new = u - w S``, then
    ``S = Diag(e^{Γ_C}) S + kgᵀ v_new``. The ``[K, BV]`` state is held as ``NKB`` (1-4) separate ``[BKB, BV]``
    tiles: each chain product is a sum over (or a set of) products on 64-row blocks, and kg's blocks are loaded
    transposed rather than transposed in registers. Operand precisions per product: ``PREC_*`` above."""
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0 = _seq_span(i_n, cu_seqlens, chunk_offsets, T, NTS, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    Tn = (eos - bos).to(tl.int32)
    o_c, o_v = tl.arange(0, BT), i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k1 = tl.arange(0, BKB)
    o_k2, o_k3, o_k4 = BKB + o_k1, 2 * BKB + o_k1, 3 * BKB + o_k1
    i_s = (i_n.to(tl.int64) * HV + i_hv) * K * V
    # [BKB, BV] x NKB
    b_S1 = _state_in(h0, i_s, o_k1, o_v, K, V, BKB, BV, USE_INITIAL_STATE, STATE_V_FIRST)
    if NKB > 1:
        b_S2 = _state_in(h0, i_s, o_k2, o_v, K, V, BKB, BV, USE_INITIAL_STATE, STATE_V_FIRST)
    if NKB > 2:
        b_S3 = _state_in(h0, i_s, o_k3, o_v, K, V, BKB, BV, USE_INITIAL_STATE, STATE_V_FIRST)
    if NKB > 3:
        b_S4 = _state_in(h0, i_s, o_k4, o_v, K, V, BKB, BV, USE_INITIAL_STATE, STATE_V_FIRST)

    w_h = w + (bos * HV + i_hv) * K
    kg_h = kg + (bos * HV + i_hv) * K
    u_h = u + (bos * HV + i_hv) * V
    vn_h = vn + (bos * HV + i_hv) * V
    h_h = h + (c0 * HV + i_hv) * K * V
    gC_h = gC + (c0 * HV + i_hv) * K
    for i_t in range(0, NT):
        o_t = i_t * BT + o_c
        m_t = o_t < Tn
        m_tv = m_t[:, None] & m_v[None, :]
        h_t = h_h + i_t * (HV * K * V)
        gC_t = gC_h + i_t * (HV * K)
        _state_out(h_t, cast_for_store(b_S1, h.dtype.element_ty), o_k1, o_v, K, V, False)
        b_ws = _ws_block(w_h, b_S1, tl.zeros([BT, BV], dtype=tl.float32), o_t, m_t, o_k1, HV, K, PREC_WS, EMULATE)
        if NKB > 1:
            _state_out(h_t, cast_for_store(b_S2, h.dtype.element_ty), o_k2, o_v, K, V, False)
            b_ws = _ws_block(w_h, b_S2, b_ws, o_t, m_t, o_k2, HV, K, PREC_WS, EMULATE)
        if NKB > 2:
            _state_out(h_t, cast_for_store(b_S3, h.dtype.element_ty), o_k3, o_v, K, V, False)
            b_ws = _ws_block(w_h, b_S3, b_ws, o_t, m_t, o_k3, HV, K, PREC_WS, EMULATE)
        if NKB > 3:
            _state_out(h_t, cast_for_store(b_S4, h.dtype.element_ty), o_k4, o_v, K, V, False)
            b_ws = _ws_block(w_h, b_S4, b_ws, o_t, m_t, o_k4, HV, K, PREC_WS, EMULATE)
        # [BT, BV]
        b_vn = tl.load(u_h + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32) - b_ws
        tl.store(vn_h + o_t[:, None] * (HV * V) + o_v[None, :], cast_for_store(b_vn, vn.dtype.element_ty), mask=m_tv)
        b_hi, b_lo = operand_split(b_vn, PREC_KV, EMULATE)
        b_S1 = _update_block(kg_h, gC_t, b_S1, b_hi, b_lo, o_t, m_t, o_k1, HV, K, PREC_KV, EMULATE)
        if NKB > 1:
            b_S2 = _update_block(kg_h, gC_t, b_S2, b_hi, b_lo, o_t, m_t, o_k2, HV, K, PREC_KV, EMULATE)
        if NKB > 2:
            b_S3 = _update_block(kg_h, gC_t, b_S3, b_hi, b_lo, o_t, m_t, o_k3, HV, K, PREC_KV, EMULATE)
        if NKB > 3:
            b_S4 = _update_block(kg_h, gC_t, b_S4, b_hi, b_lo, o_t, m_t, o_k4, HV, K, PREC_KV, EMULATE)

    if STORE_FINAL_STATE:
        _state_out(ht + i_s, b_S1, o_k1, o_v, K, V, STATE_V_FIRST)
        if NKB > 1:
            _state_out(ht + i_s, b_S2, o_k2, o_v, K, V, STATE_V_FIRST)
        if NKB > 2:
            _state_out(ht + i_s, b_S3, o_k3, o_v, K, V, STATE_V_FIRST)
        if NKB > 3:
            _state_out(ht + i_s, b_S4, o_k4, o_v, K, V, STATE_V_FIRST)


#: Fused state/output configurations the autotuner tries on a GPU (V tile, warps, pipeline stages); the choice
#: depends on how many (sequence, head) programs there are, hence the PROGRAMS key: that count rounded up to a power
#: of two (`programs_key`), so packed batches whose document count changes every step do not re-tune every step.
STATE_CONFIGS = [(16, 4, 1), (32, 4, 1), (64, 8, 1)]
chunk_kda_fwd_kernel_state_o_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns) for bv, nw, ns in STATE_CONFIGS],
    key=["PROGRAMS", "HV", "K", "V", "IS_VARLEN", "STATE_V_FIRST", "DOT_PREC"],
)(chunk_kda_fwd_kernel_state_o)


#: State-only pass configurations the autotuner tries on a GPU (V tile, warps, pipeline stages).
HB_CONFIGS = [(32, 4, 2), (64, 4, 2), (32, 4, 3), (64, 4, 3)]
chunk_kda_fwd_kernel_h_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns) for bv, nw, ns in HB_CONFIGS],
    key=["PROGRAMS", "HV", "K", "V", "IS_VARLEN", "STATE_V_FIRST", "PREC_WS", "PREC_KV"],
)(chunk_kda_fwd_kernel_h)
#: Operand precisions of the state-only pass for bf16 input (``w S``, ``kgᵀ v_new``): the state rounded to bf16 in
#: ``w S`` costs no accuracy, v_new goes in as its hi/lo split (rounded to bf16 it raised the final state's error by
#: ~0.5e-3; docs/flashkda-performance.md).
HALF_PRECS = (PREC_BF16, PREC_HILO)


def programs_key(programs: int) -> int:
    """The autotuning key for ``programs`` (sequence, head) pairs: the next power of two."""
    return triton.next_power_of_2(max(programs, 1))


def pick_block_v(V: int, programs_per_block: int, num_sms: int) -> int:
    """Widest V block that still gives at least two programs per SM (down to 16)."""
    BV = min(64, triton.next_power_of_2(V))
    while BV > 16 and programs_per_block * triton.cdiv(V, BV) < 2 * num_sms:
        BV //= 2
    return BV


def chunk_kda_fwd_state_o(w, u, qg, kg, Aqk, gC, initial_state, output_final_state, state_v_first, index,
                          out_dtype, dot_prec, output_h=False, block_v=None, out=None, final_state=None,
                          num_warps=4, num_stages=1, split=None, o_config=None, precs=None, o_hilo=None,
                          states_out=None):
    """State recurrence and output from the intra stage's tensors.

    Args:
        w, kg, qg, u: ``[B, T, HV, K]`` / ``[B, T, HV, V]`` in the work dtype (``u`` may be fp32); Aqk:
            ``[B, T, HV, 64]`` (lower triangle); gC: ``[NC, HV, K]`` fp32 chunk gate sums.
        initial_state, output_final_state, state_v_first: as in ``flashkda.chunk_kda``.
        index: ``ChunkIndex`` of the batch. out_dtype: dtype of ``o``. dot_prec: ``"ieee"`` or ``"tf32"``.
        output_h: also return the fp32 states at chunk starts (fused kernel only).
        block_v, num_warps, num_stages: force one configuration of the recurrence kernel (None: autotuned on a
            GPU, a picked V tile on the interpreter).
        out, final_state: optional preallocated outputs.
        split: True runs the state-only pass (`state_pass`, states stored bf16 for bf16 input) and the parallel
            output kernel (`state_output`); False the fused recurrence with the output inside. None:
            `prefer_split` unless ``output_h``.
        o_config, o_hilo: force the output kernel's tiles and products (see `state_output`).
        precs: ``(PREC_WS, PREC_KV)`` of the state-only pass (None: ``HALF_PRECS`` for bf16, tf32 for fp16, exact
            for fp32 input).
        states_out: a list that receives ``(h, v_new)`` of the split path (``h`` ``[NC, HV, K, V]`` and ``v_new``
            ``[B, T, HV, V]`` in their stored dtypes, bf16 for bf16 input) for the training backward; left empty
            by the fused path, which keeps no per-chunk states.

    Returns:
        ``(o, final_state, h)`` as ``flashkda.fwd.chunk_fwd.chunk_kda_fwd``.
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
        if output_h:
            raise ValueError("output_h: the split state path keeps its states in its own dtype; use split=False")
        states = state_pass(w, u, kg, gC, initial_state, ht, state_v_first, index, dot_prec, block_v, num_warps,
                            num_stages, precs)
        state_output(qg, Aqk, *states, o, index, dot_prec, BK, o_config, o_hilo)
        if states_out is not None:
            states_out.extend(states)
        return o, ht, h
    args = (w, u, qg, kg, Aqk, gC, o, initial_state, ht, h, index.cu_seqlens, index.chunk_offsets,
            T, index.chunks_per_seq, programs_key(N * HV))
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
    """Whether the state stage runs split (state-only pass + parallel output kernel) rather than fused: always for
    bf16 input and on the interpreter (CPU tensors, so the CPU suite runs the split path everywhere and the fused
    one in its forced-configuration tests); never for fp16 input (fp32 work tensors with tf32 products); for fp32
    input when the fused recurrence would have fewer 32-wide programs than SMs, i.e. when the serial chain, not the
    per-chunk work, sets the time. (Measurements: docs/flashkda-performance.md.)"""
    if not w.is_cuda:
        return True
    if w.dtype == torch.float32 and dot_prec != "ieee":
        return False
    if w.dtype == torch.bfloat16:
        return True
    num_sms = torch.cuda.get_device_properties(w.device).multi_processor_count
    return programs_per_block * triton.cdiv(V, 32) < num_sms


def _default_block_v(V, programs_per_block, w):
    num_sms = torch.cuda.get_device_properties(w.device).multi_processor_count if w.is_cuda else 1
    return pick_block_v(V, programs_per_block, num_sms)


def state_pass(w, u, kg, gC, initial_state, ht, state_v_first, index, dot_prec, block_v=None, num_warps=4,
               num_stages=1, precs=None):
    """The state-only recurrence (``chunk_kda_fwd_kernel_h``): the state at every chunk start and ``v_new``,
    without the output (the split path's first kernel; the training backward also runs it to recompute the states
    of all heads at once).

    bf16 input: h is stored bf16 (only ``qg h`` reads it); v_new is stored in u's dtype. Inside the recurrence v_new
    stays fp32 in registers and enters ``kgᵀ v_new`` as a bf16 hi/lo split (`HALF_PRECS`). fp16 input keeps fp32 w,
    kg and h with tf32 products; fp32 input fp32 everywhere with exact products.

    Args:
        w, kg: ``[B, T, HV, K]``; u: ``[B, T, HV, V]``; gC: ``[NC, HV, K]`` fp32 (as the intra stage writes them).
        initial_state, ht: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) or None; ``ht`` receives
            the final states.
        index: ``ChunkIndex`` of the batch. dot_prec: ``"ieee"`` or ``"tf32"``.
        block_v, num_warps, num_stages, precs: as in `chunk_kda_fwd_state_o`.

    Returns ``(h, v_new)`` as stored (``[NC, HV, K, V]``, ``[B, T, HV, V]``).
    """
    B, T, HV, K = w.shape
    V = u.shape[-1]
    N = index.num_seqs
    h_dtype = torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32
    h = torch.empty(index.num_chunks, HV, K, V, dtype=h_dtype, device=w.device)
    vn = torch.empty(B, T, HV, V, dtype=u.dtype, device=w.device)
    if N == 0:
        return h, vn
    if precs is None and dot_prec == "ieee":
        precs = (PREC_IEEE, PREC_IEEE)
    elif precs is None:
        # fp16 input has fp32 w/kg (bf16 would round them), so its products stay tf32
        precs = HALF_PRECS if w.dtype == torch.bfloat16 else (PREC_TF32, PREC_TF32)
    BKB = min(64, max(16, triton.next_power_of_2(K)))
    args = (w, u, kg, gC, h, vn, initial_state, ht, index.cu_seqlens, index.chunk_offsets, T, index.chunks_per_seq,
            programs_key(N * HV))
    meta = dict(HV=HV, K=K, V=V, BT=CHUNK_SIZE, USE_INITIAL_STATE=initial_state is not None,
                STORE_FINAL_STATE=ht is not None, STATE_V_FIRST=state_v_first, IS_VARLEN=index.is_varlen,
                EMULATE=not w.is_cuda, BKB=BKB, NKB=triton.cdiv(K, BKB), PREC_WS=precs[0], PREC_KV=precs[1])
    if w.is_cuda and block_v is None and triton.next_power_of_2(V) >= 64:
        grid = lambda cfg: (triton.cdiv(V, cfg["BV"]), N, HV)  # noqa: E731
        chunk_kda_fwd_kernel_h_tuned[grid](*args, **meta)
    else:
        block_v = block_v or _default_block_v(V, N * HV, w)
        chunk_kda_fwd_kernel_h[(triton.cdiv(V, block_v), N, HV)](*args, BV=block_v, **meta, num_warps=num_warps,
                                                                  num_stages=num_stages)
    return h, vn
