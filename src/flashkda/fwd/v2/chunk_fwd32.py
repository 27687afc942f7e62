"""The v2 forward over 32-token chunks: the chunk-32 K1 (`prepare32_fwd`) then the chunk-32 K2
(`recurrence32_fwd`); half the recurrence's serial steps of the chunk-16 forward (`chunk_fwd.chunk_kda_fwd_v2`),
for the same calls (`chunk_fwd.supports_v2`)."""

from __future__ import annotations

import torch

from flashkda.fwd.v2.chunk_fwd import v2_unsupported_reason
from flashkda.fwd.v2.workspace32 import cached_chunk_layout32

__all__ = ["chunk_kda_fwd_v2_c32"]


def chunk_kda_fwd_v2_c32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Chunked KDA forward on validated inputs over 32-token chunks (inference: nothing is saved).

    Arguments and returns as ``chunk_fwd.chunk_kda_fwd_v2`` (without ``segments``): ``(o, final_state, None)``,
    ``o`` ``[B, T, HV, 128]`` bf16, ``final_state`` ``[N, HV, 128, 128]`` fp32 or None.

    Raises:
        ValueError: the call is outside v2's scope (the message says why).
    """
    reason = v2_unsupported_reason(
        q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, A_log, dt_bias)
    if reason is not None:
        raise ValueError(f"chunk_kda_fwd_v2_c32: {reason}")
    from flashkda.fwd.v2.prepare32 import prepare32_fwd
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    B, T = q.shape[:2]
    layout = cached_chunk_layout32(B, T, cu_seqlens, q.device)
    ws = prepare32_fwd(q.contiguous(), k.contiguous(), g.contiguous(), beta.contiguous(), scale, layout,
                       lower_bound, A_log, dt_bias)
    o, final = recurrence32_fwd(ws, v.contiguous(),
                                initial_state.contiguous() if initial_state is not None else None, output_final_state)
    return o, final, None
