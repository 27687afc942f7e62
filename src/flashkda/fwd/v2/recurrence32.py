"""K2 of the v2 forward over 32-token chunks (half the serial steps of chunk 16), from a chunk-32 workspace
(`workspace32`, written by ``emulate32.emulate_prepare32`` or a chunk-32 prepare kernel) and the values.

The Gluon kernel lives in `flashkda.fwd.v2.recurrence32_kernel` and is imported on the first launch only, so
``import flashkda`` works with any Triton (or none) and on machines without a GPU.
"""

from __future__ import annotations

import functools

import torch

from flashkda.fwd.v2.recurrence import _check, _check_checkpoints
from flashkda.fwd.v2.workspace import HEAD_DIM, Workspace
from flashkda.fwd.v2.workspace32 import CHUNK32
from flashkda.launch import CompiledLaunch, descriptor

__all__ = ["STAGES32", "descriptors", "recurrence32_fwd"]

#: Shared-memory ring slots (29 KiB each at C = 32: kd/qd/kr/INV/Mqk/glast); 2 leave room for two CTAs per SM.
STAGES32 = 2


@functools.cache
def _kernel():
    from flashkda.fwd.v2 import recurrence32_kernel

    return CompiledLaunch(recurrence32_kernel.kda_fwd_v2_recurrence32_kernel)


@functools.cache
def _smem_layouts(chunk: int, head_dim: int):
    from triton.experimental.gluon import language as gl

    return (gl.NVMMASharedLayout.get_default_for([chunk, head_dim], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([chunk, chunk], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([1, head_dim], gl.float32))


def descriptors(ws: Workspace, chunk: int) -> tuple:
    """K2's six TMA descriptors of a workspace of ``chunk``-token chunks and head width ``K`` (``ws.kd``'s last
    dimension, 64 or 128): ``kd, qd, kr`` (``[chunk, K]`` token tiles), ``inv, mqk`` (``[chunk, chunk]`` chunk
    tiles) and ``glast`` (one ``[1, K]`` row per chunk and head)."""
    T_total, H, K = ws.kd.shape
    tok_layout, tile_layout, g_layout = _smem_layouts(chunk, K)
    NT = ws.layout.num_chunks

    def tokens(x):
        return descriptor(x, [T_total, H * K], [H * K, 1], [chunk, K], tok_layout)

    def tiles(x):
        return descriptor(x, [NT * H * chunk, chunk], [chunk, 1], [chunk, chunk], tile_layout)

    glast = descriptor(ws.glast, [NT * H, K], [K, 1], [1, K], g_layout)
    return tokens(ws.kd), tokens(ws.qd), tokens(ws.kr), tiles(ws.inv), tiles(ws.mqk), glast


def recurrence32_fwd(ws: Workspace, v: torch.Tensor, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, *, order: torch.Tensor | None = None,
                     stages: int = STAGES32, checkpoints: torch.Tensor | None = None,
                     ck_offsets: torch.Tensor | None = None, every: int = 0, state_v_first: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output and final state of KDA from a chunk-32 workspace (contract of ``emulate.emulate_recurrence``).

    Args:
        ws: chunk-32 `Workspace` (``kd, qd, kr`` ``[T_total, H, 128]`` bf16, ``inv, mqk`` ``[NT, H, 32, 32]`` bf16,
            ``glast`` ``[NT, H, 128]`` fp32, ``beta`` ``[T_total, H]`` fp32, layout from ``build_chunk_layout32``).
        v: ``[B, T, H, 128]`` bf16 values, contiguous, on a Hopper GPU (head width 128 only: K = 64 runs at
            16-token chunks, `flashkda.fwd.v2.recurrence`).
        initial_state: ``[N, H, 128, 128]`` fp32, contiguous, K-first (``[N, H, V, K]`` with ``state_v_first``),
            or None (zeros).
        output_final_state: also return the final state ``[N, H, 128, 128]`` fp32 (in ``initial_state``'s layout).
        order: ``[N]`` int32 launch order of the sequences; default longest first when N > 1.
        stages: shared-memory ring slots (2, 3 or 4).
        checkpoints, ck_offsets, every: training checkpoint stores, as ``recurrence.recurrence_fwd``'s.
        state_v_first: the states are ``[V, K]`` per head (read and written in place, no transposed copy).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, 128]`` bf16 (rows after ``cu_seqlens[-1]`` are not written);
        ``final_state`` or None.

    Raises:
        ValueError: an argument does not fit (the message names it), as ``recurrence.recurrence_fwd``'s, or ``v``
            is not 128 wide.
    """
    _check(ws, v, initial_state, 64, stages, head_dims=(HEAD_DIM,))
    _check_checkpoints(ws, v, checkpoints, ck_offsets, every)
    if tuple(ws.inv.shape[-2:]) != (CHUNK32, CHUNK32):
        raise ValueError(f"ws must be a chunk-32 workspace (inv [NT, H, 32, 32]), got inv {tuple(ws.inv.shape)}")
    B, T, H, V = v.shape
    layout = ws.layout
    N = layout.num_seqs
    o = torch.empty_like(v)
    final = torch.empty(N, H, HEAD_DIM, V, dtype=torch.float32, device=v.device) if output_final_state else None
    if N == 0:
        return o, final
    if B * T == 0 or layout.num_chunks == 0:
        if final is not None:
            final.copy_(initial_state) if initial_state is not None else final.zero_()
        return o, final
    if order is None and N > 1:
        order = layout.seq_order
    dummy = ws.beta
    _kernel()[(H * 2, N)](
        *descriptors(ws, CHUNK32), ws.beta, v, o,
        initial_state if initial_state is not None else dummy, final if final is not None else dummy,
        layout.cu_seqlens, layout.seq_chunks, order if order is not None else layout.seq_chunks,
        checkpoints if every else v, ck_offsets if every else layout.seq_chunks,
        H=H, C=CHUNK32, BV=64, STAGES=stages, USE_ORDER=order is not None, USE_H0=initial_state is not None,
        STORE_HT=output_final_state, EVERY=every, num_warps=4, STATE_V_FIRST=state_v_first,
    )
    return o, final
