"""Torch emulation of the chunk-32 v2 prepare, with the kernel's precision choices (the truth it is tested against).

The chunk-32 forward halves the recurrence's serial steps; its workspace (`workspace32`) has the chunk-16 fields
with 32x32 tiles, and the recurrence is the chunk-16 one with ``C = 32`` (``emulate.emulate_recurrence`` serves
both). What changes is the prepare's exponent range: with ``lower_bound = -5`` the in-chunk cumsum ``G`` reaches
``-231``, so ``ki = k 2^-G`` would overflow fp32. The stored ``kd = k 2^G``, ``qd = q 2^G scale`` may underflow
(harmless: a factor below ``2^-126`` of the terms it is added to), ``kr = k 2^(Glast - G)`` is at most ``k``.
``L`` and ``Mqk`` are built from 16-token halves A (tokens 0-15) and B (16-31) with a reference each::

    A: kdA = k 2^G,        kiA = k 2^-G,       qdA = q 2^G scale          (|G| <= 115)
    B: kdB = k 2^(G - r),  kiB = k 2^(r - G),  qdB = q 2^(G - r) scale    (r = G[15], |G - r| <= 115)
    cross: kiAr = k_A 2^(r - G_A) <= k
    L11 = kdA kiA^T, L22 = kdB kiB^T, L21 = kdB kiAr^T (each row times beta, strictly lower on the diagonal
    blocks); Mqk11 = qdA kiA^T, Mqk22 = qdB kiB^T, Mqk21 = qdB kiAr^T (lower on the diagonal blocks)

each operand rounded to bf16, fp32 accumulation. Every factor depends only on the gates up to its own token
(``r`` on tokens 0-15, used by half B only), so an output never depends on a later gate, not even by rounding.
``INV = (I + L)^-1 = [[A^-1, 0], [-B^-1 L21 A^-1, B^-1]]``: the diagonal blocks are chunk-16 Neumann inverses,
the lower one comes from fp16 operands with fp32 accumulation and the inner product rounded to fp16; stored bf16.
"""

from __future__ import annotations

import torch

from flashkda.fwd.v2.emulate import (
    _bf16,
    _chunk_rows,
    _store_workspace,
    emulate_recurrence,
    gate_log2,
    l2norm_fp32,
    neumann_inverse,
)
from flashkda.fwd.v2.workspace import ChunkLayout, Workspace, allocate_workspace
from flashkda.fwd.v2.workspace32 import CHUNK32, REF_TOKEN

__all__ = ["block_inverse32", "emulate_chunk_kda32", "emulate_prepare32"]

HALF = 16


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.float16).double()


