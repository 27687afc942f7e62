"""Chunk-local KDA quantities (gated intra-chunk products, the WY/UT transform) and their vector-Jacobian product.

Everything here is independent of the recurrent state, so every chunk of every head is processed at once as a
batched matrix product over the chunked layout ``[NC, HV, C, D]``. The state-dependent part of the backward lives
in ``flashkda.bwd.state``; this module turns its outputs (``h``, ``dh``, ``v_new``, ``dv_new``) into the
cotangents of the chunk-local quantities and pulls them back to ``q, k, v, g, beta``.

Numerics: the gated products ``sum_d a_td b_id exp(G_td - G_id)`` are never formed as ``exp(G_t) * exp(-G_i)``
over the whole chunk (``exp(-G)`` overflows fp32 once a chunk's decay passes ~88 nats). The chunk is cut into
16-token sub-chunks: a block below the diagonal uses the gate at the last token of its column sub-chunk as the
reference, so both factors are ``<= 1``; a diagonal block uses its middle token, so the factors stay within
``exp(8 * max|g|)`` (finite in fp32 for per-token gates down to about -10; the bounded gate ``lower_bound=-5`` is
always safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashkda.bwd.gated_dots import chunk_kda_gated_dots_bwd
from flashkda.bwd.gates import chunk_kda_bwd_gates

__all__ = [
    "SUB_CHUNK", "ChunkLocal", "chunk_local_bwd", "chunk_local_prepare", "gated_dot", "gated_dot_bwd",
    "gated_dots_and_gates_bwd",
]

SUB_CHUNK = 16


@dataclass(frozen=True)
class ChunkLocal:
    """Per-chunk quantities shared by the forward state pass and the backward; all ``[NC, HV, C, *]``."""

    qg: torch.Tensor
    """``scale * q * exp(G)``, ``[NC, HV, C, K]``."""
    aqk: torch.Tensor
    """``scale * sum_d q_td k_id exp(G_td - G_id)`` for ``i <= t`` (zero above the diagonal), ``[NC, HV, C, C]``."""
    kend: torch.Tensor
    """``k * exp(G_C - G)``, ``[NC, HV, C, K]``."""
    dec: torch.Tensor
    """``exp(G_C)``, the decay over the whole chunk, ``[NC, HV, K]``."""
    w: torch.Tensor
    """``T (k * exp(G))``, ``[NC, HV, C, K]``."""
    u: torch.Tensor
    """``T v``, ``[NC, HV, C, V]``."""
    akk: torch.Tensor
    """``sum_d k_td k_id exp(G_td - G_id)`` for ``i < t`` (zero elsewhere), ``[NC, HV, C, C]``; backward only."""
    gam: torch.Tensor
    """``G``, the in-chunk cumulative log-gate, ``[NC, HV, C, K]``; backward only."""
    kg: torch.Tensor
    """``k * exp(G)``, ``[NC, HV, C, K]``; backward only."""


def gated_dot(a: torch.Tensor, b: torch.Tensor, gam: torch.Tensor, *, strict: bool) -> torch.Tensor:
    """Lower-triangular gated products ``A[t, i] = sum_d a[t, d] b[i, d] exp(gam[t, d] - gam[i, d])``.

    Args:
        a: ``[..., C, K]`` rows (``t``); ``C`` a multiple of 16.
        b: ``[..., C, K]`` columns (``i``).
        gam: ``[..., C, K]`` in-chunk cumulative log-gate, non-increasing along ``C``.
        strict: keep only ``i < t`` (else ``i <= t``).

    Returns:
        ``[..., C, C]`` tensor, zero above (and with ``strict`` on) the diagonal.
    """
    C = a.shape[-2]
    S = SUB_CHUNK
    ns = C // S
    mask = torch.ones(S, S, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    columns = []
    for j in range(ns):
        cols = slice(j * S, (j + 1) * S)
        ref = gam[..., j * S + S // 2 : j * S + S // 2 + 1, :]
        a_j = a[..., cols, :] * torch.exp(gam[..., cols, :] - ref)
        b_j = b[..., cols, :] * torch.exp(ref - gam[..., cols, :])
        # [..., S, S]
        diag = (a_j @ b_j.transpose(-1, -2)).masked_fill(~mask, 0.0)
        parts = [diag]
        if j > 0:
            parts.insert(0, diag.new_zeros(*diag.shape[:-2], j * S, S))
        if j < ns - 1:
            ref = gam[..., (j + 1) * S - 1 : (j + 1) * S, :]
            rows = slice((j + 1) * S, C)
            a_r = a[..., rows, :] * torch.exp(gam[..., rows, :] - ref)
            b_r = b[..., cols, :] * torch.exp(ref - gam[..., cols, :])
            parts.append(a_r @ b_r.transpose(-1, -2))
        columns.append(torch.cat(parts, dim=-2))
    return torch.cat(columns, dim=-1)


def chunk_local_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float,
    gate_factors: tuple[torch.Tensor, ...] | None = None,
) -> ChunkLocal:
    """Chunk-local KDA quantities from chunked inputs (differentiable torch ops).

    Args:
        q: ``[NC, HV, C, K]`` queries (L2-normalised, GVA-expanded), fp32 or fp64.
        k: ``[NC, HV, C, K]`` keys.
        v: ``[NC, HV, C, V]`` values.
        g: ``[NC, HV, C, K]`` log-space gate per token (``<= 0``; zero on padding); not read (may be None) when
            ``gate_factors`` are given.
        beta: ``[NC, HV, C]`` write strengths (zero on padding).
        scale: query scale.
        gate_factors: ``(G, qg, kg, kend, dec)`` when already computed (the Triton prologue writes them); else
            they are computed here from ``g``.

    Returns:
        A `ChunkLocal`. Differentiable by torch autograd when called with grad enabled (torch path).
    """
    C, K = k.shape[-2:]
    if gate_factors is not None:
        gam, qg, kg, kend, dec = gate_factors
    else:
        gam = g.cumsum(-2)
        gam_end = gam[..., -1:, :]
        kg = k * torch.exp(gam)
        qg = (scale * q) * torch.exp(gam)
        kend = k * torch.exp(gam_end - gam)
        dec = torch.exp(gam_end.squeeze(-2))
    akk = gated_dot(k, k, gam, strict=True)
    aqk = gated_dot(q, k, gam, strict=False) * scale
    # (I + Diag(beta) Akk) [w, u] = Diag(beta) [k * exp(G), v]: the UT transform.
    b = beta.unsqueeze(-1)
    lhs = b * akk + torch.eye(C, dtype=k.dtype, device=k.device)
    wu = torch.linalg.solve_triangular(lhs, b * torch.cat([kg, v], dim=-1), upper=False, unitriangular=True)
    w, u = (x.contiguous() for x in wu.split([K, v.shape[-1]], dim=-1))
    return ChunkLocal(qg=qg, aqk=aqk, kend=kend, dec=dec, w=w, u=u, akk=akk, gam=gam, kg=kg)


def gated_dot_bwd(
    dA: torch.Tensor, a: torch.Tensor, b: torch.Tensor, gam: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `gated_dot` w.r.t. ``a`` and ``b`` (``gam``'s gradient is ``a * da - b * db``).

    Args:
        dA: ``[..., C, C]`` upstream gradient, already zero where `gated_dot` is zero.
        a, b, gam: as given to `gated_dot`.

    Returns:
        ``(da, db)``, each ``[..., C, K]``. Uses the same sub-chunk references as the forward, so every
        exponential stays in range.
    """
    C = a.shape[-2]
    S = SUB_CHUNK
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    for j in range(C // S):
        cols = slice(j * S, (j + 1) * S)
        ref = gam[..., j * S + S // 2 : j * S + S // 2 + 1, :]
        e_a = torch.exp(gam[..., cols, :] - ref)
        e_b = torch.exp(ref - gam[..., cols, :])
        d_jj = dA[..., cols, cols]
        da[..., cols, :] += (d_jj @ (b[..., cols, :] * e_b)) * e_a
        db[..., cols, :] += (d_jj.transpose(-1, -2) @ (a[..., cols, :] * e_a)) * e_b
        if (j + 1) * S < C:
            ref = gam[..., (j + 1) * S - 1 : (j + 1) * S, :]
            rows = slice((j + 1) * S, C)
            e_r = torch.exp(gam[..., rows, :] - ref)
            e_c = torch.exp(ref - gam[..., cols, :])
            d_rj = dA[..., rows, cols]
            da[..., rows, :] += (d_rj @ (b[..., cols, :] * e_c)) * e_r
            db[..., cols, :] += (d_rj.transpose(-1, -2) @ (a[..., rows, :] * e_r)) * e_c
    return da, db


def chunk_local_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    local: ChunkLocal,
    *,
    h: torch.Tensor,
    v_new: torch.Tensor,
    do: torch.Tensor,
    dhe: torch.Tensor,
    dv_new: torch.Tensor,
    dot_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the chunked inputs from the state-pass results (explicit chain rule, nothing recorded).

    Args:
        q, k, v, g, beta, scale: the chunked inputs `chunk_local_prepare` was called with.
        local: its result.
        h: ``[NC, HV, K, V]`` state at each chunk start.
        v_new: ``[NC, HV, C, V]`` ``u - w h``.
        do: ``[NC, HV, C, V]`` gradient of the output.
        dhe: ``[NC, HV, K, V]`` gradient w.r.t. the state at each chunk end.
        dv_new: ``[NC, HV, C, V]`` total gradient w.r.t. ``v_new``.
        dot_precision: the caller's product precision: ``"ieee"`` (fp32 callers) assembles ``dG`` in fp64.

    Returns:
        ``(dq, dk, dv, dg, dbeta)`` in the chunked layout.
    """
    C, K = k.shape[-2:]
    hT = h.transpose(-1, -2)
    # Cotangents of the chunk-local quantities: o = qg h + Aqk v_new, v_new = u - w h, h' = Diag(dec) h + kend^T v_new.
    dqg = do @ hT
    daqk = (do @ v_new.transpose(-1, -2)).tril() * scale
    dkend = v_new @ dhe.transpose(-1, -2)
    ddec = (h * dhe).sum(-1)
    dw = -(dv_new @ hT)  # v_new = u - w h

    # UT transform: (I + Diag(beta) Akk) X = Diag(beta) R with X = [w, u], R = [k * exp(G), v].
    gam, kg = local.gam, local.kg
    lhs = beta.unsqueeze(-1) * local.akk + torch.eye(C, dtype=k.dtype, device=k.device)
    y = torch.linalg.solve_triangular(lhs.transpose(-1, -2), torch.cat([dw, dv_new], dim=-1), upper=True,
                                      unitriangular=True)
    y_w, y_u = (x.contiguous() for x in y.split([K, v.shape[-1]], dim=-1))
    dkg = beta.unsqueeze(-1) * y_w
    dv = beta.unsqueeze(-1) * y_u
    dl = -(y_w @ local.w.transpose(-1, -2) + y_u @ local.u.transpose(-1, -2)).tril(-1)
    dbeta = (y_w * kg).sum(-1) + (y_u * v).sum(-1) + (dl * local.akk).sum(-1)

    # Gated products Akk (k with k) and Aqk (q with k).
    dakk = beta.unsqueeze(-1) * dl
    da, db = gated_dot_bwd(dakk, k, k, gam)
    dk = da + db
    dgam = k * (da - db)
    da, db = gated_dot_bwd(daqk, q, k, gam)
    dq = da
    dk += db
    dgam += q * da - k * db

    # Elementwise gates: qg = scale q exp(G), kg = k exp(G), kend = k exp(G_C - G), dec = exp(G_C).
    eg = torch.exp(gam)
    dq += (scale * eg) * dqg
    dgam += local.qg * dqg
    dk += eg * dkg
    dgam += kg * dkg
    dk += torch.exp(gam[..., -1:, :] - gam) * dkend
    t = local.kend * dkend
    dgam -= t
    dgam[..., -1, :] += t.sum(-2) + local.dec * ddec
    dg = dgam.flip(-2).cumsum(-2).flip(-2)  # G = cumsum(g)
    return dq, dk, dv, dg, dbeta


def gated_dots_and_gates_bwd(q, k, gam, qg, kend, dec, p, daqk, dqg, dkg, dkend, ddec, beta, scale: float,
                             dot_precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dg)`` by the two separate passes (gated-product backward, then `chunk_kda_bwd_gates`) for callers
    the fused gate chain does not serve: fp32 callers (``"ieee"``: ``dG`` assembled in fp64) and ``K > 128``.
    ``p`` is ``-dl`` before the strict-lower mask (see ``flashkda.bwd.wy``); all ``[..., C, *]`` fp32."""
    if dot_precision == "ieee":
        dq, dk, dgam = _gated_dots_bwd_fp64(q, k, gam, -beta.unsqueeze(-1) * p, scale * daqk)
    else:
        dq, dk, dgam = chunk_kda_gated_dots_bwd(
            q, k, gam, p, daqk, dot_precision=dot_precision,
            dakk_row_scale=(-beta).contiguous(), daqk_scale=scale,
        )
    return chunk_kda_bwd_gates(k, gam, qg, kend, dec, dq, dk, dgam, dqg, dkg, dkend, ddec, scale)


def _gated_dots_bwd_fp64(q, k, gam, dakk, daqk):
    """``(dq, dk, dG)`` of the gated products for exact-product (fp32) callers, assembled in fp64 by the torch oracle.

    Every pair ``(t, i)`` adds ``+x`` to ``dG_t`` and ``-x`` to ``dG_i`` on two different summation paths, and
    ``dA_log = sum_s G_s dG_s`` weights what fp32 leaves of that cancellation by cumulative gates of up to ~100
    nats: with fp32 sums ``dA_log`` exceeded the 1e-4 bound against the fp64 reference. ``dG`` stays
    fp64 for `chunk_kda_bwd_gates`, which then sums in fp64 too. (Triton's fp64 ``tl.dot`` is not relied on: not
    every Triton release lowers it on NVIDIA.)
    """
    q64, k64, g64 = q.double(), k.double(), gam.double()
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device)
    da, db = gated_dot_bwd(dakk.double().masked_fill(~mask.tril(-1), 0.0), k64, k64, g64)
    dk, dgam = da + db, k64 * (da - db)
    da, db = gated_dot_bwd(daqk.double().masked_fill(~mask.tril(), 0.0), q64, k64, g64)
    dgam += q64 * da - k64 * db
    return da.to(q.dtype), (dk + db).to(k.dtype), dgam
