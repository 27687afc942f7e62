"""``flashkda.fwd``: the call signature of MoonshotAI's CUTLASS FlashKDA, served by our Triton kernels.

MoonshotAI's ``flash_kda.fwd`` always fuses the q/k L2 norm, the beta sigmoid and the KDA gate, keeps states
V-first (``[N, HV, V, K]``) and writes into caller-provided buffers; fla's own adapter
(``fla/ops/kda/backends/flash_kda.py``) shows the contract. Code written against it can switch imports.
"""

from __future__ import annotations

import torch

from flashkda import checks
from flashkda.chunk import needs_grad
from flashkda.fwd.chunk_fwd import chunk_kda_fwd


def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    out: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    initial_state: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashKDA forward into caller buffers (inference only).

    Args:
        q, k: raw ``[B, T, H, K]`` (L2-normalised in the kernel).
        v: ``[B, T, HV, V]``.
        g: raw gate input ``[B, T, HV, K]``; the decay is ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
            when ``lower_bound`` is set (``[-5, 0)``, tensor-core path), else ``-exp(A_log) * softplus(g + dt_bias)``.
        beta: ``[B, T, HV]`` logits (sigmoid in the kernel).
        scale: query scale; None means ``K ** -0.5``.
        out: contiguous ``[B, T, HV, V]`` output buffer, q's dtype; written in place.
        A_log: ``[HV]`` or None (only with ``lower_bound``).
        dt_bias: ``[HV, K]`` or ``[HV * K]`` or None.
        lower_bound: bounded-gate floor or None.
        initial_state: fp32 ``[N, HV, V, K]`` (V-first) or None.
        final_state: contiguous fp32 ``[N, HV, V, K]`` buffer to receive the final state, or None.
        cu_seqlens: ``[N + 1]`` cumulative lengths (``B == 1``) or None.

    Returns:
        ``out``.

    Raises:
        ValueError: bad shapes, dtypes, devices or buffers (the message names the argument).
    """
    s = checks.check_qkvgb(q, k, v, g, beta)
    s = checks.check_cu_seqlens(s, cu_seqlens, None, q.device)
    checks.check_state("initial_state", initial_state, s, True, q.device)
    checks.check_state("final_state", final_state, s, True, q.device)
    safe = lower_bound is not None
    A_log, dt_bias = checks.check_gate_params(s, True, A_log, dt_bias, lower_bound, safe, q.device)
    if not isinstance(out, torch.Tensor) or out.shape != v.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"`out` must be a contiguous {q.dtype} tensor of v's shape {list(v.shape)}")
    if final_state is not None and not final_state.is_contiguous():
        raise ValueError("`final_state` must be contiguous")
    if needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        raise ValueError("`flashkda.fwd` is inference-only; inputs require grad (use flashkda.chunk_kda)")
    chunk_kda_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        checks.default_scale(scale, s.K),
        initial_state=None if initial_state is None else initial_state.contiguous(),
        output_final_state=final_state is not None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, safe_gate=safe, lower_bound=lower_bound, state_v_first=True,
        cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, out=out, final_state=final_state,
    )
    return out
