"""Backward of the gated intra-chunk products ``Akk``/``Aqk`` (the forward intra kernel writes the products), alone
or fused with the gate chain.

``Akk[t, i] = sum_d k_td k_id exp(G_td - G_id)`` (``i < t``) and ``Aqk[t, i] = scale * sum_d q_td k_id exp(G_td -
G_id)`` (``i <= t``) over a chunk of ``C`` tokens, with ``G`` the in-chunk cumulative log-gate. The torch versions
(`flashkda.bwd.local.gated_dot` / `gated_dot_bwd`) read and write every ``[C, K]`` operand about ten times
through exponentials, slices and concatenations; here one program per (chunk, head, 16-row block) keeps its tiles
in registers and never materialises the scaled operands. `chunk_kda_gated_dots_gates_bwd` also runs the
chain rule of the gate factors (`flashkda.bwd.gates`) in the same pass, so ``dq``, ``dk``, ``dG`` never leave the chip.

Numerics as in the torch versions: a 16x16 block below the diagonal uses the gate at the last row of its column
block as the reference (both exponentials ``<= 1``), a diagonal block its middle row. A diagonal block's scaled
operands reach ``exp(+-BC/2 * |g|)``, and ``dG = k (da - db) + ...`` subtracts its two sides, so at ``"tf32"`` its
four products run at ``"tf32x3"`` (`diagonal_precision`): the rounding of one tf32 product there is what ``dA_log``
and ``dt_bias`` (sums of ``dg`` over every token) would otherwise carry (`benchmarks/kda/tf32_emulation.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_kda_gated_dots_bwd", "chunk_kda_gated_dots_gates_bwd", "fused_gates"]

BC = 16


def diagonal_precision(dot_precision: str) -> str:
    """``tl.dot`` input precision of the diagonal-block products for the gated products' ``dot_precision``."""
    return "tf32x3" if dot_precision == "tf32" else dot_precision


