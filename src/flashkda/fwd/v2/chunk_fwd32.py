"""The v2 forward over 32-token chunks: the chunk-32 K1 (`prepare32_fwd`) then the chunk-32 K2
(`recurrence32_fwd`); half the recurrence's serial steps of the chunk-16 path. Called by
``chunk_fwd.chunk_kda_fwd_v2`` for ``chunk_size=32`` (the default, fixed length and varlen)."""

from __future__ import annotations

import torch

from flashkda.fwd.v2.workspace32 import cached_chunk_layout32

__all__ = ["forward_c32"]


def forward_c32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                initial_state: torch.Tensor | None, output_final_state: bool, lower_bound: float,
                cu_seqlens: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                state_v_first: bool = False, cu_seqlens_cpu: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K1 c32 then K2 c32 on a call `chunk_fwd.supports_v2` accepted; ``initial_state`` contiguous, K-first
    (``[N, HV, V, K]`` with ``state_v_first``); ``cu_seqlens_cpu`` (optional) keys the cached chunk layout of an
    inference-mode ``cu_seqlens``.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, 128]`` bf16, ``final_state`` ``[N, HV, 128, 128]`` fp32 in
        ``initial_state``'s layout, or None.
    """
    from flashkda.fwd.v2.prepare32 import prepare32_fwd
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    B, T = q.shape[:2]
    layout = cached_chunk_layout32(B, T, cu_seqlens, q.device, cu_seqlens_cpu)
    ws = prepare32_fwd(q.contiguous(), k.contiguous(), g.contiguous(), beta.contiguous(), scale, layout,
                       lower_bound, A_log, dt_bias)
    return recurrence32_fwd(ws, v.contiguous(), initial_state, output_final_state, state_v_first=state_v_first)
