"""K2 of the v2 forward: the serial recurrence over 16-token chunks, from K1's workspace and the values.

The Gluon kernel lives in `flashkda.fwd.v2.recurrence_kernel` and is imported on the first launch only, so
``import flashkda`` works with any Triton (or none) and on machines without a GPU.
"""

from __future__ import annotations

import functools

import torch

from flashkda.fwd.v2.workspace import CHUNK, HEAD_DIM, Workspace, longest_first_order

__all__ = ["BLOCK_V", "STAGES", "longest_first_order", "recurrence_fwd"]

#: State columns per CTA (one warpgroup per 64): 64 splits V in two, so H = 64 heads fill 128 CTAs.
BLOCK_V = 64
#: Shared-memory ring slots for kd/qd/kr/INV/Mqk (loads run STAGES - 1 chunks ahead of the math; 2 measured faster
#: than 3, ``docs/flashkda-v2.md``).
STAGES = 2


@functools.cache
def _kernel():
    from flashkda.fwd.v2 import recurrence_kernel

    return recurrence_kernel.kda_fwd_v2_recurrence_kernel


@functools.cache
def _smem_layouts():
    from triton.experimental.gluon import language as gl

    return (gl.NVMMASharedLayout.get_default_for([CHUNK, HEAD_DIM], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], gl.bfloat16))


def _check(ws: Workspace, v: torch.Tensor, initial_state: torch.Tensor | None, block_v: int, stages: int,
           names: tuple[str, str] = ("v", "initial_state")) -> None:
    v_name, s_name = names
    if not v.is_cuda:
        raise ValueError(f"{v_name} must be a CUDA tensor for the Gluon recurrence, got device {v.device}")
    if v.dtype != torch.bfloat16 or v.dim() != 4 or v.shape[-1] != HEAD_DIM or not v.is_contiguous():
        raise ValueError(f"{v_name} must be contiguous bf16 [B, T, H, {HEAD_DIM}], got {v.dtype} {tuple(v.shape)}")
    B, T, H, _ = v.shape
    if tuple(ws.kd.shape) != (B * T, H, HEAD_DIM):
        raise ValueError(f"workspace kd {tuple(ws.kd.shape)} does not match {v_name} {tuple(v.shape)}")
    if block_v not in (64, 128):
        raise ValueError(f"block_v must be 64 or 128, got {block_v}")
    if stages not in (2, 3, 4):
        raise ValueError(f"stages must be 2, 3 or 4, got {stages}")
    if initial_state is not None:
        want = (ws.layout.num_seqs, H, HEAD_DIM, HEAD_DIM)
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
    H = v.shape[2]
    if (checkpoints.dtype != torch.bfloat16 or checkpoints.dim() != 4
            or tuple(checkpoints.shape[1:]) != (H, HEAD_DIM, HEAD_DIM) or not checkpoints.is_contiguous()):
        raise ValueError(f"checkpoints must be contiguous bf16 [NCK, {H}, {HEAD_DIM}, {HEAD_DIM}], got "
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
        ws: `Workspace` written by K1 (``kd, qd, kr`` ``[T_total, H, 128]`` bf16, ``inv, mqk`` ``[NT, H, 16, 16]``
            bf16, ``glast`` ``[NT, H, 128]`` fp32, ``beta`` ``[T_total, H]`` fp32, and its chunk layout).
        v: ``[B, T, H, 128]`` bf16 values, contiguous, on a Hopper GPU.
        initial_state: ``[N, H, 128, 128]`` fp32 (K-first) or None (zeros).
        output_final_state: also return the final state ``[N, H, 128, 128]`` fp32.
        order: ``[N]`` int32 order in which the sequences' CTAs are launched; default longest first when N > 1
            (the layout's ``seq_order``).
        block_v: state columns per CTA, 64 (two CTAs per head) or 128.
        stages: shared-memory ring slots (2, 3 or 4).
        checkpoints, ck_offsets, every: training checkpoint stores (`flashkda.bwd.v2.recurrence_train`): the state
            entering chunk ``j`` of sequence ``n`` with ``j % every == 0`` goes to ``checkpoints[ck_offsets[n] +
            j // every]`` (bf16 ``[NCK, H, 128, 128]``, K-first; ``ck_offsets`` ``[N + 1]`` int32); None/0: none.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, 128]`` bf16 (token rows after ``cu_seqlens[-1]`` are not written);
        ``final_state`` or None.
    """
    _check(ws, v, initial_state, block_v, stages)
    _check_checkpoints(ws, v, checkpoints, ck_offsets, every)
    B, T, H, V = v.shape
    layout = ws.layout
    N = layout.num_seqs
    o = torch.empty_like(v)
    final = torch.empty(N, H, HEAD_DIM, V, dtype=torch.float32, device=v.device) if output_final_state else None
    if N == 0:
        return o, final
    if B * T == 0 or layout.num_chunks == 0:
        if final is not None and initial_state is not None:
            final.copy_(initial_state)
        elif final is not None:
            final.zero_()
        return o, final
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tok_layout, tile_layout = _smem_layouts()
    T_total, NT = B * T, layout.num_chunks

    def tokens(x):
        return TensorDescriptor(x, [T_total, H * HEAD_DIM], [H * HEAD_DIM, 1], [CHUNK, HEAD_DIM], tok_layout)

    def tiles(x):
        return TensorDescriptor(x, [NT * H * CHUNK, CHUNK], [CHUNK, 1], [CHUNK, CHUNK], tile_layout)

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
        H=H, BV=block_v, STAGES=stages, USE_ORDER=use_order, USE_H0=initial_state is not None,
        STORE_HT=output_final_state, EVERY=every, num_warps=block_v // 16,
    )
    return o, final