@triton.jit
def _diag_block_bwd(b_q, b_k, b_g, b_rs, gam, dakk, daqk, base, base_a, i_r, o_k, C: tl.constexpr, K: tl.constexpr,
                    BC: tl.constexpr, DIAG_PRECISION: tl.constexpr):
    """``(da_kk, da_qk, db_kk, db_qk)`` ``[BC, BK]``: both sides of the diagonal block of row block ``i_r`` (``b_q``,
    ``b_k``, ``b_g`` its tiles, ``b_rs`` its dAkk row scale), gate referenced at the block's middle row, masks
    applied (dAkk strictly lower, dAqk with the diagonal)."""
    o_i = tl.arange(0, BC)
    o_r = i_r * BC + o_i
    b_ref = tl.load(gam + base + (i_r * BC + BC // 2) * K + o_k).to(tl.float32)
    b_e = tl.exp(b_g - b_ref[None, :])
    b_einv = tl.exp(b_ref[None, :] - b_g)
    p_d = base_a + o_r[:, None] * C + o_r[None, :]
    b_dakk = tl.where(o_i[:, None] > o_i[None, :], tl.load(dakk + p_d).to(tl.float32) * b_rs[:, None], 0.0)
    b_daqk = tl.where(o_i[:, None] >= o_i[None, :], tl.load(daqk + p_d).to(tl.float32), 0.0)
    b_kinv = b_k * b_einv
    # row side: d(a_t) = sum_i dA_ti b_i exp(G_t - G_i)
    b_da_kk = tl.dot(b_dakk, b_kinv, input_precision=DIAG_PRECISION) * b_e
    b_da_qk = tl.dot(b_daqk, b_kinv, input_precision=DIAG_PRECISION) * b_e
    # column side: d(b_i) = sum_t dA_ti a_t exp(G_t - G_i), with dA^T read transposed from memory (no register
    # transpose of an fp32 dot operand, see the forward kernel)
    p_dt = base_a + o_r[None, :] * C + o_r[:, None]
    b_dakk_t = tl.load(dakk + p_dt).to(tl.float32) * b_rs[None, :]
    b_dakk_t = tl.where(o_i[:, None] < o_i[None, :], b_dakk_t, 0.0)
    b_daqk_t = tl.where(o_i[:, None] <= o_i[None, :], tl.load(daqk + p_dt).to(tl.float32), 0.0)
    b_db_kk = tl.dot(b_dakk_t, b_k * b_e, input_precision=DIAG_PRECISION) * b_einv
    b_db_qk = tl.dot(b_daqk_t, b_q * b_e, input_precision=DIAG_PRECISION) * b_einv
    return b_da_kk, b_da_qk, b_db_kk, b_db_qk


@triton.jit
def _gate_chain_rows(b_dq, b_dk, b_dgam, b_carry, b_q, b_k, b_g, b_gend, p, dqg, dkg, dkend, dq, dk, dg, scale):
    """Adds the gate-factor terms of `flashkda.bwd.gates` to one row block's ``(dq, dk, dG)`` (``qg``, ``kg``,
    ``kend`` rebuilt from q, k and G), turns dG into dg by the reverse cumulative sum with ``b_carry`` (the sum over
    the later rows), stores the three at ``p`` and returns the carry for the block above."""
    b_eg = tl.exp(b_g)
    b_eend = tl.exp(b_gend[None, :] - b_g)
    b_dqg = tl.load(dqg + p).to(tl.float32)
    b_dkg = tl.load(dkg + p).to(tl.float32)
    b_dkend = tl.load(dkend + p).to(tl.float32)
    b_dq += scale * b_eg * b_dqg
    b_dk += b_eg * b_dkg + b_eend * b_dkend
    b_dgam += scale * b_q * b_eg * b_dqg + b_k * b_eg * b_dkg - b_k * b_eend * b_dkend
    b_dg = tl.cumsum(b_dgam, axis=0, reverse=True) + b_carry[None, :]
    tl.store(dq + p, b_dq.to(dq.dtype.element_ty))
    tl.store(dk + p, b_dk.to(dk.dtype.element_ty))
    tl.store(dg + p, b_dg.to(dg.dtype.element_ty))
    return b_carry + tl.sum(b_dgam, axis=0)


@triton.jit
def _gated_dots_bwd_rows(
    q, k, gam, dakk, daqk, dakk_rs, daqk_scale, i_b, i_r, i_k,
    C: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DIAG_PRECISION: tl.constexpr, HAS_RS: tl.constexpr,
):
    """``(dq, dk, dG)`` ``[BC, BK]`` of the gated products for the rows of block ``i_r`` of chunk ``i_b`` and the
    features ``i_k .. i_k + BK`` (every feature's gradient is separate; only the ``[BC, BC]`` gradient tiles are
    shared): the "row" side (t in r) sums over column blocks c <= r, the "column" side (i in r) over row blocks
    s >= r. The gradients used are dAkk[t, i] * dakk_rs[t] (row scale, when HAS_RS) and dAqk * daqk_scale; entries
    outside the masks are never read or are masked."""
    base = i_b.to(tl.int64) * C * K
    base_a = i_b.to(tl.int64) * C * C
    o_k = i_k + tl.arange(0, BK)
    o_i = tl.arange(0, BC)
    o_r = i_r * BC + o_i
    # [BC] row scale of dAkk for the rows of this block
    b_rs = tl.full([BC], 1.0, dtype=tl.float32)
    if HAS_RS:
        b_rs = tl.load(dakk_rs + i_b.to(tl.int64) * C + o_r).to(tl.float32)
    b_q = tl.load(q + base + o_r[:, None] * K + o_k[None, :]).to(tl.float32)
    b_k = tl.load(k + base + o_r[:, None] * K + o_k[None, :]).to(tl.float32)
    b_g = tl.load(gam + base + o_r[:, None] * K + o_k[None, :]).to(tl.float32)

    # diagonal block (reference = middle row): both sides at once
    b_da_kk, b_da_qk, b_db_kk, b_db_qk = _diag_block_bwd(b_q, b_k, b_g, b_rs, gam, dakk, daqk, base, base_a, i_r, o_k,
                                                         C, K, BC, DIAG_PRECISION)

    # row side, column blocks c < r (reference = last row of block c)
    for i_c in range(0, i_r):
        o_c = i_c * BC + o_i
        b_kc = tl.load(k + base + o_c[:, None] * K + o_k[None, :]).to(tl.float32)
        b_gc = tl.load(gam + base + o_c[:, None] * K + o_k[None, :]).to(tl.float32)
        b_ref = tl.load(gam + base + (i_c * BC + BC - 1) * K + o_k).to(tl.float32)
        b_kc = b_kc * tl.exp(b_ref[None, :] - b_gc)
        b_e = tl.exp(b_g - b_ref[None, :])
        p_a = o_r[:, None] * C + o_c[None, :]
        b_dakk_c = tl.load(dakk + base_a + p_a).to(tl.float32) * b_rs[:, None]
        b_da_kk += tl.dot(b_dakk_c, b_kc, input_precision=DOT_PRECISION) * b_e
        b_da_qk += tl.dot(tl.load(daqk + base_a + p_a).to(tl.float32), b_kc, input_precision=DOT_PRECISION) * b_e

    # column side, row blocks s > r (reference = last row of block r, shared by all s)
    b_ref = tl.load(gam + base + (i_r * BC + BC - 1) * K + o_k).to(tl.float32)
    b_acc_kk = tl.zeros([BC, BK], dtype=tl.float32)
    b_acc_qk = tl.zeros([BC, BK], dtype=tl.float32)
    for i_s in range(i_r + 1, C // BC):
        o_s = i_s * BC + o_i
        b_gs = tl.load(gam + base + o_s[:, None] * K + o_k[None, :]).to(tl.float32)
        b_es = tl.exp(b_gs - b_ref[None, :])
        b_ks = tl.load(k + base + o_s[:, None] * K + o_k[None, :]).to(tl.float32) * b_es
        b_qs = tl.load(q + base + o_s[:, None] * K + o_k[None, :]).to(tl.float32) * b_es
        # [BC (i in r), BC (t in s)]: dA[s, r] transposed
        p_a = o_s[None, :] * C + o_r[:, None]
        b_dakk_s = tl.load(dakk + base_a + p_a).to(tl.float32)
        if HAS_RS:
            b_dakk_s = b_dakk_s * tl.load(dakk_rs + i_b.to(tl.int64) * C + o_s).to(tl.float32)[None, :]
        b_acc_kk += tl.dot(b_dakk_s, b_ks, input_precision=DOT_PRECISION)
        b_acc_qk += tl.dot(tl.load(daqk + base_a + p_a).to(tl.float32), b_qs, input_precision=DOT_PRECISION)
    b_einv = tl.exp(b_ref[None, :] - b_g)
    b_db_kk += b_acc_kk * b_einv
    b_db_qk += b_acc_qk * b_einv

    b_da_qk = b_da_qk * daqk_scale
    b_db_qk = b_db_qk * daqk_scale
    b_dg = b_k * (b_da_kk - b_db_kk) + b_q * b_da_qk - b_k * b_db_qk
    return b_da_qk, b_da_kk + b_db_kk + b_db_qk, b_dg


@triton.jit
def chunk_kda_bwd_kernel_gated_dots(
    q,
    k,
    gam,
    dakk,
    daqk,
    dakk_rs,
    daqk_scale,
    dq,
    dk,
    dgam,
    C: tl.constexpr,
    K: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIAG_PRECISION: tl.constexpr,
    HAS_RS: tl.constexpr,
):
    # Program (chunk, block r) writes rows r of dq, dk, dgam (see _gated_dots_bwd_rows), BK features at a time.
    i_b, i_r = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BC + tl.arange(0, BC)
    for i_k in range(0, K, BK):
        b_dq, b_dk, b_dg = _gated_dots_bwd_rows(q, k, gam, dakk, daqk, dakk_rs, daqk_scale, i_b, i_r, i_k, C, K, BC,
                                               BK, DOT_PRECISION, DIAG_PRECISION, HAS_RS)
        p_o = i_b.to(tl.int64) * C * K + o_r[:, None] * K + (i_k + tl.arange(0, BK))[None, :]
        tl.store(dq + p_o, b_dq.to(dq.dtype.element_ty))
        tl.store(dk + p_o, b_dk.to(dk.dtype.element_ty))
        tl.store(dgam + p_o, b_dg.to(dgam.dtype.element_ty))


@triton.jit
def chunk_kda_bwd_kernel_gated_dots_gates_blocks(
    q,
    k,
    gam,
    dakk,
    daqk,
    dakk_rs,
    dqg,
    dkg,
    dkend,
    ddec,
    dq,
    dk,
    dg,
    scale,
    C: tl.constexpr,
    K: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIAG_PRECISION: tl.constexpr,
    HAS_RS: tl.constexpr,
):
    # Same result as chunk_kda_bwd_kernel_gated_dots_gates, one program per (chunk, BK features). The off-diagonal
    # blocks of a row block r share one gate reference per side, so each side is a single [BC, C] x [C, BK] product
    # against a masked whole-chunk operand, instead of a loop over 16-row blocks:
    #   row side (t in r, i in blocks < r): reference = the row before block r, exp(G_t - G_ref) and
    #     exp(G_ref - G_i) are both <= 1;
    #   column side (i in r, t in blocks > r): reference = the last row of block r, likewise.
    # Diagonal blocks keep the middle-row reference of _gated_dots_bwd_rows.
    i_b, i_kb = tl.program_id(0), tl.program_id(1)
    base = i_b.to(tl.int64) * C * K
    base_a = i_b.to(tl.int64) * C * C
    o_k = i_kb * BK + tl.arange(0, BK)
    o_t = tl.arange(0, C)
    o_i = tl.arange(0, BC)
    p_f = base + o_t[:, None] * K + o_k[None, :]
    # [BK] G at the chunk end: it feeds kend (every row) and dec = exp(G_C), so its gradient reaches every row of dg
    b_gend = tl.load(gam + base + (C - 1) * K + o_k).to(tl.float32)
    b_carry = tl.exp(b_gend) * tl.load(ddec + i_b.to(tl.int64) * K + o_k).to(tl.float32)
    b_kend = tl.load(k + p_f).to(tl.float32) * tl.exp(b_gend[None, :] - tl.load(gam + p_f).to(tl.float32))
    b_carry += tl.sum(b_kend * tl.load(dkend + p_f).to(tl.float32), axis=0)
    for i in range(0, C // BC):
        i_r = C // BC - 1 - i
        o_r = i_r * BC + o_i
        p = base + o_r[:, None] * K + o_k[None, :]
        b_q = tl.load(q + p).to(tl.float32)
        b_k = tl.load(k + p).to(tl.float32)
        b_g = tl.load(gam + p).to(tl.float32)
        b_rs = tl.full([BC], 1.0, dtype=tl.float32)
        if HAS_RS:
            b_rs = tl.load(dakk_rs + i_b.to(tl.int64) * C + o_r).to(tl.float32)

        # diagonal block (reference = middle row): both sides
        b_da_kk, b_da_qk, b_db_kk, b_db_qk = _diag_block_bwd(b_q, b_k, b_g, b_rs, gam, dakk, daqk, base, base_a, i_r,
                                                             o_k, C, K, BC, DIAG_PRECISION)

        if i_r > 0:
            # row side: d(a_t) += exp(G_t - G_ref) sum_{i < r BC} dA_ti k_i exp(G_ref - G_i)
            b_ref = tl.load(gam + base + (i_r * BC - 1) * K + o_k).to(tl.float32)
            # [C, BK] whole-chunk operands, reloaded per block (L1/L2): kept live across the loop they cost registers
            m_c = (o_t < i_r * BC)[:, None]
            b_gf = tl.load(gam + p_f, mask=m_c, other=0.0).to(tl.float32)
            b_x = tl.load(k + p_f, mask=m_c, other=0.0).to(tl.float32)
            b_x = b_x * tl.exp(tl.where(m_c, b_ref[None, :] - b_gf, 0.0))
            p_a = base_a + o_r[:, None] * C + o_t[None, :]
            m_a = (o_t < i_r * BC)[None, :]
            b_dakk_r = tl.load(dakk + p_a, mask=m_a, other=0.0).to(tl.float32) * b_rs[:, None]
            b_daqk_r = tl.load(daqk + p_a, mask=m_a, other=0.0).to(tl.float32)
            b_e = tl.exp(b_g - b_ref[None, :])
            b_da_kk += tl.dot(b_dakk_r, b_x, input_precision=DOT_PRECISION) * b_e
            b_da_qk += tl.dot(b_daqk_r, b_x, input_precision=DOT_PRECISION) * b_e
        if i_r < C // BC - 1:
            # column side: d(b_i) += exp(G_ref - G_i) sum_{t >= (r + 1) BC} dA_ti a_t exp(G_t - G_ref); the row scale
            # of dAkk rides on the k operand
            b_ref = tl.load(gam + base + (i_r * BC + BC - 1) * K + o_k).to(tl.float32)
            m_s = (o_t >= (i_r + 1) * BC)[:, None]
            b_gf = tl.load(gam + p_f, mask=m_s, other=0.0).to(tl.float32)
            b_es = tl.exp(tl.where(m_s, b_gf - b_ref[None, :], 0.0))
            b_zk = tl.load(k + p_f, mask=m_s, other=0.0).to(tl.float32) * b_es
            if HAS_RS:
                b_zk = b_zk * tl.load(dakk_rs + i_b.to(tl.int64) * C + o_t).to(tl.float32)[:, None]
            b_zq = tl.load(q + p_f, mask=m_s, other=0.0).to(tl.float32) * b_es
            # [BC (i in r), C (t)]: dA transposed, read straight from memory
            p_a = base_a + o_t[None, :] * C + o_r[:, None]
            m_a = (o_t >= (i_r + 1) * BC)[None, :]
            b_dakk_c = tl.load(dakk + p_a, mask=m_a, other=0.0).to(tl.float32)
            b_daqk_c = tl.load(daqk + p_a, mask=m_a, other=0.0).to(tl.float32)
            b_einv = tl.exp(b_ref[None, :] - b_g)
            b_db_kk += tl.dot(b_dakk_c, b_zk, input_precision=DOT_PRECISION) * b_einv
            b_db_qk += tl.dot(b_daqk_c, b_zq, input_precision=DOT_PRECISION) * b_einv

        b_da_qk = b_da_qk * scale
        b_db_qk = b_db_qk * scale
        b_dgam = b_k * (b_da_kk - b_db_kk) + b_q * b_da_qk - b_k * b_db_qk
        b_carry = _gate_chain_rows(b_da_qk, b_da_kk + b_db_kk + b_db_qk, b_dgam, b_carry, b_q, b_k, b_g, b_gend, p, dqg,
                                   dkg, dkend, dq, dk, dg, scale)


def _check(*xs: torch.Tensor) -> None:
    assert all(x.is_contiguous() for x in xs), "gated-dot operands must be contiguous"
    C, K = xs[0].shape[-2:]
    assert C % BC == 0 and K == triton.next_power_of_2(K) and K >= 16, f"unsupported tile C={C}, K={K}"


def chunk_kda_gated_dots_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    gam: torch.Tensor,
    dakk: torch.Tensor,
    daqk: torch.Tensor,
    *,
    dot_precision: str,
    dakk_row_scale: torch.Tensor | None = None,
    daqk_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of `chunk_kda_gated_dots`: ``(dq, dk, dgam)`` ``[..., C, K]`` from the gradients of ``Akk`` and
    ``Aqk``, which are ``dakk * dakk_row_scale[..., :, None]`` (``dakk`` alone without a row scale) and
    ``daqk * daqk_scale`` (w.r.t. the scaled ``Aqk``, times ``scale``). ``dakk``, ``daqk`` ``[..., C, C]`` and
    ``dakk_row_scale`` ``[..., C]`` fp32; entries outside the masks (``i < t``, ``i <= t``) are ignored."""
    _check(q, k, gam, dakk, daqk)
    *lead, C, K = q.shape
    nb = q.numel() // (C * K)
    has_rs = dakk_row_scale is not None
    if has_rs:
        assert dakk_row_scale.is_contiguous() and dakk_row_scale.shape == dakk.shape[:-1], "dakk_row_scale: [..., C]"
    dq, dk, dgam = torch.empty_like(q), torch.empty_like(k), torch.empty_like(gam)
    chunk_kda_bwd_kernel_gated_dots[(nb, C // BC)](
        q, k, gam, dakk, daqk, dakk_row_scale if has_rs else dakk, daqk_scale, dq, dk, dgam, C=C, K=K, BC=BC,
        # whole-K tiles, as run on the device (the fallback of the fused pass below)
        BK=K, DOT_PRECISION=dot_precision, DIAG_PRECISION=diagonal_precision(dot_precision), HAS_RS=has_rs,
        # offline sm_90 (Triton 3.9, K = 128): 4 warps 255 registers with 668 B spilled (ieee) / 0 (tf32); 8 warps
        # 255 / 148 B (ieee), 162 / 0 (tf32). Every product here has a [BC, K] result, so 8 warps tile it.
        num_warps=8 if K >= 64 else 4,
    )
    return dq, dk, dgam


def chunk_kda_gated_dots_gates_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    gam: torch.Tensor,
    dakk: torch.Tensor,
    daqk: torch.Tensor,
    dqg: torch.Tensor,
    dkg: torch.Tensor,
    dkend: torch.Tensor,
    ddec: torch.Tensor,
    *,
    scale: float,
    dot_precision: str,
    dakk_row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_kda_gated_dots_bwd` and `flashkda.bwd.gates.chunk_kda_bwd_gates` in one pass: ``(dq, dk, dg)``.

    Args:
        q, k, gam: ``[..., C, K]`` chunked queries, keys and in-chunk cumulative log-gate ``G``.
        dakk, daqk, dakk_row_scale: as in `chunk_kda_gated_dots_bwd`, with ``daqk_scale = scale``.
        dqg, dkg, dkend: ``[..., C, K]`` gradients of ``qg = scale q exp(G)``, ``kg = k exp(G)``,
            ``kend = k exp(G_C - G)``; ddec: ``[..., K]`` gradient of ``dec = exp(G_C)``.
        scale: query scale.
        dot_precision: ``tl.dot`` input precision of the gated products.

    Returns:
        ``dq``, ``dk``, ``dg`` ``[..., C, K]`` in ``q``'s dtype; ``dg`` is w.r.t. the per-token gate (``G`` is its
        in-chunk cumulative sum). Sums stay fp32: fp32 callers, whose ``dA_log`` needs ``dG`` in fp64, keep the two
        separate passes (`flashkda.bwd.local`).
    """
    _check(q, k, gam, dakk, daqk, dqg, dkg, dkend)
    *lead, C, K = q.shape
    nb = q.numel() // (C * K)
    has_rs = dakk_row_scale is not None
    if has_rs:
        assert dakk_row_scale.is_contiguous() and dakk_row_scale.shape == dakk.shape[:-1], "dakk_row_scale: [..., C]"
    assert ddec.is_contiguous() and ddec.shape == q.shape[:-2] + (K,), "ddec: [..., K]"
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(gam)
    args = (q, k, gam, dakk, daqk, dakk_row_scale if has_rs else dakk, dqg, dkg, dkend, ddec, dq, dk, dg, scale)
    BK = min(K, GATES_BWD_BK)
    chunk_kda_bwd_kernel_gated_dots_gates_blocks[(nb, K // BK)](
        *args, C=C, K=K, BC=BC, BK=BK, DOT_PRECISION=dot_precision, DIAG_PRECISION=diagonal_precision(dot_precision),
        HAS_RS=has_rs, num_warps=GATES_BWD_WARPS,
    )
    return dq, dk, dg


#: Feature slice and warps of `chunk_kda_gated_dots_gates_bwd` (measurements: docs/flashkda-performance.md).
GATES_BWD_BK = 32
GATES_BWD_WARPS = 2


def fused_gates(dot_precision: str, K: int) -> bool:
    """Whether the chain rule runs `chunk_kda_gated_dots_gates_bwd`: bf16/fp16 callers on a GPU (``"tf32"``; fp32
    callers assemble ``dG`` in fp64, see `flashkda.bwd.local`) with ``K <= 128`` (at 256 its tiles would spill)."""
    return dot_precision == "tf32" and K <= 128
