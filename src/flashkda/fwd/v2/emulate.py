"""Torch emulation of the v2 kernels, with their precision choices; the truth that the Gluon kernels are tested against.

Runs on any device. K1 (`emulate_prepare`) and K2 (`emulate_recurrence`) exchange the same `Workspace` as the
kernels do, so either kernel can be checked alone against the emulation of the other.

Precision, as in the kernels:
- K1: q, k L2-normed in fp32; gate ``lower_bound * sigmoid(x)`` in fp32 with ``exp2``, in log2 units, cumsum in fp32
  per chunk; ``kd, qd, kr, ki`` rounded to bf16; ``kd ki^T`` and ``qd ki^T`` from bf16 operands with fp32
  accumulation; the Neumann product ``(I - L)(I + L^2)(I + L^4)(I + L^8)`` from fp16 operands with fp32
  accumulation, each partial product rounded to fp16 before it is used again, the result stored as bf16.
- K2: the state is fp32; it enters products as a bf16 operand; ``u = kd S`` accumulates in fp32;
  ``(v - u) * beta`` in fp32, rounded to bf16; ``U = INV (...)``, ``o = qd S + Mqk U`` and ``kr^T U`` accumulate in
  fp32 from bf16 operands; ``o`` is stored as bf16.
"""

from __future__ import annotations

import math

import torch

from flashkda.fwd.v2.workspace import CHUNK, ChunkLayout, Workspace, allocate_workspace

__all__ = ["LOG2E", "emulate_chunk_kda", "emulate_prepare", "emulate_recurrence", "gate_log2", "l2norm_fp32"]

LOG2E = 1.0 / math.log(2.0)
L2NORM_EPS = 1e-6


def l2norm_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gate_log2(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
              lower_bound: float) -> torch.Tensor:
    """The bounded gate in log2 units, fp32: ``lower_bound * log2(e) * sigmoid(exp(A_log) * (g + dt_bias))``.

    Args:
        g: ``[..., H, K]`` raw gate.
        A_log: ``[H]`` or None (then no ``exp(A_log)`` factor).
        dt_bias: ``[H * K]`` or None.
        lower_bound: the floor of the gate in nats, in ``[-5, 0)``.

    Returns:
        ``[..., H, K]`` fp32, in ``[lower_bound * log2(e), 0]``.
    """
    H, K = g.shape[-2:]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(H, K)
    if A_log is not None:
        x = torch.exp2(A_log.float().reshape(H, 1) * LOG2E) * x
    sig = 1.0 / (1.0 + torch.exp2(-x * LOG2E))
    return (lower_bound * LOG2E) * sig


def _chunk_rows(layout: ChunkLayout, device: torch.device, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Token row of each (chunk, position) ``[NT, chunk]`` (clamped into range) and its validity mask."""
    ci = layout.chunk_index.to(device).long()
    pos = torch.arange(chunk, device=device)
    valid = pos[None, :] < ci[:, 2:3]
    rows = torch.where(valid, ci[:, 1:2] + pos[None, :], torch.zeros_like(valid, dtype=torch.long))
    return rows, valid


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def neumann_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` of strictly lower ``[..., 16, 16]`` fp32 ``L`` as the kernel computes it (fp16 operands, fp32
    accumulation, partial products rounded to fp16); returned in fp32 (the kernel stores it as bf16)."""
    # products in fp64 (exact for fp16 operands, and immune to a TF32 setting), rounded as the kernel's fp32 sums
    eye = torch.eye(CHUNK, dtype=torch.float64, device=L.device)

    def fp16(x):
        return x.float().to(torch.float16).double()

    L1 = fp16(L)
    L2 = fp16(L1 @ L1)
    L4 = fp16(L2 @ L2)
    L8 = fp16(L4 @ L4)
    X = fp16((eye - L1) @ (eye + L2))
    X = fp16(X @ (eye + L4))
    return (X @ (eye + L8)).float()


def emulate_prepare(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                    layout: ChunkLayout, lower_bound: float, A_log: torch.Tensor | None = None,
                    dt_bias: torch.Tensor | None = None) -> Workspace:
    """K1 in torch: the workspace for raw inputs.

    Args:
        q, k: ``[B, T, Hq, 128]`` (any float dtype; the kernel takes bf16).
        g: ``[B, T, H, 128]`` raw gate, ``H`` a multiple of ``Hq`` (GVA); beta: ``[B, T, H]`` logits.
        scale: query scale.
        layout: from ``build_chunk_layout(B, T, cu_seqlens, device)``.
        lower_bound, A_log, dt_bias: the bounded gate (see `gate_log2`).

    Returns:
        `Workspace` with ``H`` (value) heads (every element that K2 reads is written; surplus varlen chunks are zero).
    """
    B, T, H, K = g.shape
    if q.shape[2] != H:  # GVA: H / Hq value heads share a q/k head
        q, k = (x.repeat_interleave(H // q.shape[2], dim=2) for x in (q, k))
    device = q.device
    ws = allocate_workspace(layout, H, device, K)
    rows, valid = _chunk_rows(layout, device)  # [NT, C]
    m = valid[..., None, None]  # [NT, C, 1, 1]
    qn = l2norm_fp32(q.reshape(B * T, H, K))[rows] * m  # [NT, C, H, K]
    kn = l2norm_fp32(k.reshape(B * T, H, K))[rows] * m
    gl = gate_log2(g.reshape(B * T, H, K), A_log, dt_bias, lower_bound)[rows] * m
    b = torch.sigmoid(beta.reshape(B * T, H).float())[rows] * valid[..., None]  # [NT, C, H]
    G = gl.cumsum(1)
    Glast = G[:, -1:]  # padded positions add zero, so the last row is the last valid token's G
    kd = _bf16(kn * torch.exp2(G))
    ki32 = kn * torch.exp2(-G)
    ki = _bf16(ki32)
    qd = _bf16(qn * torch.exp2(G) * scale)
    kr = _bf16(ki32 * torch.exp2(Glast))
    # [NT, H, C, K]
    kd_h, ki_h, qd_h = (x.transpose(1, 2) for x in (kd, ki, qd))
    strict = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device), -1)
    causal = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device))
    Lm = (kd_h @ ki_h.transpose(-1, -2)) * b.transpose(1, 2)[..., None]
    Lm = torch.where(strict, Lm, torch.zeros_like(Lm))
    inv = neumann_inverse(Lm)
    mqk = torch.where(causal, qd_h @ ki_h.transpose(-1, -2), torch.zeros_like(Lm))
    return _store_workspace(ws, inv, mqk, Glast, kd, qd, kr, b, rows, valid)


