"""The operands of the training backward's state passes, recomputed for all value heads at once in bf16.

The reverse state pass over all heads (``flashkda.bwd.state_tokens``) and the state recompute over all heads
(``flashkda.fwd.state.state_pass``) read ``w``, ``u``, ``qg``, ``kend = k e^{Γ_C - Γ}`` and ``Γ_C`` in the
forward's token layout ``[B, T, HV, D]``. ``disable_recompute=True`` keeps the forward's copies (more memory
between forward and backward); this pass rebuilds them in the backward instead, as fla's
``recompute_w_u`` does, from the raw inputs and the forward's saved inverse ``M = (I + Diag(beta) Akk)^-1``:
one program per (chunk, value head) runs the prologue's L2 norm, gate, in-chunk cumulative sum and beta sigmoid
(``flashkda.bwd.prologue``) and the two products ``w = M (beta k e^Γ)``, ``u = M (beta v)``.

Traffic per (chunk, head), bf16 with K = V = 128: reads q, k, v, g (64 KiB), beta, ``M`` (8 KiB); writes w, qg, kend
(48 KiB, bf16), u (32 KiB, fp32) and ``Γ_C``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkda.bwd.layout import ChunkLayout
from flashkda.bwd.prologue import chunk_slots, load_gate, load_qk
from flashkda.bwd.state import _dot
from flashkda.rounding import PREC_HILO, cast_for_store

__all__ = ["chunk_kda_recompute_operands"]


@triton.jit
def chunk_kda_recompute_operands_kernel(
    q, k, v, g, beta, A_log, dt_bias, tok, minv, w, u, qg, kend, gC,
    lower_bound, beta_scale, scale, NCL,
    H: tl.constexpr, HV: tl.constexpr, HS: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, USE_L2: tl.constexpr, USE_GATE: tl.constexpr,
    USE_A: tl.constexpr, USE_BIAS: tl.constexpr, USE_LB: tl.constexpr, USE_SIGMOID: tl.constexpr, PREC: tl.constexpr,
    EMULATE: tl.constexpr,
):
    # program (chunk i_c, value head i_hv); minv is [HV / HS, NCL, HS, C, C] (head i_hv in slice i_hv // HS)
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    o_s, _, _, b_tok, m_t, _, _ = chunk_slots(tok, i_c, C, K, V, BV)
    # [C]
    b_b = tl.load(beta + b_tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if USE_SIGMOID:
        b_b = tl.where(m_t, beta_scale * tl.sigmoid(b_b), 0.0)
    # [C, C]: the saved inverse; w = M (beta k e^Γ), u = M (beta v), right operands as bf16 hi/lo splits
    p_m = minv + (((i_hv // HS) * NCL + i_c).to(tl.int64) * HS + i_hv % HS) * C * C
    b_m = tl.load(p_m + o_s[:, None] * C + o_s[None, :]).to(tl.float32)
    o_k = tl.arange(0, K)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    # token-layout offsets of this head's rows, [C, K]
    p_k = (b_tok[:, None] * HV + i_hv) * K + o_k[None, :]
    b_q, b_k = load_qk(q, k, b_tok, m_tk, i_h, o_k, H, K, USE_L2)
    b_g = load_gate(g, A_log, dt_bias, lower_bound, b_tok, m_tk, i_hv, o_k, HV, K, USE_GATE, USE_A, USE_BIAS, USE_LB)
    # Γ (in-chunk cumulative gate) and Γ_C
    b_gam = tl.cumsum(b_g, axis=0)
    b_gend = tl.sum(b_g, axis=0)
    b_eg = tl.exp(b_gam)
    tl.store(qg + p_k, cast_for_store(scale * b_q * b_eg, qg.dtype.element_ty), mask=m_tk)
    tl.store(kend + p_k, cast_for_store(b_k * tl.exp(b_gend[None, :] - b_gam), kend.dtype.element_ty), mask=m_tk)
    tl.store(gC + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, b_gend)
    b_w = _dot(b_m, b_b[:, None] * b_k * b_eg, tl.zeros([C, K], dtype=tl.float32), PREC, EMULATE)
    tl.store(w + p_k, cast_for_store(b_w, w.dtype.element_ty), mask=m_tk)
    o_v = tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    p_v = (b_tok[:, None] * HV + i_hv) * V + o_v[None, :]
    b_v = tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32)
    b_u = _dot(b_m, b_b[:, None] * b_v, tl.zeros([C, BV], dtype=tl.float32), PREC, EMULATE)
    tl.store(u + p_v, cast_for_store(b_u, u.dtype.element_ty), mask=m_tv)


def chunk_kda_recompute_operands(q, k, v, g, beta, A_log, dt_bias, opts, layout: ChunkLayout, tok: torch.Tensor,
                                 minv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(w, u, qg, kend, gC)`` of every value head in the token layout, bf16 (see the module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]``: the raw inputs
            (contiguous, bf16); A_log ``[HV]``, dt_bias ``[HV * K]`` or None; opts: `flashkda.options.KDAOptions`.
        layout, tok: the chunked layout and `flashkda.bwd.prologue.slot_tokens` of it.
        minv: ``[HV / HS, NC', HS, C, C]`` the forward's saved ``(I + Diag(beta) Akk)^-1`` (``NC' >= NC``).

    Returns:
        ``w``, ``qg``, ``kend`` ``[B, T, HV, K]`` bf16, ``u`` ``[B, T, HV, V]`` fp32, ``gC`` ``[NC, HV, K]`` fp32.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NC, C = layout.num_chunks, layout.C
    if minv.dim() != 5 or minv.shape[-1] != C or minv.shape[0] * minv.shape[2] != HV or minv.shape[1] < NC:
        raise ValueError(f"minv must be [HV / HS, >= {NC}, HS, {C}, {C}] for HV={HV}, got {tuple(minv.shape)}")
    w, qg, kend = (torch.empty(B, T, HV, K, device=q.device, dtype=torch.bfloat16) for _ in range(3))
    # u stays fp32: v_new = u - w S cancels, and u rounded to bf16 tripled the fp64-reference error of dA_log and
    # dt_bias; the state pass then stores v_new in fp32 too
    u = torch.empty(B, T, HV, V, device=q.device, dtype=torch.float32)
    gC = torch.empty(NC, HV, K, device=q.device, dtype=torch.float32)
    if NC == 0:
        return w, u, qg, kend, gC
    dummy = gC
    BV = triton.next_power_of_2(V)
    chunk_kda_recompute_operands_kernel[(NC, HV)](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy, tok,
        minv, w, u, qg, kend, gC,
        float(opts.lower_bound) if opts.lower_bound is not None else 0.0, 2.0 if opts.allow_neg_eigval else 1.0,
        opts.scale, minv.shape[1],
        H=H, HV=HV, HS=minv.shape[2], C=C, K=K, V=V, BV=BV,
        USE_L2=opts.use_qk_l2norm_in_kernel, USE_GATE=opts.use_gate_in_kernel, USE_A=A_log is not None,
        USE_BIAS=dt_bias is not None, USE_LB=opts.lower_bound is not None,
        USE_SIGMOID=opts.use_beta_sigmoid_in_kernel, PREC=PREC_HILO, EMULATE=not q.is_cuda,
        num_warps=4 if K * max(K, V) <= 64 * 64 and V >= K else 8,
    )
    return w, u, qg, kend, gC
