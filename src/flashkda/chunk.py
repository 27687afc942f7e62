"""Public chunked KDA: ``flashkda.chunk_kda`` (argument for argument fla-core 0.6.0's ``chunk_kda``) and its autograd.

`chunk_kda` validates (``flashkda.checks``) and fills defaults, then runs the forward kernels
(``flashkda.fwd.chunk_fwd``, or v2's where ``flashkda.fwd.v2.chunk_fwd.prefers_v2`` holds) directly. When an input
requires grad it trains through v2 (`chunk_kda_v2_autograd`: ``flashkda.bwd.v2.chunk_kda_v2`` at 16-token chunks)
where ``prefers_v2_training`` holds (Hopper, bf16, K = V = 64 or 128, the K3 gate flags), else through
`ChunkKDAFunction` (v1):

* forward: the forward kernels, keeping the inputs and the intra stage's ``Aqk``, ``Akk`` and solved inverse for
  the backward. ``disable_recompute=True`` trades memory for speed as fla's option does: the forward also keeps its
  per-chunk states ``h`` and ``v_new`` (and for bf16 the intra stage's ``w``, ``qg``, ``kg``), so the backward
  recomputes no state. fp64 inputs (tests) run `flashkda.bwd.chunk_bwd.chunk_kda_fwd_fp64`.
* backward: `flashkda.bwd.chunk_bwd.chunk_kda_bwd` (``chunk_kda_bwd_torch`` for fp64 inputs).

Gradients flow to ``q, k, v, g, beta, A_log, dt_bias, initial_state``, including through the final state.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from flashkda import checks
from flashkda.bwd.chunk_bwd import (
    backward_head_slices,
    chunk_kda_bwd,
    chunk_kda_bwd_torch,
    chunk_kda_fwd_fp64,
    compute_dtype,
    default_dot_precision,
    state_in,
)
from flashkda.bwd.layout import make_layout
from flashkda.fwd.chunk_fwd import chunk_kda_fwd
from flashkda.fwd.v2.chunk_fwd import TRAINING_CHUNK, chunk_kda_fwd_v2, prefers_v2, prefers_v2_training
from flashkda.options import KDAOptions

__all__ = ["ChunkKDAFunction", "KDAOptions", "chunk_kda", "chunk_kda_autograd", "chunk_kda_v2_autograd", "needs_grad"]

CHUNK_SIZE = 64


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
        lower_bound: floor of the bounded gate, negative, e.g. ``-5.0``; None selects the softplus gate.
        disable_recompute: training only: keep the forward's per-chunk states (for bf16 also the reverse state
            pass's operands) for the backward instead of recomputing them, as fla's option does: more memory
            between forward and backward, less time in the backward. Ignored without gradients; with them the call
            trains through v1 (v2 keeps its own state checkpoints).
        return_intermediate_states: not supported (raises ValueError; fla's backend falls back).
        state_v_first: states are ``[V, K]`` per head.
        cu_seqlens: ``[N + 1]`` int32/int64 cumulative lengths for a flattened varlen batch (``B == 1``);
            empty sequences and any lengths are allowed.
        cu_seqlens_cpu: CPU copy of ``cu_seqlens``; it must equal ``cu_seqlens``, which is checked by reading the
            device tensor once per tensor object (`flashkda.seqlens`; an inference-mode ``cu_seqlens``, which has no
            modification counter, once per object and ``cu_seqlens_cpu`` values; not while a CUDA graph is
            captured), so a loop or a model's layers that reuse one ``cu_seqlens`` wait only on the first call.
            Validation, the training path's chunked layout and the v2 chunk layout's cache read it.
        cp_context: context parallelism is not supported (must be None).
        use_graph, max_num_seqs: accepted; a call waits for the device only on the first sight of a ``cu_seqlens``
            (on every call for an inference-mode one without ``cu_seqlens_cpu``; never while capturing), so it can
            be captured in a CUDA graph.
        **kwargs: ``A_log`` ``[HV]``, ``dt_bias`` ``[HV * K]`` (or ``[HV, K]``), ``chunk_size`` (32 or 64; the
            kernels always use 64, which gives the same result), ``transpose_state_layout`` (deprecated alias).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` fp32 ``[N, HV, K, V]`` (or
        V-first) if ``output_final_state`` else None.

    Raises:
        ValueError: a wrong shape, dtype, device, layout, flag combination, ``lower_bound`` or ``cu_seqlens`` (or
            a ``cu_seqlens_cpu`` that differs from it); the message names the argument.
        TypeError: a keyword argument neither this signature nor fla's ``chunk_kda`` takes.

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
    checks.check_kwargs(kwargs)
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
        if prefers_v2_training(
                q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, A_log_k,
                dt_bias_k, disable_recompute=disable_recompute):
            return chunk_kda_v2_autograd(
                q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log,
                dt_bias=dt_bias)
        return chunk_kda_autograd(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
            disable_recompute=disable_recompute, cu_seqlens_cpu=cu_seqlens_cpu,
        )

    flags = dict(
        initial_state=None if initial_state is None else initial_state.contiguous(),
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log_k, dt_bias=dt_bias_k,
    )
    if prefers_v2(q, k, v, g, beta, **flags):
        o, final_state, _ = chunk_kda_fwd_v2(q, k, v, g, beta, scale, **flags, cu_seqlens_cpu=cu_seqlens_cpu)
        return o, final_state
    o, final_state, _ = chunk_kda_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), scale, **flags,
        cu_seqlens_cpu=cu_seqlens_cpu)
    return o, final_state


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    """Let torch's fp32 matmuls use TF32 tensor cores for the duration (bf16/fp16 callers only), then restore.

    The chunk-local products of a bf16 call are bf16-accurate anyway; IEEE fp32 GEMMs would run on CUDA cores at a
    fraction of the tensor-core rate. The flag is process-wide, so it is set and restored around our own work only.
    """
    matmul = torch.backends.cuda.matmul
    if precision != "tf32":
        yield
        return
    if hasattr(matmul, "fp32_precision"):
        old = matmul.fp32_precision
        matmul.fp32_precision = "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision = old
    else:
        old = matmul.allow_tf32
        matmul.allow_tf32 = True
        try:
            yield
        finally:
            matmul.allow_tf32 = old


class ChunkKDAFunction(torch.autograd.Function):
    """``(q, k, v, g, beta, A_log, dt_bias, initial_state) -> (o, final_state)`` with fla ``chunk_kda`` math."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions):
        # The chunk-local products must stay fp32 (fp64) even under autocast: they feed a triangular solve.
        with torch.autocast(q.device.type, enabled=False), _matmul_precision(opts.dot_precision):
            return ChunkKDAFunction._forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)

    @staticmethod
    def _forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions):
        B, T = q.shape[:2]
        layout = make_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device, opts.cu_seqlens_cpu)
        local = states = operands = ()
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        # the backward's head slices, fixed here: the saved chunk-local matrices are laid out slice by slice
        ctx.head_slices = backward_head_slices(layout.chunk_offsets.numel() - 1, layout.num_chunks, HV,
                                               HV // q.shape[2], layout.C, K, V, count=opts.head_slices)
        if q.dtype == torch.float64:
            o, ht = chunk_kda_fwd_fp64(q, k, v, g, beta, A_log, dt_bias, initial_state, opts, layout)
        else:
            keep = opts.disable_recompute
            # the all-heads reverse pass of a bf16 backward reads the forward's bf16 operands and its saved Aqk
            keep_operands = keep and q.dtype == torch.bfloat16
            o, ht, _, saved = chunk_kda_fwd(
                q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), opts.scale,
                initial_state=None if initial_state is None else initial_state.contiguous(),
                output_final_state=opts.output_final_state, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
                use_gate_in_kernel=opts.use_gate_in_kernel, use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel,
                allow_neg_eigval=opts.allow_neg_eigval, safe_gate=opts.safe_gate, lower_bound=opts.lower_bound,
                state_v_first=opts.state_v_first, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
                output_local=True, local_heads=ctx.head_slices[0][1] - ctx.head_slices[0][0],
                # kept states take u (hence v_new) in fp32 for accuracy (see chunk_kda_fwd_intra's fp32_u)
                output_states=keep, output_operands=keep_operands, fp32_u=keep,
            )
            local, states, operands = saved
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, *local, *states)
        ctx.num_local = len(local)
        # Not saved with save_for_backward: the backward drops them as soon as its all-heads pass has read them
        # (a saved tensor lives until the backward returns). They are intermediates, never inputs or outputs.
        ctx.operands = list(operands)
        ctx.layout, ctx.opts = layout, opts
        ctx.cu_seqlens = cu_seqlens
        ctx.device_type = q.device.type
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        # ctx.saved_tensors is read once, in _backward: checkpointing lets each saved tensor be unpacked once only
        with torch.autocast(ctx.device_type, enabled=False), _matmul_precision(ctx.opts.dot_precision):
            return ChunkKDAFunction._backward(ctx, do, dht)

    @staticmethod
    def _backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state, *kept = ctx.saved_tensors
        local, states = tuple(kept[: ctx.num_local]), tuple(kept[ctx.num_local :])
        layout, opts = ctx.layout, ctx.opts
        cdt = compute_dtype(q)
        names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
        inputs = dict(zip(names, (q, k, v, g, beta, A_log, dt_bias)))
        h0 = state_in(initial_state, opts, cdt)
        dhtc = None
        if dht is not None:
            dhtc = (dht.transpose(-1, -2) if opts.state_v_first else dht).to(cdt).contiguous()
        if q.dtype == torch.float64:
            grads, dh0 = chunk_kda_bwd_torch(ctx, inputs, opts, layout, h0, do, dhtc)
        else:
            grads, dh0 = chunk_kda_bwd(ctx, inputs, opts, layout, h0, do, dhtc, local, states)
        if dh0 is not None and ctx.needs_input_grad[7]:
            grads["initial_state"] = (dh0.transpose(-1, -2) if opts.state_v_first else dh0).to(initial_state.dtype)
        return (*(grads.get(n) for n in names), grads.get("initial_state"), None, None)


