"""The v2 forward: K1 then K2 over 32-token chunks (`chunk_fwd32`, the default) or 16-token chunks (`prepare_fwd`,
`recurrence_fwd`), for the production case.

`supports_v2` says whether a validated call is in scope; `chunk_kda_fwd_v2` takes the arguments of
``flashkda.fwd.chunk_fwd.chunk_kda_fwd`` (the subset v2 serves) and returns the same ``(o, final_state, h)``.
`prefers_v2` (inference) and `prefers_v2_training` (inputs requiring grad: ``flashkda.bwd.v2.chunk_kda_v2``) are
``flashkda.chunk_kda``'s rules; ``FLASHKDA_KERNELS`` overrides them for A/B runs:

| variable | values (default first) | read |
|---|---|---|
| ``FLASHKDA_KERNELS`` | auto, v1, v2 | each ``chunk_kda`` call: the rules; never v2; v2 wherever it serves the call |
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from flashkda.env import env_choice
from flashkda.fwd.v2.workspace import HEAD_DIM, HEAD_DIMS, cached_chunk_layout

__all__ = ["KERNELS_ENV", "MIN_SEQUENCE_HEADS", "TRAINING_CHUNK", "chunk_kda_fwd_v2", "kernels_choice", "prefers_v2",
           "prefers_v2_training", "supports_v2", "v2_training_unsupported_reason", "v2_unsupported_reason"]

#: ``flashkda.chunk_kda``'s inference path takes v2 from this many (sequence, value head) pairs up: v2's state
#: kernel runs two programs per pair, so below it most SMs idle and the v1 kernels are faster (measurements in
#: ``docs/flashkda-v2.md``).
MIN_SEQUENCE_HEADS = 12
#: The gate floors v2 handles: 16 tokens of ``lower_bound`` keep ``2^(+-G)`` inside fp32 and bf16.
MIN_LOWER_BOUND = -5.0
#: Tokens per chunk of ``flashkda.chunk_kda``'s v2 training path (faster than 32 on the H200;
#: ``docs/flashkda-v2-backward.md``).
TRAINING_CHUNK = 16
#: The switch that overrides the rules (table in the module docstring).
KERNELS_ENV = "FLASHKDA_KERNELS"
#: The raw gate and beta dtypes the training kernels take (their gradients come back in the same dtype).
TRAINING_GATE_DTYPES = (torch.bfloat16, torch.float32)
#: The head widths (K = V) the training kernels take, per chunk size (the inference forward: `HEAD_DIM` only).
TRAINING_HEAD_DIMS = {16: HEAD_DIMS, 32: (HEAD_DIM,)}


@functools.cache
def _has_gluon() -> bool:
    try:
        return importlib.util.find_spec("triton.experimental.gluon") is not None
    except ImportError:  # no triton at all
        return False


def v2_unsupported_reason(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    head_dims: tuple[int, ...] = (HEAD_DIM,),
    **_ignored,
) -> str | None:
    """Why v2 cannot serve this (validated) call, or None when it can; arguments as ``chunk_kda_fwd``'s, plus
    ``head_dims``, the widths ``K = V`` the kernels in question take (the inference forward's: 128)."""
    reason = _device_reason(q)
    if reason is not None:
        return reason
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return f"needs bf16 q/k/v, got {q.dtype}"
    K = q.shape[-1]
    if K not in head_dims or v.shape[-1] != K:
        widths = " or ".join(str(d) for d in head_dims)
        return f"needs K = V = {widths}, got K={K}, V={v.shape[-1]}"
    H, HV = q.shape[2], v.shape[2]
    if HV % H != 0 or g.shape[2] != HV or beta.shape[2] != HV:
        return f"needs g, beta and v with HV heads, a multiple of H={H}; got v {HV}, g {g.shape[2]}, beta {beta.shape[2]}"
    if not (use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel):
        return "needs the in-kernel L2 norm, gate and beta sigmoid"
    if allow_neg_eigval:
        return "allow_neg_eigval is not supported"
    if lower_bound is None or not (MIN_LOWER_BOUND <= lower_bound < 0):
        return f"needs a bounded gate with lower_bound in [{MIN_LOWER_BOUND}, 0), got {lower_bound}"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return f"needs an fp32 initial_state, got {initial_state.dtype}"
    if cu_seqlens is not None and q.shape[0] != 1:
        return "varlen needs B == 1"
    if dt_bias is not None and dt_bias.numel() != HV * K:
        return f"needs dt_bias of HV*K = {HV * K} elements, got {dt_bias.numel()}"
    if A_log is not None and A_log.numel() != HV:
        return f"needs A_log of HV = {HV} elements, got {A_log.numel()}"
    return None


@functools.cache
def _major_capability(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _device_reason(q: torch.Tensor) -> str | None:
    """Why v2's kernels cannot run on ``q``'s device, or None (a Hopper GPU and Triton with Gluon)."""
    if not q.is_cuda or _major_capability(q.device.index) != 9:
        return "needs a Hopper (sm_90) GPU"
    if not _has_gluon():
        return "needs Triton with Gluon"
    return None


def v2_training_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, *args, disable_recompute: bool = False,
                                   chunk_size: int = TRAINING_CHUNK, **kwargs) -> str | None:
    """Why ``flashkda.bwd.v2.chunk_kda_v2`` at ``chunk_size``-token chunks cannot train this validated ``chunk_kda``
    call exactly, or None.

    Arguments as `v2_unsupported_reason` plus the keywords ``disable_recompute`` and ``chunk_size``. Beyond the
    forward's scope: the head widths of `TRAINING_HEAD_DIMS` (64 too at 16-token chunks), raw
    ``g`` and ``beta`` in bf16 or fp32, at least one token, and no ``disable_recompute`` (the request to keep v1's
    per-chunk states; v2 keeps its own checkpoints, so the call stays on v1, which honours it). ``safe_gate``
    changes no result once ``lower_bound`` is in v2's range, ``state_v_first`` is a transpose, and
    ``A_log``/``dt_bias`` of any float dtype get their gradients through a cast.
    """
    kwargs["head_dims"] = TRAINING_HEAD_DIMS[chunk_size]
    reason = v2_unsupported_reason(q, k, v, g, beta, *args, **kwargs)
    if reason is not None:
        return reason if chunk_size == TRAINING_CHUNK else f"{reason} at {chunk_size}-token chunks"
    for name, x in (("g", g), ("beta", beta)):
        if x.dtype not in TRAINING_GATE_DTYPES:
            return f"training needs {name} in bf16 or fp32, got {x.dtype}"
    if q.shape[0] * q.shape[1] == 0:
        return "training needs at least one token"
    if disable_recompute:
        return "disable_recompute asks for v1's kept per-chunk states"
    return None


def kernels_choice() -> str:
    """``FLASHKDA_KERNELS``: ``"auto"`` (unset), ``"v1"`` or ``"v2"`` (ValueError naming the variable otherwise)."""
    return env_choice(KERNELS_ENV, "auto", ("auto", "v1", "v2"))


def _check_cu_seqlens_cpu(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None) -> None:
    if cu_seqlens_cpu is None:
        return
    want = None if cu_seqlens is None else tuple(cu_seqlens.shape)
    if want != tuple(cu_seqlens_cpu.shape) or cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be the CPU copy of cu_seqlens (shape {want}), got shape "
                         f"{tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")


