"""K2 of the v2 forward: the serial recurrence over 16-token chunks, from K1's workspace and the values.

The Gluon kernel lives in `flashkda.fwd.v2.recurrence_kernel` and is imported on the first launch only, so
``import flashkda`` works with any Triton (or none) and on machines without a GPU.
"""

from __future__ import annotations

import functools

import torch

from flashkda.fwd.v2.workspace import CHUNK, HEAD_DIMS, Workspace, longest_first_order
from flashkda.launch import CompiledLaunch, descriptor

__all__ = ["BLOCK_V", "STAGES", "longest_first_order", "recurrence_fwd"]

#: State columns per CTA (one warpgroup per 64): at K = 128, 64 splits V in two, so H = 64 heads fill 128 CTAs; at
#: K = 64 it is the whole state (wgmma's M is at least 64).
BLOCK_V = 64
#: Shared-memory ring slots for kd/qd/kr/INV/Mqk (loads run STAGES - 1 chunks ahead of the math; 2 measured faster
#: than 3, ``docs/flashkda-v2.md``).
STAGES = 2


@functools.cache
def _kernel():
    from flashkda.fwd.v2 import recurrence_kernel

    return CompiledLaunch(recurrence_kernel.kda_fwd_v2_recurrence_kernel)


@functools.cache
def _smem_layouts(head_dim: int):
    from triton.experimental.gluon import language as gl

    return (gl.NVMMASharedLayout.get_default_for([CHUNK, head_dim], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], gl.bfloat16))


def _check(ws: Workspace, v: torch.Tensor, initial_state: torch.Tensor | None, block_v: int, stages: int,
           names: tuple[str, str] = ("v", "initial_state"), head_dims: tuple[int, ...] = HEAD_DIMS) -> None:
    v_name, s_name = names
    if not v.is_cuda:
        raise ValueError(f"{v_name} must be a CUDA tensor for the Gluon recurrence, got device {v.device}")
    if v.dtype != torch.bfloat16 or v.dim() != 4 or v.shape[-1] not in head_dims or not v.is_contiguous():
        widths = " or ".join(map(str, head_dims))
        raise ValueError(f"{v_name} must be contiguous bf16 [B, T, H, K] with K = {widths}, got {v.dtype} "
                         f"{tuple(v.shape)}")
    B, T, H, K = v.shape
    for name in ("kd", "qd", "kr"):
        if tuple(getattr(ws, name).shape) != (B * T, H, K):
            raise ValueError(f"workspace {name} {tuple(getattr(ws, name).shape)} does not match {v_name} "
                             f"{tuple(v.shape)}")
    if ws.glast.dim() != 3 or tuple(ws.glast.shape[1:]) != (H, K):
        raise ValueError(f"workspace glast {tuple(ws.glast.shape)} does not match {v_name} {tuple(v.shape)}")
    if block_v not in (64, 128) or block_v > K:
        raise ValueError(f"block_v must be 64 or 128 (64 at K = 64), got {block_v} at K = {K}")
    if stages not in (2, 3, 4):
        raise ValueError(f"stages must be 2, 3 or 4, got {stages}")
    if initial_state is not None:
        want = (ws.layout.num_seqs, H, K, K)
        if initial_state.dtype != torch.float32 or tuple(initial_state.shape) != want:
            raise ValueError(f"{s_name} must be fp32 {want}, got {initial_state.dtype} "
                             f"{tuple(initial_state.shape)}")
        if not initial_state.is_contiguous() or initial_state.device != v.device:
            raise ValueError(f"{s_name} must be contiguous and on {v_name}'s device")


def _check_checkpoints(ws: Workspace, v: torch.Tensor, checkpoints: torch.Tensor | None,
                       ck_offsets: torch.Tensor | None, every: int) -> None:
    if checkpoints is None and ck_offsets is None and every == 0:
        return
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be a positive int when checkpoints are stored, got {every!r}")
    if checkpoints is None or ck_offsets is None:
        raise ValueError("checkpoints and ck_offsets must be given together (with every)")
    H, K = v.shape[2:]
    if (checkpoints.dtype != torch.bfloat16 or checkpoints.dim() != 4
            or tuple(checkpoints.shape[1:]) != (H, K, K) or not checkpoints.is_contiguous()):
        raise ValueError(f"checkpoints must be contiguous bf16 [NCK, {H}, {K}, {K}], got "
                         f"{checkpoints.dtype} {tuple(checkpoints.shape)}")
    if ck_offsets.dtype != torch.int32 or tuple(ck_offsets.shape) != (ws.layout.num_seqs + 1,):
        raise ValueError(f"ck_offsets must be int32 [{ws.layout.num_seqs + 1}], got {ck_offsets.dtype} "
                         f"{tuple(ck_offsets.shape)}")
    if checkpoints.device != v.device or ck_offsets.device != v.device:
        raise ValueError("checkpoints and ck_offsets must be on v's device")


