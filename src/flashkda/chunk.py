"""Public chunked KDA: ``flashkda.chunk_kda``, argument for argument the same as fla-core 0.6.0's ``chunk_kda``."""

from __future__ import annotations

import importlib
import warnings

import torch

from flashkda import checks
from flashkda.fwd.chunk_fwd import chunk_kda_fwd

_GRAD_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def needs_grad(*tensors) -> bool:
    """True when autograd is on and any of the tensors requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Kimi Delta Attention over whole sequences (prefill), chunk-parallel Triton kernels.

    Per value head, with ``S`` the ``[K, V]`` state: ``S_t = (I - β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t-1} + β_t k_t
    v_tᵀ`` and ``o_t = S_tᵀ (scale q_t)``.

    Args:
        q: queries ``[B, T, H, K]``, bf16/fp16/fp32; any strides.
        k: keys ``[B, T, H, K]``, q's dtype.
        v: values ``[B, T, HV, V]``, q's dtype; ``HV`` a multiple of ``H`` (GVA).
        g: per-channel decay ``[B, T, HV, K]`` **in log space**; with ``use_gate_in_kernel`` the raw gate input.
        beta: ``[B, T, HV]`` write strengths (probabilities), or logits with ``use_beta_sigmoid_in_kernel``.
        scale: query scale; default ``K ** -0.5``.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), ``N`` = B or the
            number of sequences in ``cu_seqlens``; None means zeros.
        output_final_state: also return the final state (same layout, fp32); otherwise None is returned.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (eps 1e-6 under the root).
        use_gate_in_kernel: ``g`` is raw: the decay is ``-exp(A_log) * softplus(g + dt_bias)``, or with
            ``lower_bound`` set ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be None:
            ``lower_bound * sigmoid(g + dt_bias)``).
        use_beta_sigmoid_in_kernel: ``beta`` holds logits; ``sigmoid`` is applied (``2 * sigmoid`` with
            ``allow_neg_eigval``).
        allow_neg_eigval: scale beta to ``[0, 2)``; requires ``use_beta_sigmoid_in_kernel``.
        safe_gate: the gate is bounded below by -5 (with the in-kernel gate: ``lower_bound`` in ``[-5, 0)``
            required), which enables the tensor-core path for the in-sub-chunk decay.
        lower_bound: floor of the bounded gate, e.g. ``-5.0``; None selects the softplus gate.
        disable_recompute: training only: keep the forward's per-chunk states (for bf16 also the reverse state
            pass's operands) for the backward instead of recomputing them, as fla's option does; more memory
            between forward and backward (~+900 MiB at B1-T8192-H64), ~1.2 ms less per step there (H200). Ignored
            without gradients.
        return_intermediate_states: not supported (raises ValueError; fla's backend falls back).
        state_v_first: states are ``[V, K]`` per head.
        cu_seqlens: ``[N + 1]`` int32/int64 cumulative lengths for a flattened varlen batch (``B == 1``);
            empty sequences and any lengths are allowed.
        cu_seqlens_cpu: CPU copy of ``cu_seqlens``; when given, validation (and the training path's chunked layout)
            read it and the call never waits for the device. Without it the device tensor is read once per tensor
            object (`flashkda.seqlens`), so a loop that reuses its ``cu_seqlens`` waits only on the first call.
        cp_context: context parallelism is not supported (must be None).
        use_graph, max_num_seqs: accepted; every call is already free of host syncs when ``cu_seqlens_cpu`` is
            given (or while capturing), so it can be captured in a CUDA graph.
        **kwargs: ``A_log`` ``[HV]``, ``dt_bias`` ``[HV * K]`` (or ``[HV, K]``), ``chunk_size`` (32 or 64; the
            kernels always use 64, which gives the same result), ``transpose_state_layout`` (deprecated alias).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` fp32 ``[N, HV, K, V]`` (or
        V-first) if ``output_final_state`` else None.

    Raises:
        ValueError: a wrong shape, dtype, device, layout, flag combination or ``cu_seqlens``; the message names
            the argument.
        NotImplementedError: inputs require grad and ``flashkda.autograd`` is not available.

    Examples::

        >>> import torch, flashkda
        >>> B, T, H, K = 1, 300, 4, 128
        >>> q, k = (torch.randn(B, T, H, K, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        >>> v = torch.randn(B, T, H, K, dtype=torch.bfloat16, device="cuda")
        >>> g = torch.randn(B, T, H, K, dtype=torch.bfloat16, device="cuda")
        >>> beta = torch.randn(B, T, H, dtype=torch.bfloat16, device="cuda")
        >>> A_log, dt_bias = torch.zeros(H, device="cuda"), torch.zeros(H * K, device="cuda")
        >>> o, ht = flashkda.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
        ...                            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
        ...                            lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias)
        >>> # GVA: 8 value heads over 4 q/k heads
        >>> v8, g8 = torch.randn(B, T, 8, K, dtype=torch.bfloat16, device="cuda"), -torch.rand(B, T, 8, K, device="cuda")
        >>> o8, _ = flashkda.chunk_kda(q, k, v8, g8.bfloat16(), torch.rand(B, T, 8, device="cuda").bfloat16())
        >>> # varlen: three sequences (one empty) flattened into B = 1
        >>> cu = torch.tensor([0, 100, 100, 300], device="cuda")
        >>> o, ht = flashkda.chunk_kda(q, k, v, -torch.rand_like(g), beta.sigmoid(), cu_seqlens=cu,
        ...                            cu_seqlens_cpu=cu.cpu(), output_final_state=True)
    """
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`", DeprecationWarning,
                      stacklevel=2)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}")
    if cp_context is not None:
        raise ValueError("`cp_context` (context parallelism) is not supported by flashkda; call fla directly")
    if return_intermediate_states:
        raise ValueError("`return_intermediate_states` is not supported by flashkda; call fla directly")

    s = checks.check_qkvgb(q, k, v, g, beta)
    s = checks.check_cu_seqlens(s, cu_seqlens, cu_seqlens_cpu, q.device)
    checks.check_state("initial_state", initial_state, s, state_v_first, q.device)
    checks.check_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    A_log_k, dt_bias_k = checks.check_gate_params(s, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
                                                  q.device)
    scale = checks.default_scale(scale, s.K)

    if needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        try:
            autograd = importlib.import_module("flashkda.autograd")
        except ImportError as e:
            raise NotImplementedError(
                "flashkda.chunk_kda is forward-only here and an input requires grad; run it under "
                "torch.inference_mode()/no_grad() or use fla.ops.kda.chunk_kda for training"
            ) from e
        return autograd.chunk_kda_autograd(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
            disable_recompute=disable_recompute, cu_seqlens_cpu=cu_seqlens_cpu,
        )

    o, final_state, _ = chunk_kda_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), scale,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log_k, dt_bias=dt_bias_k,
    )
    return o, final_state
