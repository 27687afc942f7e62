"""The training prologue as two Triton passes: raw inputs to the chunked fp32 layout, and its backward.

Forward (`chunk_kda_prologue_fwd`): for every (chunk, value head) read the chunk's tokens once and write fp32
``[NC, HV, C, *]`` tiles of: L2-normalised q and k (of the q/k head the value head belongs to, which is the GVA
expansion), v, beta (``sigmoid`` times 1 or 2) and the factors of the log-space gate (``-exp(A_log) softplus(g +
dt_bias)`` or ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``): its in-chunk cumulative sum and the gated
copies of q and k; padding slots get zeros. Both passes can work on a slice of the value heads (whole GVA groups),
so the backward can run head slice by head slice with 1/n of the chunked intermediates alive.

Backward (`chunk_kda_prologue_bwd`): the chain rule back to the raw inputs. ``dq``/``dk`` sum the value heads of a
group and go through the L2 norm; ``dg``/``dbeta`` through the gate and the sigmoid; ``dA_log`` and ``dt_bias``
sum over tokens through per-chunk partial sums (no atomics, deterministic).

Together they replace about forty torch element-wise passes, layout copies and their autograd backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashkda.bwd.layout import ChunkLayout, to_chunks
from flashkda.ops import softplus

__all__ = [
    "RawGrads", "chunk_kda_prologue_bwd", "chunk_kda_prologue_fwd", "chunk_kda_prologue_torch", "kda_gate_torch",
    "slot_tokens",
]

L2NORM_EPS = 1e-6


def slot_tokens(layout: ChunkLayout, device: torch.device) -> torch.Tensor:
    """``[NC * C]`` int64: the flattened ``B * T`` token of every chunk slot, ``-1`` on padding (no host sync)."""
    if layout.gather_index is not None:
        idx = layout.gather_index
        return torch.where(idx == layout.T, torch.full_like(idx, -1), idx)
    C, T = layout.C, layout.T
    nt = layout.num_chunks // max(layout.B, 1)
    slot = torch.arange(layout.num_chunks * C, device=device)
    chunk, pos = slot // C, slot % C
    t = (chunk % nt) * C + pos
    return torch.where(t < T, (chunk // nt) * T + t, torch.full_like(t, -1))


@triton.jit
def chunk_slots(tok, i_c, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Chunk ``i_c``'s slots: offsets ``o_s`` ``[C]``, ``o_k`` ``[K]``, ``o_v`` ``[BV]``, the flattened token of each
    slot (0 on padding), the slot mask and the ``[C, K]`` / ``[C, BV]`` row masks."""
    o_s = tl.arange(0, C)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, BV)
    b_tok = tl.load(tok + i_c.to(tl.int64) * C + o_s)
    m_t = b_tok >= 0
    b_tok = tl.where(m_t, b_tok, 0)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    return o_s, o_k, o_v, b_tok, m_t, m_tk, m_tv