def recurrence_fwd(ws: Workspace, v: torch.Tensor, initial_state: torch.Tensor | None = None,
                   output_final_state: bool = False, *, order: torch.Tensor | None = None,
                   block_v: int = BLOCK_V, stages: int = STAGES, checkpoints: torch.Tensor | None = None,
                   ck_offsets: torch.Tensor | None = None, every: int = 0,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output and final state of KDA from K1's workspace (same contract as `emulate.emulate_recurrence`).

    Args:
        ws: `Workspace` written by K1 (``kd, qd, kr`` ``[T_total, H, K]`` bf16, ``inv, mqk`` ``[NT, H, 16, 16]``
            bf16, ``glast`` ``[NT, H, K]`` fp32, ``beta`` ``[T_total, H]`` fp32, and its chunk layout).
        v: ``[B, T, H, K]`` bf16 values, contiguous, on a Hopper GPU; the head width ``K = V`` is 64 or 128.
        initial_state: ``[N, H, K, K]`` fp32 (K-first) or None (zeros).
        output_final_state: also return the final state ``[N, H, K, K]`` fp32.
        order: ``[N]`` int32 order in which the sequences' CTAs are launched; default longest first when N > 1
            (the layout's ``seq_order``).
        block_v: state columns per CTA: at K = 128, 64 (two CTAs per head) or 128; at K = 64, 64.
        stages: shared-memory ring slots (2, 3 or 4).
        checkpoints, ck_offsets, every: training checkpoint stores (`flashkda.bwd.v2.recurrence_train`): the state
            entering chunk ``j`` of sequence ``n`` with ``j % every == 0`` goes to ``checkpoints[ck_offsets[n] +
            j // every]`` (bf16 ``[NCK, H, K, K]``, K-first; ``ck_offsets`` ``[N + 1]`` int32); None/0: none.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, K]`` bf16 (token rows after ``cu_seqlens[-1]`` are not written);
        ``final_state`` or None.

    Raises:
        ValueError: an argument does not fit (the message names it): ``v`` not on the GPU, not bf16 or of another
            width, a workspace, initial state or checkpoints of other shapes, ``block_v`` or ``stages`` out of
            range.
    """
    _check(ws, v, initial_state, block_v, stages)
    _check_checkpoints(ws, v, checkpoints, ck_offsets, every)
    B, T, H, V = v.shape
    K = V
    layout = ws.layout
    N = layout.num_seqs
    o = torch.empty_like(v)
    final = torch.empty(N, H, K, V, dtype=torch.float32, device=v.device) if output_final_state else None
    if N == 0:
        return o, final
    if B * T == 0 or layout.num_chunks == 0:
        if final is not None and initial_state is not None:
            final.copy_(initial_state)
        elif final is not None:
            final.zero_()
        return o, final
    tok_layout, tile_layout = _smem_layouts(K)
    T_total, NT = B * T, layout.num_chunks

    def tokens(x):
        return descriptor(x, [T_total, H * K], [H * K, 1], [CHUNK, K], tok_layout)

    def tiles(x):
        return descriptor(x, [NT * H * CHUNK, CHUNK], [CHUNK, 1], [CHUNK, CHUNK], tile_layout)

    use_order = N > 1
    if use_order and order is None:
        order = layout.seq_order
    dummy = ws.glast
    grid = (H * (V // block_v), N)
    _kernel()[grid](
        tokens(ws.kd), tokens(ws.qd), tokens(ws.kr), tiles(ws.inv), tiles(ws.mqk),
        ws.glast, ws.beta, v, o,
        initial_state if initial_state is not None else dummy, final if final is not None else dummy,
        layout.cu_seqlens, layout.seq_chunks, order if use_order else layout.seq_chunks,
        checkpoints if every else v, ck_offsets if every else layout.seq_chunks,
        H=H, K=K, BV=block_v, STAGES=stages, USE_ORDER=use_order, USE_H0=initial_state is not None,
        STORE_HT=output_final_state, EVERY=every, num_warps=block_v // 16,
    )
    return o, final