def block_inverse32(L11: torch.Tensor, L21: torch.Tensor, L22: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` of the strictly lower ``[..., 32, 32]`` ``L = [[L11, 0], [L21, L22]]`` (fp32 16x16 blocks)
    as the kernel computes it: ``[[A^-1, 0], [-B^-1 (L21 A^-1), B^-1]]`` with ``A^-1 = (I + L11)^-1`` and
    ``B^-1 = (I + L22)^-1`` chunk-16 Neumann inverses, the lower block from fp16 operands (fp32 accumulation, the
    inner product rounded to fp16). Returned fp32 ``[..., 32, 32]``."""
    a_inv = neumann_inverse(L11)
    b_inv = neumann_inverse(L22)
    y = _fp16(_fp16(L21) @ _fp16(a_inv))
    x21 = -(_fp16(b_inv) @ y).float()
    top = torch.cat([a_inv, torch.zeros_like(a_inv)], -1)
    return torch.cat([top, torch.cat([x21, b_inv], -1)], -2)


def emulate_prepare32(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                      layout: ChunkLayout, lower_bound: float, A_log: torch.Tensor | None = None,
                      dt_bias: torch.Tensor | None = None) -> Workspace:
    """The chunk-32 K1 in torch: the chunk-32 workspace for raw inputs.

    Args:
        q, k: ``[B, T, Hq, 128]``; g: ``[B, T, H, 128]`` raw gate (``H`` a multiple of ``Hq``, GVA);
            beta: ``[B, T, H]`` logits; scale: query scale.
        layout: from ``workspace32.build_chunk_layout32(B, T, cu_seqlens, device)``.
        lower_bound, A_log, dt_bias: the bounded gate (``emulate.gate_log2``), ``lower_bound`` in ``[-5, 0)``.

    Returns:
        `workspace.Workspace` with ``[NT, H, 32, 32]`` tiles; rows of ``inv, mqk`` past a chunk's last token and
        surplus varlen chunks are zero.
    """
    B, T, H, K = g.shape
    if q.shape[2] != H:
        q, k = (x.repeat_interleave(H // q.shape[2], dim=2) for x in (q, k))
    device = q.device
    ws = allocate_workspace(layout, H, device, K)
    rows, valid = _chunk_rows(layout, device, CHUNK32)  # [NT, C]
    m = valid[..., None, None]
    qn = l2norm_fp32(q.reshape(B * T, H, K))[rows] * m  # [NT, C, H, K]
    kn = l2norm_fp32(k.reshape(B * T, H, K))[rows] * m
    gl = gate_log2(g.reshape(B * T, H, K), A_log, dt_bias, lower_bound)[rows] * m
    b = torch.sigmoid(beta.reshape(B * T, H).float())[rows] * valid[..., None]  # [NT, C, H]
    G = gl.cumsum(1)
    Glast = G[:, -1:]  # padded positions add zero
    kd = _bf16(kn * torch.exp2(G))
    qd = _bf16(qn * torch.exp2(G) * scale)
    kr = _bf16(kn * torch.exp2(Glast - G))

    A, Bh = slice(0, HALF), slice(HALF, CHUNK32)
    r = G[:, REF_TOKEN:REF_TOKEN + 1]
    EA, EB = G[:, A], G[:, Bh] - r
    kn_a, kn_b = kn[:, A], kn[:, Bh]
    # [NT, H, 16, K] operands of the three lower blocks
    kd_a, ki_a, qd_a = (x.transpose(1, 2) for x in (kd[:, A], _bf16(kn_a * torch.exp2(-EA)), qd[:, A]))
    kd_b, ki_b, qd_b = (_bf16(x).transpose(1, 2) for x in
                        (kn_b * torch.exp2(EB), kn_b * torch.exp2(-EB), qn[:, Bh] * torch.exp2(EB) * scale))
    ki_ar = _bf16(kn_a * torch.exp2(r - G[:, A])).transpose(1, 2)
    bh = b.transpose(1, 2)[..., None]  # [NT, H, C, 1]
    strict = torch.tril(torch.ones(HALF, HALF, dtype=torch.bool, device=device), -1)
    causal = torch.tril(torch.ones(HALF, HALF, dtype=torch.bool, device=device))
    zero = torch.zeros((), dtype=torch.float32, device=device)

    def mm(x, y):
        return x @ y.transpose(-1, -2)

    L11 = torch.where(strict, mm(kd_a, ki_a) * bh[..., A, :], zero)
    L22 = torch.where(strict, mm(kd_b, ki_b) * bh[..., Bh, :], zero)
    L21 = mm(kd_b, ki_ar) * bh[..., Bh, :]
    inv = block_inverse32(L11, L21, L22)
    m11 = torch.where(causal, mm(qd_a, ki_a), zero)
    m22 = torch.where(causal, mm(qd_b, ki_b), zero)
    mqk = torch.cat([torch.cat([m11, torch.zeros_like(m11)], -1), torch.cat([mm(qd_b, ki_ar), m22], -1)], -2)
    return _store_workspace(ws, inv, mqk, Glast, kd, qd, kr, b, rows, valid)


def emulate_chunk_kda32(q, k, v, g, beta, scale, layout, lower_bound, A_log=None, dt_bias=None, initial_state=None,
                        output_final_state=False):
    """`emulate_prepare32` then ``emulate.emulate_recurrence`` (``layout`` from ``build_chunk_layout32``); returns
    ``(o, final_state)``."""
    ws = emulate_prepare32(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias)
    return emulate_recurrence(ws, v, initial_state, output_final_state)