@triton.jit
def load_qk(q, k, b_tok, m_tk, i_h, o_k, H: tl.constexpr, K: tl.constexpr, USE_L2: tl.constexpr):
    """``[C, K]`` fp32 rows ``b_tok`` of q and k head ``i_h`` (zero where ``m_tk`` is off), L2-normalised with
    ``USE_L2``."""
    b_q = tl.load(q + b_tok[:, None] * H * K + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + b_tok[:, None] * H * K + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    if USE_L2:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    return b_q, b_k


@triton.jit
def load_gate(g, A_log, dt_bias, lower_bound, b_tok, m_tk, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr,
              USE_GATE: tl.constexpr, USE_A: tl.constexpr, USE_BIAS: tl.constexpr, USE_LB: tl.constexpr):
    """``[C, K]`` fp32 log-space gate of value head ``i_hv`` at rows ``b_tok`` (zero where ``m_tk`` is off): ``g`` as
    given, or with ``USE_GATE`` ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))`` (``USE_LB``) or
    ``-exp(A_log) softplus(g + dt_bias)``."""
    b_g = tl.load(g + b_tok[:, None] * HV * K + i_hv * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    if USE_GATE:
        if USE_BIAS:
            b_g = b_g + tl.load(dt_bias + i_hv * K + o_k).to(tl.float32)[None, :]
        if USE_LB:
            if USE_A:
                b_g = tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * b_g
            b_g = lower_bound * tl.sigmoid(b_g)
        else:
            b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus(b_g)
        b_g = tl.where(m_tk, b_g, 0.0)
    return b_g


@triton.jit
def chunk_kda_prologue_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, tok, qc, kc, vc, bc, gamc, qgc, kgc, kendc, decc,
    lower_bound, beta_scale, scale, hv0,
    H: tl.constexpr, HV: tl.constexpr, HVS: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, USE_L2: tl.constexpr, USE_GATE: tl.constexpr, USE_A: tl.constexpr, USE_BIAS: tl.constexpr,
    USE_LB: tl.constexpr, USE_SIGMOID: tl.constexpr, STORE_FACTORS: tl.constexpr,
):
    # value head i_hv of the raw inputs (HV heads) is head i_s of the chunked slice (HVS heads from hv0)
    i_c, i_s = tl.program_id(0), tl.program_id(1)
    i_hv = hv0 + i_s
    i_h = i_hv // (HV // H)
    o_s, o_k, o_v, b_tok, m_t, m_tk, m_tv = chunk_slots(tok, i_c, C, K, V, BV)
    out_k = (i_c.to(tl.int64) * HVS + i_s) * C * K + o_s[:, None] * K + o_k[None, :]
    out_v = (i_c.to(tl.int64) * HVS + i_s) * C * V + o_s[:, None] * V + o_v[None, :]
    # [C, K]
    b_q, b_k = load_qk(q, k, b_tok, m_tk, i_h, o_k, H, K, USE_L2)
    tl.store(qc + out_k, b_q)
    tl.store(kc + out_k, b_k)
    b_v = tl.load(v + b_tok[:, None] * HV * V + i_hv * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    tl.store(vc + out_v, b_v, mask=o_v[None, :] < V)
    b_g = load_gate(g, A_log, dt_bias, lower_bound, b_tok, m_tk, i_hv, o_k, HV, K, USE_GATE, USE_A, USE_BIAS, USE_LB)
    # gate factors of the chunk: G = cumsum(g), qg = scale q e^G, kg = k e^G, kend = k e^(G_C - G), dec = e^G_C
    b_gam = tl.cumsum(b_g, axis=0)
    b_gend = tl.sum(b_g, axis=0)
    b_eg = tl.exp(b_gam)
    tl.store(gamc + out_k, b_gam)
    tl.store(kgc + out_k, b_k * b_eg)
    if STORE_FACTORS:
        tl.store(qgc + out_k, (scale * b_q * b_eg).to(qgc.dtype.element_ty))
        tl.store(kendc + out_k, (b_k * tl.exp(b_gend[None, :] - b_gam)).to(kendc.dtype.element_ty))
        tl.store(decc + (i_c.to(tl.int64) * HVS + i_s) * K + o_k, tl.exp(b_gend))
    b_b = tl.load(beta + b_tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if USE_SIGMOID:
        b_b = tl.where(m_t, beta_scale * tl.sigmoid(b_b), 0.0)
    tl.store(bc + (i_c.to(tl.int64) * HVS + i_s) * C + o_s, b_b)


@triton.jit
def chunk_kda_prologue_bwd_kernel_vgb(
    v, g, beta, A_log, dt_bias, tok, dvc, dgc, dbc, dv, dg, dbeta, dA_part, dbias_part,
    lower_bound, beta_scale, hv0,
    HV: tl.constexpr, HVS: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_GATE: tl.constexpr, USE_A: tl.constexpr, USE_BIAS: tl.constexpr, USE_LB: tl.constexpr,
    USE_SIGMOID: tl.constexpr,
):
    i_c, i_s = tl.program_id(0), tl.program_id(1)
    i_hv = hv0 + i_s
    o_s, o_k, o_v, b_tok, m_t, m_tk, m_tv = chunk_slots(tok, i_c, C, K, V, BV)
    in_k = (i_c.to(tl.int64) * HVS + i_s) * C * K + o_s[:, None] * K + o_k[None, :]
    in_v = (i_c.to(tl.int64) * HVS + i_s) * C * V + o_s[:, None] * V + o_v[None, :]
    b_dv = tl.load(dvc + in_v, mask=o_v[None, :] < V, other=0.0)
    tl.store(dv + b_tok[:, None] * HV * V + i_hv * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)

    b_dg = tl.load(dgc + in_k)
    p_g = b_tok[:, None] * HV * K + i_hv * K + o_k[None, :]
    if USE_GATE:
        b_x = tl.load(g + p_g, mask=m_tk, other=0.0).to(tl.float32)
        if USE_BIAS:
            b_x = b_x + tl.load(dt_bias + i_hv * K + o_k).to(tl.float32)[None, :]
        if USE_LB:
            if USE_A:
                b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
                b_s = tl.sigmoid(b_a * b_x)
                b_dy = b_dg * lower_bound * b_s * (1.0 - b_s)
                b_dA = tl.sum(tl.sum(tl.where(m_tk, b_dy * b_a * b_x, 0.0), axis=1), axis=0)
                tl.store(dA_part + i_c.to(tl.int64) * HV + i_hv, b_dA)
                b_dx = b_dy * b_a
            else:
                b_s = tl.sigmoid(b_x)
                b_dx = b_dg * lower_bound * b_s * (1.0 - b_s)
        else:
            b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
            b_dA = tl.sum(tl.sum(tl.where(m_tk, -b_dg * b_a * softplus(b_x), 0.0), axis=1), axis=0)
            tl.store(dA_part + i_c.to(tl.int64) * HV + i_hv, b_dA)
            b_dx = -b_dg * b_a * tl.sigmoid(b_x)
        b_dx = tl.where(m_tk, b_dx, 0.0)
        tl.store(dbias_part + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.sum(b_dx, axis=0))
    else:
        b_dx = b_dg
    tl.store(dg + p_g, b_dx.to(dg.dtype.element_ty), mask=m_tk)

    b_db = tl.load(dbc + (i_c.to(tl.int64) * HVS + i_s) * C + o_s)
    if USE_SIGMOID:
        b_s = tl.sigmoid(tl.load(beta + b_tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32))
        b_db = b_db * beta_scale * b_s * (1.0 - b_s)
    tl.store(dbeta + b_tok * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=m_t)


@triton.jit
def chunk_kda_prologue_bwd_kernel_qk(
    q, k, tok, dqc, dkc, dq, dk, h0,
    H: tl.constexpr, HV: tl.constexpr, HVS: tl.constexpr, C: tl.constexpr, K: tl.constexpr, USE_L2: tl.constexpr,
):
    # q/k head h0 + i_s of the raw inputs; its value heads are i_s * G ... of the chunked slice (HVS heads)
    i_c, i_s = tl.program_id(0), tl.program_id(1)
    i_h = h0 + i_s
    G: tl.constexpr = HV // H
    o_s = tl.arange(0, C)
    o_k = tl.arange(0, K)
    b_tok = tl.load(tok + i_c.to(tl.int64) * C + o_s)
    m_t = b_tok >= 0
    b_tok = tl.where(m_t, b_tok, 0)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    # GVA: the q/k head feeds G value heads, so its gradient is their sum
    b_dq = tl.zeros([C, K], dtype=tl.float32)
    b_dk = tl.zeros([C, K], dtype=tl.float32)
    for i_g in range(G):
        in_k = (i_c.to(tl.int64) * HVS + i_s * G + i_g) * C * K + o_s[:, None] * K + o_k[None, :]
        b_dq += tl.load(dqc + in_k)
        b_dk += tl.load(dkc + in_k)
    p = b_tok[:, None] * H * K + i_h * K + o_k[None, :]
    if USE_L2:
        # y = x r, r = (|x|^2 + eps)^-1/2  =>  dx = r (dy - y (y . dy))
        b_x = tl.load(q + p, mask=m_tk, other=0.0).to(tl.float32)
        b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)
        b_y = b_x * b_r[:, None]
        b_dq = b_r[:, None] * (b_dq - b_y * tl.sum(b_y * b_dq, axis=1)[:, None])
        b_x = tl.load(k + p, mask=m_tk, other=0.0).to(tl.float32)
        b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)
        b_y = b_x * b_r[:, None]
        b_dk = b_r[:, None] * (b_dk - b_y * tl.sum(b_y * b_dk, axis=1)[:, None])
    tl.store(dq + p, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p, b_dk.to(dk.dtype.element_ty), mask=m_tk)


def _flags(opts, A_log, dt_bias) -> dict:
    return dict(
        USE_GATE=opts.use_gate_in_kernel,
        USE_A=A_log is not None,
        USE_BIAS=dt_bias is not None,
        USE_LB=opts.lower_bound is not None,
        USE_SIGMOID=opts.use_beta_sigmoid_in_kernel,
    )


def chunk_kda_prologue_fwd(q, k, v, g, beta, A_log, dt_bias, opts, layout: ChunkLayout, tok: torch.Tensor,
                           heads: tuple[int, int] | None = None, store_factors: bool = True):
    """Raw ``[B, T, ...]`` inputs to fp32 chunked tensors (see the module docstring).

    ``opts`` is a `flashkda.options.KDAOptions`; ``tok`` comes from `slot_tokens`. Inputs must be contiguous.
    ``heads=(hv0, hv1)`` restricts the output to value heads ``hv0 <= hv < hv1`` (whole GVA groups); default all.
    ``store_factors=False`` leaves out ``qg``, ``kend`` and ``dec`` (returned as None): only the state passes read
    them (and the unfused gate chain): a backward whose state passes already ran over all heads skips three of seven
    ``[C, K]`` writes.

    Returns:
        ``((qc, kc, vc, None, bc), (G, qg, kg, kend, dec))``: the chunked inputs ``[NC, HS, C, *]`` (``HS`` heads of
        the slice; the gate itself is not written, only its in-chunk cumulative sum ``G``) and the chunk's gate
        factors (``dec`` is ``[NC, HS, K]``), as `flashkda.bwd.local.chunk_local_prepare` takes them.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    hv0, hv1 = heads if heads is not None else (0, HV)
    HS = hv1 - hv0
    NC, C = layout.num_chunks, layout.C
    f32 = dict(device=q.device, dtype=torch.float32)
    qc, kc = (torch.empty(NC, HS, C, K, **f32) for _ in range(2))
    vc = torch.empty(NC, HS, C, V, **f32)
    bc = torch.empty(NC, HS, C, **f32)
    gam, kg = (torch.empty(NC, HS, C, K, **f32) for _ in range(2))
    qg = kend = dec = None
    if store_factors:
        qg, kend = (torch.empty(NC, HS, C, K, **f32) for _ in range(2))
        dec = torch.empty(NC, HS, K, **f32)
    dummy = qc
    chunk_kda_prologue_fwd_kernel[(NC, HS)](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy, tok,
        qc, kc, vc, bc, gam, qg if store_factors else dummy, kg, kend if store_factors else dummy,
        dec if store_factors else dummy,
        float(opts.lower_bound) if opts.lower_bound is not None else 0.0, 2.0 if opts.allow_neg_eigval else 1.0,
        opts.scale, hv0, H=H, HV=HV, HVS=HS, C=C, K=K, V=V, BV=triton.next_power_of_2(V),
        USE_L2=opts.use_qk_l2norm_in_kernel, **_flags(opts, A_log, dt_bias), STORE_FACTORS=store_factors,
        num_warps=4 if K * max(K, V) <= 64 * 64 else 8,
    )
    return (qc, kc, vc, None, bc), (gam, qg, kg, kend, dec)


@dataclass
class RawGrads:
    """Gradients of the raw inputs, filled head slice by head slice by `chunk_kda_prologue_bwd`."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_part: torch.Tensor
    """``[NC, HV]`` per-chunk partial sums of ``dA_log``."""
    dbias_part: torch.Tensor
    """``[NC, HV, K]`` per-chunk partial sums of ``ddt_bias``."""

    @classmethod
    def empty_like_inputs(cls, q, k, v, g, beta, num_chunks: int) -> RawGrads:
        K, HV = q.shape[-1], v.shape[2]
        f32 = dict(device=q.device, dtype=torch.float32)
        return cls(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
                   torch.empty_like(beta), torch.zeros(num_chunks, HV, **f32), torch.zeros(num_chunks, HV, K, **f32))

    def finish(self, A_log, dt_bias, opts) -> tuple[torch.Tensor | None, ...]:
        """``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias)`` (the last two None where there is no such input)."""
        dA_log = ddt_bias = None
        if opts.use_gate_in_kernel:
            if A_log is not None:
                dA_log = self.dA_part.sum(0).reshape(A_log.shape).to(A_log.dtype)
            if dt_bias is not None:
                ddt_bias = self.dbias_part.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
        return self.dq, self.dk, self.dv, self.dg, self.dbeta, dA_log, ddt_bias


def chunk_kda_prologue_bwd(q, k, v, g, beta, A_log, dt_bias, opts, layout: ChunkLayout, tok: torch.Tensor,
                           dqc, dkc, dvc, dgc, dbc, out: RawGrads | None = None, heads: tuple[int, int] | None = None):
    """Chain rule from the chunked gradients (of value heads ``heads``, default all) back to the raw inputs.

    With ``out`` the slice's gradients are written into it (each token and head exactly once) and ``out`` is
    returned; call `RawGrads.finish` after the last slice. Without it, all heads are expected and the finished tuple
    ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias)`` is returned in the raw inputs' shapes and dtypes (``dA_log`` /
    ``ddt_bias`` None when those inputs are None or the gate is precomputed).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    hv0, hv1 = heads if heads is not None else (0, HV)
    HS, G = hv1 - hv0, HV // H
    NC, C = layout.num_chunks, layout.C
    grads = out if out is not None else RawGrads.empty_like_inputs(q, k, v, g, beta, NC)
    dummy = dqc
    lb = float(opts.lower_bound) if opts.lower_bound is not None else 0.0
    chunk_kda_prologue_bwd_kernel_vgb[(NC, HS)](
        v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy, tok,
        dvc, dgc, dbc, grads.dv, grads.dg, grads.dbeta, grads.dA_part, grads.dbias_part, lb,
        2.0 if opts.allow_neg_eigval else 1.0, hv0,
        HV=HV, HVS=HS, C=C, K=K, V=V, BV=triton.next_power_of_2(V), **_flags(opts, A_log, dt_bias), num_warps=4,
    )
    chunk_kda_prologue_bwd_kernel_qk[(NC, HS // G)](
        q, k, tok, dqc, dkc, grads.dq, grads.dk, hv0 // G, H=H, HV=HV, HVS=HS, C=C, K=K,
        USE_L2=opts.use_qk_l2norm_in_kernel, num_warps=4,
    )
    return grads if out is not None else grads.finish(A_log, dt_bias, opts)


def kda_gate_torch(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None
) -> torch.Tensor:
    """The in-kernel KDA gate as differentiable torch ops (fla's ``fused_kda_gate`` semantics), fp32 (fp64 in).

    Args:
        g: ``[B, T, HV, K]`` raw gate input.
        A_log: ``[HV]`` or None (only with ``lower_bound``).
        dt_bias: ``[HV * K]`` or None.
        lower_bound: None for ``-exp(A_log) * softplus(g + dt_bias)``; else
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (without ``exp(A_log)`` when ``A_log`` is None).

    Returns:
        ``[B, T, HV, K]`` log-space decay, float32 (float64 for float64 ``g``).
    """
    HV, K = g.shape[-2:]
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(HV, K)
    if lower_bound is None:
        return -A_log.to(dtype).reshape(HV, 1).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.to(dtype).reshape(HV, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


def _l2norm_torch(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def chunk_kda_prologue_torch(q, k, v, g, beta, A_log, dt_bias, opts, layout: ChunkLayout):
    """`chunk_kda_prologue_fwd` as differentiable torch ops (fp64 inputs, tests): activations and GVA expansion, then
    the chunked layout ``[NC, HV, C, D]``.

    Returns:
        ``(qc, kc, vc, gc, bc)`` chunked, fp64 for fp64 inputs (else fp32), ``bc`` ``[NC, HV, C]``.
    """
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    HV = v.shape[2]
    q, k = q.to(cdt), k.to(cdt)
    if opts.use_qk_l2norm_in_kernel:
        q, k = _l2norm_torch(q), _l2norm_torch(k)
    g = kda_gate_torch(g, A_log, dt_bias, opts.lower_bound).to(cdt) if opts.use_gate_in_kernel else g.to(cdt)
    beta = beta.to(cdt)
    if opts.use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if opts.allow_neg_eigval else 1.0)
    if HV != q.shape[2]:
        q, k = q.repeat_interleave(HV // q.shape[2], dim=2), k.repeat_interleave(HV // k.shape[2], dim=2)
    qc, kc, vc, gc = (to_chunks(x, layout) for x in (q, k, v.to(cdt), g))
    bc = to_chunks(beta.unsqueeze(-1), layout).squeeze(-1)
    return qc, kc, vc, gc, bc
