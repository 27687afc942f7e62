"""K1 of the chunk-32 v2 forward: L2 norm, bounded gate, beta sigmoid and the 32x32 chunk matrices, written to the
chunk-32 workspace (`workspace32`).

The Gluon kernel lives in `flashkda.fwd.v2.prepare32_kernel` and is imported on the first launch only, so
``import flashkda`` works with any Triton (or none) and on machines without a GPU.
"""

from __future__ import annotations

import functools
import importlib
import math

import torch

from flashkda.fwd.v2.prepare import _check
from flashkda.fwd.v2.workspace import ChunkLayout, Workspace, allocate_workspace
from flashkda.fwd.v2.workspace32 import CHUNK32
from flashkda.launch import CompiledLaunch

__all__ = ["prepare32_fwd"]


@functools.cache
def _launch() -> CompiledLaunch:
    return CompiledLaunch(_kernel_module().kda_fwd_v2_prepare32_kernel)


@functools.cache
def _kernel_module():
    return importlib.import_module("flashkda.fwd.v2.prepare32_kernel")


def prepare32_fwd(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                  layout: ChunkLayout, lower_bound: float, A_log: torch.Tensor | None = None,
                  dt_bias: torch.Tensor | None = None, ws: Workspace | None = None) -> Workspace:
    """Run the chunk-32 K1 (same contract as ``emulate32.emulate_prepare32``).

    Args:
        q, k: ``[B, T, H, 128]`` bf16, contiguous, on a GPU (sm_80 or newer: mma.sync).
        g: ``[B, T, HV, 128]`` raw gate, ``HV`` a multiple of ``H`` (GVA); beta: ``[B, T, HV]`` logits.
        scale: query scale.
        layout: from ``workspace32.build_chunk_layout32(B, T, cu_seqlens, device)``.
        lower_bound: the bounded gate's floor, in ``[-5, 0)``.
        A_log: ``[HV]`` or None; dt_bias: ``[HV * 128]`` or None.
        ws: a chunk-32 workspace to fill (``allocate_workspace`` for the same layout and HV), or None.

    Returns:
        The chunk-32 `Workspace` with ``HV`` heads; every element the chunk-32 K2 reads is written.
    """
    _check(q, k, g, beta, layout)
    if layout.chunk != CHUNK32:
        raise ValueError(f"layout must be a 32-token chunk layout (build_chunk_layout32), got {layout.chunk}-token "
                         "chunks")
    H = g.shape[2]
    if ws is None:
        ws = allocate_workspace(layout, H, q.device)
    if layout.num_chunks == 0 or H == 0:
        return ws
    dummy = ws.glast
    mod = _kernel_module()
    _launch()[(layout.num_chunks * H,)](
        q, k, g, beta,
        A_log.contiguous() if A_log is not None else dummy, dt_bias.contiguous() if dt_bias is not None else dummy,
        layout.chunk_index, ws.kd, ws.qd, ws.kr, ws.inv, ws.mqk, ws.glast, ws.beta,
        float(scale), float(lower_bound) / math.log(2.0), layout.num_chunks, H,
        GROUP=H // q.shape[2], HAS_A_LOG=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        num_warps=int(mod.NUM_WARPS), maxnreg=int(mod.MAX_REGISTERS),
    )
    return ws
