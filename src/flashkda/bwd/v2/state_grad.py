"""B2 of the v2 backward: the state-gradient chain on the device, from K1's workspace and the output gradient.

The Gluon kernel (`flashkda.bwd.v2.state_grad_kernel`, K2's shape walked backwards) is imported on the first launch
only. Its torch twin is ``emulate.emulate_state_grads`` (the ``B2`` stage of ``emulate.emulate_backward``).
"""

from __future__ import annotations

import functools

import torch

from flashkda.fwd.v2.workspace import HEAD_DIM, HEAD_DIMS, Workspace

__all__ = ["STAGES_B2", "state_grad_bwd"]

#: Shared-memory ring slots (kd/qd/kr/INV/Mqk/glast tiles), as K2's.
STAGES_B2 = 2


@functools.cache
def _kernel():
    from flashkda.bwd.v2 import state_grad_kernel

    return state_grad_kernel.kda_bwd_v2_state_grad_kernel


def state_grad_bwd(ws: Workspace, do: torch.Tensor, dht: torch.Tensor | None = None, output_dh0: bool = False, *,
                   order: torch.Tensor | None = None, stages: int = STAGES_B2,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient of the state leaving every chunk, and of the initial state.

    Args:
        ws: K1's `Workspace` (16- or 32-token chunks), as K2 reads it.
        do: ``[B, T, H, K]`` bf16 gradient of the output, contiguous, on a Hopper GPU; the head width ``K = V`` is
            128, or 64 at 16-token chunks.
        dht: ``[N, H, K, K]`` fp32 gradient of the final state (K-first) or None (zeros).
        output_dh0: also return the initial state's gradient.
        order: ``[N]`` int32 launch order of the sequences; default longest first when N > 1.
        stages: shared-memory ring slots (2, 3 or 4).

    Returns:
        ``(ds, dh0)``: ``ds`` ``[NT, H, K, K]`` bf16, K-first, the gradient of the state leaving chunk ``c``
        (rows of unused varlen chunks ``>= seq_chunks[N]`` are not written); ``dh0`` ``[N, H, K, K]`` fp32 or
        None.

    Raises:
        ValueError: ``do``/``dht`` do not fit the workspace, the workspace's chunk size is not 16 or 32, the head
            width is not 64 or 128 (128 at 32-token chunks), or ``stages`` is out of range.
    """
    from flashkda.fwd.v2.recurrence import _check

    chunk = int(ws.inv.shape[-1])
    if chunk not in (16, 32):
        raise ValueError(f"ws must have 16- or 32-token chunks, got inv {tuple(ws.inv.shape)}")
    _check(ws, do, dht, 64, stages, names=("do", "dht"), head_dims=HEAD_DIMS if chunk == 16 else (HEAD_DIM,))
    B, T, H, V = do.shape
    K = V
    layout = ws.layout
    N = layout.num_seqs
    ds = torch.empty(layout.num_chunks, H, K, V, dtype=torch.bfloat16, device=do.device)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=do.device) if output_dh0 else None
    if N == 0:
        return ds, dh0
    if B * T == 0 or layout.num_chunks == 0:
        if dh0 is not None:
            dh0.copy_(dht) if dht is not None else dh0.zero_()
        return ds, dh0
    from flashkda.fwd.v2.recurrence32 import descriptors

    use_order = N > 1
    if use_order and order is None:
        order = layout.seq_order
    dummy = ws.beta
    _kernel()[(H * (V // 64), N)](
        *descriptors(ws, chunk), ws.beta, do, ds,
        dht if dht is not None else dummy, dh0 if dh0 is not None else dummy,
        layout.cu_seqlens, layout.seq_chunks, order if use_order else layout.seq_chunks,
        H=H, C=chunk, K=K, BV=64, STAGES=stages, USE_ORDER=use_order, USE_DHT=dht is not None,
        STORE_DH0=output_dh0, num_warps=4,
    )
    return ds, dh0