def _store_workspace(ws: Workspace, inv, mqk, Glast, kd, qd, kr, b, rows, valid) -> Workspace:
    """Write one prepare's per-chunk results into ``ws``: ``inv, mqk`` ``[NT, H, C, C]``, ``Glast``
    ``[NT, 1, H, K]``, ``kd, qd, kr`` ``[NT, C, H, K]``, ``b`` ``[NT, C, H]``, at token ``rows`` ``[NT, C]`` where
    ``valid``; rows past a chunk's last token are zero."""
    row_ok = valid[:, None, :, None]  # [NT, 1, C, 1]
    ws.inv.copy_(inv * row_ok)
    ws.mqk.copy_(mqk * row_ok)
    ws.glast.copy_(torch.exp2(Glast[:, 0]) * valid[:, :1, None])
    flat = rows[valid]
    for dst, src in ((ws.kd, kd), (ws.qd, qd), (ws.kr, kr)):
        dst[flat] = src[valid].to(torch.bfloat16)
    ws.beta[flat] = b[valid]
    return ws


def emulate_recurrence(ws: Workspace, v: torch.Tensor, initial_state: torch.Tensor | None = None,
                       output_final_state: bool = False, state_hook=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K2 in torch: the output and final state from a workspace and the values.

    Args:
        ws: the workspace of `emulate_prepare` (or of the K1 kernel); chunks of ``ws.inv.shape[-1]`` tokens (16, or
            32 for the workspace of ``emulate32.emulate_prepare32``).
        v: ``[B, T, H, V]`` values (bf16 for the kernel).
        initial_state: ``[N, H, K, V]`` fp32 or None.
        output_final_state: also return the final state.
        state_hook: None, or ``state_hook(j, seqs, S)`` called before chunk ``j`` of the sequences ``seqs`` (those
            with more than ``j`` chunks) with the fp32 states ``S`` ``[n, H, K, V]`` entering it (training
            checkpoints, `flashkda.bwd.v2.checkpoints`).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` bf16; ``final_state`` ``[N, H, K, V]`` fp32 or None.
    """
    B, T, H, V = v.shape
    layout = ws.layout
    device = v.device
    N, K = layout.num_seqs, ws.kd.shape[-1]
    S = torch.zeros(N, H, K, V, dtype=torch.float32, device=device)
    if initial_state is not None:
        S = S + initial_state.float()
    o = torch.zeros(B * T, H, V, dtype=torch.bfloat16, device=device)
    rows, valid = _chunk_rows(layout, device, ws.inv.shape[-1])
    vf = v.reshape(B * T, H, V).float()
    seq_chunks = layout.seq_chunks.to("cpu").long()
    counts = seq_chunks[1:] - seq_chunks[:-1]
    for j in range(int(counts.max()) if N else 0):
        seqs = torch.nonzero(counts > j).flatten()
        if state_hook is not None:
            state_hook(j, seqs, S[seqs.to(device)])
        c = (seq_chunks[seqs] + j).to(device)
        seqs = seqs.to(device)
        r, m = rows[c], valid[c]  # [n, C]
        S0 = _bf16(S[seqs])  # [n, H, K, V]
        kd, qd, kr = (x[r].float().transpose(1, 2) for x in (ws.kd, ws.qd, ws.kr))  # [n, H, C, K]
        b = (ws.beta[r] * m[..., None]).transpose(1, 2)[..., None]  # [n, H, C, 1]
        vc = vf[r].transpose(1, 2) * m[:, None, :, None]
        u = kd @ S0
        U = _bf16(ws.inv[c].float() @ _bf16((vc - u) * b))
        oc = qd @ S0 + ws.mqk[c].float() @ U  # [n, H, C, V]
        S[seqs] = S[seqs] * ws.glast[c][..., None] + kr.transpose(-1, -2) @ U
        oc = oc.transpose(1, 2).to(torch.bfloat16)
        o[r[m]] = oc[m]
    return o.reshape(B, T, H, V), (S if output_final_state else None)


def emulate_chunk_kda(q, k, v, g, beta, scale, layout, lower_bound, A_log=None, dt_bias=None, initial_state=None,
                      output_final_state=False):
    """`emulate_prepare` then `emulate_recurrence`; arguments as theirs. Returns ``(o, final_state)``."""
    ws = emulate_prepare(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias)
    return emulate_recurrence(ws, v, initial_state, output_final_state)
