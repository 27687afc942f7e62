"""Fused chain rule through the per-channel gate factors of one chunk, ending in ``dg``.

The chunk-local quantities depend on ``G = cumsum(g)`` through ``qg = scale * q * exp(G)``, ``kg = k * exp(G)``,
``kend = k * exp(G_C - G)`` and ``dec = exp(G_C)`` (besides the gated products, whose gradients arrive as
``dq_in, dk_in, dgam_in`` from `flashkda.bwd.gated_dots`). This kernel adds those four terms to ``dq``, ``dk`` and
``dG``, then turns ``dG`` into ``dg`` by a reverse cumulative sum, reading each operand once: the torch sequence it
replaces makes about fifteen passes over ``[NC, HV, C, K]`` tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_kda_bwd_gates"]


@triton.jit
def chunk_kda_bwd_kernel_gates(
    k,
    gam,
    qg,
    kend,
    dec,
    dq_in,
    dk_in,
    dgam_in,
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
    BK: tl.constexpr,
):
    i_b, i_k = tl.program_id(0), tl.program_id(1)
    o_c = tl.arange(0, C)
    o_k = i_k * BK + tl.arange(0, BK)
    p = i_b.to(tl.int64) * C * K + o_c[:, None] * K + o_k[None, :]
    p_vec = i_b.to(tl.int64) * K + o_k
    # [C, BK]
    b_gam = tl.load(gam + p).to(dgam_in.dtype.element_ty)
    b_gam_end = tl.load(gam + i_b.to(tl.int64) * C * K + (C - 1) * K + o_k).to(dgam_in.dtype.element_ty)
    b_eg = tl.exp(b_gam)
    b_k = tl.load(k + p).to(dgam_in.dtype.element_ty)
    b_dqg = tl.load(dqg + p).to(dgam_in.dtype.element_ty)
    b_dkg = tl.load(dkg + p).to(dgam_in.dtype.element_ty)
    b_dkend = tl.load(dkend + p).to(dgam_in.dtype.element_ty)
    b_kend = tl.load(kend + p).to(dgam_in.dtype.element_ty)

    b_dq = tl.load(dq_in + p).to(dgam_in.dtype.element_ty) + scale * b_eg * b_dqg
    b_dk = tl.load(dk_in + p).to(dgam_in.dtype.element_ty) + b_eg * b_dkg + tl.exp(b_gam_end[None, :] - b_gam) * b_dkend
    b_t = b_kend * b_dkend
    b_dgam = tl.load(dgam_in + p).to(dgam_in.dtype.element_ty) + tl.load(qg + p).to(dgam_in.dtype.element_ty) * b_dqg + b_k * b_eg * b_dkg - b_t
    # G_C also feeds kend (every row) and dec
    b_end = tl.sum(b_t, axis=0) + tl.load(dec + p_vec).to(dgam_in.dtype.element_ty) * tl.load(ddec + p_vec).to(dgam_in.dtype.element_ty)
    b_dgam = tl.where(o_c[:, None] == C - 1, b_dgam + b_end[None, :], b_dgam)
    b_dg = tl.cumsum(b_dgam, axis=0, reverse=True)
    tl.store(dq + p, b_dq.to(dq.dtype.element_ty))
    tl.store(dk + p, b_dk.to(dk.dtype.element_ty))
    tl.store(dg + p, b_dg.to(dg.dtype.element_ty))


def chunk_kda_bwd_gates(
    k: torch.Tensor,
    gam: torch.Tensor,
    qg: torch.Tensor,
    kend: torch.Tensor,
    dec: torch.Tensor,
    dq_in: torch.Tensor,
    dk_in: torch.Tensor,
    dgam_in: torch.Tensor,
    dqg: torch.Tensor,
    dkg: torch.Tensor,
    dkend: torch.Tensor,
    ddec: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dg)`` ``[..., C, K]``: the gated-product gradients plus the gate-factor terms, ``dg = revcumsum(dG)``.

    Shapes: every ``[..., C, K]`` operand contiguous; ``dec``, ``ddec`` ``[..., K]``. The terms are added and
    summed in ``dgam_in``'s dtype (fp64 for fp32 callers, see `flashkda.bwd.gated_dots.chunk_kda_gated_dots_bwd`);
    the outputs have ``k``'s dtype. ``dq`` and ``dk`` are written into ``dq_in`` and ``dk_in``, ``dg`` into
    ``dgam_in`` when that has ``k``'s dtype (each program reads its tile before writing it).
    """
    xs = (k, gam, qg, kend, dec, dq_in, dk_in, dgam_in, dqg, dkg, dkend, ddec)
    assert all(x.is_contiguous() for x in xs), "gate-chain operands must be contiguous"
    *lead, C, K = k.shape
    nb = k.numel() // (C * K)
    BK = min(K, 32)
    dq, dk, dg = (x if x.dtype == k.dtype else torch.empty_like(k) for x in (dq_in, dk_in, dgam_in))
    chunk_kda_bwd_kernel_gates[(nb, triton.cdiv(K, BK))](
        *xs, dq, dk, dg, scale, C=C, K=K, BK=BK, num_warps=4
    )
    return dq, dk, dg
