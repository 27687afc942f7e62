"""K1 of the v2 forward: L2 norm, bounded gate, beta sigmoid and the 16x16 chunk matrices, written to the workspace.

The Gluon kernel lives in `flashkda.fwd.v2.prepare_kernel` and is imported on the first launch only, so
``import flashkda`` works with any Triton (or none) and on machines without a GPU.
"""

from __future__ import annotations

import functools
import math

import torch

from flashkda.fwd.v2.workspace import CHUNK, HEAD_DIMS, ChunkLayout, Workspace, allocate_workspace
from flashkda.launch import CompiledLaunch

__all__ = ["CHUNKS_PER_CTA", "prepare_fwd"]

#: Chunks per CTA of the kernel (`prepare_kernel.CB`).
CHUNKS_PER_CTA = 4


@functools.cache
def _launch() -> CompiledLaunch:
    return CompiledLaunch(_kernel_module().kda_fwd_v2_prepare_batched_kernel)


@functools.cache
def _kernel_module():
    from flashkda.fwd.v2 import prepare_kernel

    return prepare_kernel


def _check(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, layout: ChunkLayout) -> None:
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor for the Gluon prepare kernel, got device {q.device}")
    if q.dim() != 4 or q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"q must be [B, T, H, K] with K in {HEAD_DIMS}, got {tuple(q.shape)}")
    K = q.shape[-1]
    for name, x in (("q", q), ("k", k), ("g", g)):
        if x.dim() != 4 or x.shape[-1] != K or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous [B, T, heads, {K}] (q's K), got {tuple(x.shape)}")
        if x.shape[:2] != q.shape[:2] or x.device != q.device:
            raise ValueError(f"{name} {tuple(x.shape)} on {x.device} does not match q {tuple(q.shape)} on {q.device}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape[2] % q.shape[2] != 0:
        raise ValueError(f"g has {g.shape[2]} value heads, not a multiple of q's {q.shape[2]} heads")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        raise ValueError(f"q and k must be bf16, got {q.dtype} and {k.dtype}")
    if tuple(beta.shape) != tuple(g.shape[:3]) or not beta.is_contiguous():
        raise ValueError(f"beta must be contiguous {tuple(g.shape[:3])}, got {tuple(beta.shape)}")
    if layout.total_tokens != q.shape[0] * q.shape[1]:
        raise ValueError(f"layout has {layout.total_tokens} token rows, q has {q.shape[0] * q.shape[1]}")


def prepare_fwd(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                layout: ChunkLayout, lower_bound: float, A_log: torch.Tensor | None = None,
                dt_bias: torch.Tensor | None = None, ws: Workspace | None = None) -> Workspace:
    """Run K1: the workspace for raw inputs (same contract as `emulate.emulate_prepare`).

    Args:
        q, k: ``[B, T, H, K]`` bf16, ``K`` 64 or 128, contiguous, on a GPU (sm_80 or newer: mma.sync).
        g: ``[B, T, HV, K]`` raw gate (bf16 or fp32), ``HV`` a multiple of ``H`` (GVA); beta: ``[B, T, HV]``
            logits (any float dtype).
        scale: query scale.
        layout: from ``build_chunk_layout(B, T, cu_seqlens, device)``.
        lower_bound: the bounded gate's floor, in ``[-5, 0)``.
        A_log: ``[HV]`` or None; dt_bias: ``[HV * K]`` or None.
        ws: a workspace to fill (from `allocate_workspace` for the same layout, HV and K), or None to allocate one.

    Returns:
        `Workspace` with ``HV`` heads of width ``K``; every element K2 reads is written.

    Raises:
        ValueError: an input's device, shape or dtype does not fit (``K`` not 64 or 128 among them), or ``layout`` or
            ``ws`` does not match them.
    """
    _check(q, k, g, beta, layout)
    if layout.chunk != CHUNK:
        raise ValueError(f"layout must be a {CHUNK}-token chunk layout (build_chunk_layout), got {layout.chunk}-token "
                         "chunks")
    H, K = g.shape[2], g.shape[3]
    if A_log is not None and A_log.numel() != H:
        raise ValueError(f"A_log must have {H} elements (one per value head), got {tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must have {H} * {K} elements ([HV * K]), got {tuple(dt_bias.shape)}")
    if ws is None:
        ws = allocate_workspace(layout, H, q.device, head_dim=K)
    elif tuple(ws.kd.shape) != (layout.total_tokens, H, K) or tuple(ws.glast.shape) != (layout.num_chunks, H, K):
        raise ValueError(f"ws must be a workspace of {H} heads of width {K} for this layout, got kd "
                         f"{tuple(ws.kd.shape)} and glast {tuple(ws.glast.shape)}")
    if layout.num_chunks == 0 or H == 0:
        return ws
    dummy = ws.glast
    mod = _kernel_module()
    NT = layout.num_chunks
    _launch()[(-(-NT // CHUNKS_PER_CTA) * H,)](
        q, k, g, beta,
        A_log.contiguous() if A_log is not None else dummy, dt_bias.contiguous() if dt_bias is not None else dummy,
        layout.chunk_index, ws.kd, ws.qd, ws.kr, ws.inv, ws.mqk, ws.glast, ws.beta,
        float(scale), float(lower_bound) / math.log(2.0), NT, H,
        K=K, GROUP=H // q.shape[2], HAS_A_LOG=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        num_warps=int(mod.NUM_WARPS), maxnreg=int(mod.MAX_REGISTERS),
    )
    return ws