def chunk_kda_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
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
    disable_recompute: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    dot_precision: str | None = None,
    head_slices: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable chunked KDA with fla ``chunk_kda`` semantics (inputs already validated by the caller).

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; ``HV`` a multiple of ``H`` (GVA).
        g: ``[B, T, HV, K]`` log-space gate, or the raw gate input with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` write strengths, or logits with ``use_beta_sigmoid_in_kernel``.
        scale: query scale (the caller fills ``K ** -0.5``).
        initial_state: ``[N, HV, K, V]`` float32 (``[N, HV, V, K]`` with ``state_v_first``), or None.
        output_final_state: return the final state in the same layout.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        use_gate_in_kernel: compute the gate from raw ``g``, ``A_log``, ``dt_bias`` (see `kda_gate_torch`).
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)`` (times 2 with ``allow_neg_eigval``).
        allow_neg_eigval: see above.
        safe_gate: fla's bounded-gate flag (gates in ``[-5, 0)``); passed to the forward kernels.
        lower_bound: bounded gate floor, e.g. -5.0 (with ``use_gate_in_kernel``).
        state_v_first: states are ``[..., V, K]``.
        cu_seqlens: ``[N + 1]`` cumulative lengths for varlen (``B == 1``); read on the host once per tensor object
            (a loop that reuses it, or passes ``cu_seqlens_cpu``, never waits for the device).
        A_log: ``[HV]`` gate rate, with ``use_gate_in_kernel``.
        dt_bias: ``[HV * K]`` gate bias, with ``use_gate_in_kernel``.
        disable_recompute: keep the per-chunk states (and, for bf16, the reverse state pass's operands) from the
            forward: more memory between forward and backward, no state recompute (see the module docstring).
        cu_seqlens_cpu: the host copy of ``cu_seqlens`` (validated by the caller), or None.
        dot_precision: ``tl.dot`` input precision of the backward, ``"tf32"`` or ``"ieee"``; None picks ``"tf32"``
            for bf16/fp16 inputs on a GPU, else ``"ieee"``. Tests pass ``"tf32"`` to run a GPU's bf16/fp16 backward
            (its fused gate chain, bf16 state-pass operands) in the interpreter.
        head_slices: run the backward in this many value-head slices (a divisor of the number of GVA groups);
            None sizes them by memory (see `flashkda.bwd.chunk_bwd.backward_head_slices`).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in ``q``'s dtype; ``final_state`` float32 (float64 for
        float64 inputs) or None.

    Raises:
        ValueError: ``K`` is not a power of two in 16..256 (the training kernels tile K whole), or a bad
            ``dot_precision`` / ``head_slices``.

    Example::

        >>> import torch
        >>> from flashkda.chunk import chunk_kda_autograd
        >>> q, k = (torch.nn.functional.normalize(torch.randn(1, 70, 2, 32), dim=-1) for _ in range(2))
        >>> v, beta = torch.randn(1, 70, 2, 32, requires_grad=True), torch.rand(1, 70, 2)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(1, 70, 2, 32))
        >>> o, _ = chunk_kda_autograd(q, k, v, g, beta, scale=32 ** -0.5)
        >>> o.sum().backward(); v.grad.shape
        torch.Size([1, 70, 2, 32])
    """
    if dot_precision is None:
        dot_precision = default_dot_precision(q)
    elif dot_precision not in ("tf32", "ieee"):
        raise ValueError(f"dot_precision must be 'tf32' or 'ieee', got {dot_precision!r}")
    K = q.shape[-1]
    if K < 16 or K > 256 or K & (K - 1):
        raise ValueError(f"training (inputs requiring grad) needs a head dim K in 16, 32, 64, 128, 256; got K={K}")
    opts = KDAOptions(
        scale=scale,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        state_v_first=state_v_first,
        disable_recompute=disable_recompute,
        dot_precision=dot_precision,
        cu_seqlens_cpu=cu_seqlens_cpu,
        head_slices=head_slices,
    )
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)


def chunk_kda_v2_autograd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                          scale: float, initial_state: torch.Tensor | None, output_final_state: bool,
                          lower_bound: float, state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                          A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                          chunk_size: int = TRAINING_CHUNK, stages=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kda`'s v2 training path: ``flashkda.bwd.v2.chunk_kda_v2`` in `chunk_kda`'s contract, on a call
    ``prefers_v2_training`` accepted (the in-kernel L2 norm, bounded gate and beta sigmoid).

    ``initial_state`` and the final state are transposed for ``state_v_first`` and ``A_log``/``dt_bias`` cast to
    fp32 ``[HV]``/``[HV * K]`` outside the autograd function, so autograd returns every gradient (``dh0``,
    ``dA_log``, ``ddt_bias``) in its input's layout, shape and dtype. Autocast is off for the call, as for v1.

    Args:
        q, k: ``[B, T, H, 128]`` bf16; v: ``[B, T, HV, 128]`` bf16; g: ``[B, T, HV, 128]`` raw gate; beta:
            ``[B, T, HV]`` logits (g and beta bf16 or fp32).
        scale, initial_state, output_final_state, lower_bound, state_v_first, cu_seqlens: as `chunk_kda`'s.
        A_log: ``[HV]`` or None; dt_bias: ``[HV * 128]`` or ``[HV, 128]`` or None (any float dtype).
        chunk_size: v2's tokens per chunk, 16 or 32.
        stages: v2's kernels (``flashkda.bwd.v2.train.TrainStages``); None runs the device kernels (after
            ``chunk_kda_v2``'s scope check); the CPU tests pass ``emulated_stages``.

    Returns:
        ``(o [B, T, HV, 128] bf16, final_state fp32 in the ``state_v_first`` layout, or None)``.
    """
    from flashkda.bwd.v2.train import chunk_kda_v2

    HV = v.shape[2]
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    A_log = None if A_log is None else A_log.reshape(HV).float()
    dt_bias = None if dt_bias is None else dt_bias.reshape(-1).float()
    with torch.autocast(q.device.type, enabled=False):
        o, final = chunk_kda_v2(q, k, v, g, beta, scale, initial_state, output_final_state, lower_bound, cu_seqlens,
                                A_log, dt_bias, chunk_size=chunk_size, stages=stages)
    if final is not None and state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final
