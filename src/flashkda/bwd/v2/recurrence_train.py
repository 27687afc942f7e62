"""F2 of the v2 training forward: K2 with the state checkpoint stores, on the device.

The chunk-16 or chunk-32 K2 kernel (by the workspace's chunk size) with its ``EVERY`` option on: besides ``o``
and the final state it stores, bf16, the state entering every ``every``-th chunk of each sequence
(`flashkda.bwd.v2.checkpoints` describes the layout; ``checkpoints.emulate_recurrence_train`` is its torch twin).
"""

from __future__ import annotations

import torch

from flashkda.bwd.v2.checkpoints import checkpoint_bound, checkpoint_offsets
from flashkda.fwd.v2.workspace import Workspace

__all__ = ["DEFAULT_EVERY", "recurrence_train"]

#: Chunks between checkpoints per chunk size: one checkpoint per 128 tokens (``docs/flashkda-v2-backward.md``).
DEFAULT_EVERY = {16: 8, 32: 4}


def recurrence_train(ws: Workspace, v: torch.Tensor, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, every: int | None = None, *,
                     order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                                 torch.Tensor]:
    """K2 plus the training checkpoint stores.

    Args:
        ws: K1's `Workspace`, 16- or 32-token chunks (``ws.inv.shape[-1]``).
        v: ``[B, T, H, K]`` bf16, contiguous, on a Hopper GPU; the head width ``K = V`` is 128, or 64 at 16-token
            chunks.
        initial_state: ``[N, H, K, K]`` fp32 (K-first) or None.
        output_final_state: also return the final state.
        every: chunks between checkpoints; default `DEFAULT_EVERY` of the chunk size (128 tokens).
        order: the sequences' launch order (default longest first), as K2's.

    Returns:
        ``(o, final_state, checkpoints, ck_offsets)``: ``o`` ``[B, T, H, K]`` bf16; ``final_state`` fp32 or None;
        ``checkpoints`` ``[NCK_bound, H, K, K]`` bf16, K-first, of which rows ``< ck_offsets[-1]`` are
        written (``NCK_bound`` is a static bound, `checkpoints.checkpoint_bound`, so nothing syncs with the host);
        ``ck_offsets`` ``[N + 1]`` int32 on the device, sequence ``n``'s first checkpoint row.

    Raises:
        ValueError: the workspace's chunk size is not 16 or 32, ``every`` is not a positive int, or the inputs do
            not fit K2 (its launcher's checks).
    """
    chunk = int(ws.inv.shape[-1])
    if chunk not in DEFAULT_EVERY:
        raise ValueError(f"ws must have 16- or 32-token chunks, got inv {tuple(ws.inv.shape)}")
    every = DEFAULT_EVERY[chunk] if every is None else every
    ck_offsets = ws.layout.derived(("checkpoint offsets", every, v.device),
                                   lambda: checkpoint_offsets(ws.layout, every, device=v.device).to(torch.int32))
    H, K = v.shape[2], v.shape[-1]
    checkpoints = torch.empty(checkpoint_bound(ws.layout, every), H, K, K, dtype=torch.bfloat16, device=v.device)
    kw = dict(order=order, checkpoints=checkpoints, ck_offsets=ck_offsets, every=every)
    if chunk == 16:
        from flashkda.fwd.v2.recurrence import recurrence_fwd

        o, final = recurrence_fwd(ws, v, initial_state, output_final_state, **kw)
    else:
        from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

        o, final = recurrence32_fwd(ws, v, initial_state, output_final_state, **kw)
    return o, final, checkpoints, ck_offsets