def supports_v2(*args, **kwargs) -> bool:
    """True when `chunk_kda_fwd_v2` serves this validated call (arguments as `v2_unsupported_reason`)."""
    return v2_unsupported_reason(*args, **kwargs) is None


_CU_SEQLENS_AT = 9  # cu_seqlens's place in `v2_unsupported_reason`'s arguments after q, k, v


def prefers_v2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> bool:
    """True when an inference call (arguments as `v2_unsupported_reason`) should run v2 rather than the v1 kernels:
    v2 serves it and its sequences times its value heads reach `MIN_SEQUENCE_HEADS` (any count with
    ``FLASHKDA_KERNELS=v2``, never with ``v1``). The sequences are ``B``, or ``len(cu_seqlens) - 1`` (read from the
    shape: no host synchronisation)."""
    choice = kernels_choice()
    if choice == "v1" or v.dim() != 4:
        return False
    if choice == "auto":
        cu_seqlens = kwargs.get("cu_seqlens", args[_CU_SEQLENS_AT] if len(args) > _CU_SEQLENS_AT else None)
        sequences = v.shape[0] if cu_seqlens is None else max(cu_seqlens.shape[0] - 1, 0)
        if sequences * v.shape[2] < MIN_SEQUENCE_HEADS:
            return False
    return supports_v2(q, k, v, *args, **kwargs)


def prefers_v2_training(*args, **kwargs) -> bool:
    """True when a training call (inputs requiring grad; arguments as `v2_training_unsupported_reason`) should run
    ``flashkda.bwd.v2.chunk_kda_v2`` at `TRAINING_CHUNK`-token chunks rather than the v1 autograd path: whenever v2
    trains it exactly (faster than v1 on every measured shape), unless ``FLASHKDA_KERNELS=v1``."""
    if kernels_choice() == "v1":
        return False
    return v2_training_unsupported_reason(*args, **kwargs) is None


def chunk_kda_fwd_v2(
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
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Chunked KDA forward on validated inputs, by the two Gluon kernels (inference: nothing is saved).

    Args:
        q, k: ``[B, T, H, 128]`` bf16; v: ``[B, T, HV, 128]`` bf16 (``HV`` a multiple of ``H``, GVA); g:
            ``[B, T, HV, 128]`` raw gate; beta: ``[B, T, HV]`` logits; scale: query scale (already defaulted).
        initial_state: ``[N, HV, 128, 128]`` fp32 (``[N, HV, V, K]`` if ``state_v_first``) or None.
        output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens (int64 or int32 ``[N + 1]``),
            A_log, dt_bias: as in ``flashkda.chunk_kda``; only the combinations `supports_v2` accepts.
        cu_seqlens_cpu: the host copy of ``cu_seqlens`` (varlen), if the caller has one; only its shape is checked
            (v2 reads no offsets on the host: every call is free of host synchronisation). It keys the cached chunk
            layout of an inference-mode ``cu_seqlens`` (otherwise rebuilt on every call).
        chunk_size: 16 or 32 tokens per chunk (`flashkda.fwd.v2.chunk_fwd32`); None takes 32 (fixed length and
            varlen; measurements in ``docs/flashkda-v2.md``).

    Returns:
        ``(o, final_state, None)``: ``o`` ``[B, T, HV, 128]`` bf16, ``final_state`` ``[N, HV, 128, 128]`` fp32 (in the
        layout ``state_v_first`` names) or None
        (the third item stands for ``chunk_kda_fwd``'s per-chunk states, which v2 does not keep).

    Raises:
        ValueError: the call is outside v2's scope (the message says why).
    """
    reason = v2_unsupported_reason(
        q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, A_log, dt_bias)
    if reason is not None:
        raise ValueError(f"chunk_kda_fwd_v2: {reason}")
    from flashkda.fwd.v2.prepare import prepare_fwd
    from flashkda.fwd.v2.recurrence import recurrence_fwd

    if chunk_size is None:
        chunk_size = 32
    elif chunk_size not in (16, 32) or isinstance(chunk_size, bool):
        raise ValueError(f"chunk_size must be 16, 32 or None, got {chunk_size!r}")
    _check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu)
    B, T = q.shape[:2]
    if chunk_size == 32:  # its state kernel reads and writes either layout
        from flashkda.fwd.v2.chunk_fwd32 import forward_c32

        o, final = forward_c32(q, k, v, g, beta, scale, None if initial_state is None else initial_state.contiguous(),
                               output_final_state, lower_bound, cu_seqlens, A_log, dt_bias, state_v_first,
                               cu_seqlens_cpu)
        return o, final, None
    if initial_state is not None:  # the chunk-16 kernels keep the state K-first
        initial_state = (initial_state.transpose(-1, -2) if state_v_first else initial_state).contiguous()
    layout = cached_chunk_layout(B, T, cu_seqlens, q.device, cu_seqlens_cpu=cu_seqlens_cpu)
    ws = prepare_fwd(q.contiguous(), k.contiguous(), g.contiguous(), beta.contiguous(), scale, layout,
                     lower_bound, A_log, dt_bias)
    o, final = recurrence_fwd(ws, v.contiguous(), initial_state, output_final_state)
    if final is not None and state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final, None
