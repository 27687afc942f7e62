"""FlashKDA as a backend of fla-core 0.6.0's ``chunk_kda`` dispatcher (``fla.backends``).

fla has no entry-point discovery: backends are classes registered with ``@register(chunk_kda)``. The start-up
hook (``flashkda_hook``, loaded by ``k3_flashkda.pth``) calls ``register_with_fla()`` right after
``fla.ops.kda.chunk`` is imported, so programs that only import fla can run our kernels. Lower priority wins in
fla; MoonshotAI's CUTLASS backend uses 3, so ours (2) is asked first, and its verifier accepts a call only where
``flashkda.dispatch`` measured us faster than every other backend that would take it (fla's Triton path and any
registered backend whose verifier accepts). Everything else (a feature we lack, a bad argument, a shape class we
were not measured faster on) is declined with the reason, which fla logs once, and fla or the CUTLASS backend
serves it. ``FLASHKDA_DISPATCH=auto|always|never`` (``FLASHKDA_DISABLE=1`` = never) is read on every call.
"""

from __future__ import annotations

import logging
import os

import torch

from flashkda.dispatch import (
    CALIBRATION_ENV,
    DISPATCH_ENV,
    Decision,
    DispatchPolicy,
    ShapeClass,
    device_arch,
    device_name,
    dispatch_mode,
)

logger = logging.getLogger(__name__)

BACKEND_TYPE = "k3_flashkda"
PRIORITY = 2
_state = {"registered": False, "dispatched": False}
_POLICY = DispatchPolicy()
_DECISIONS: dict[tuple, Decision] = {}
_MAX_DECISIONS = 4096


def is_disabled() -> bool:
    """Whether dispatch is off (``FLASHKDA_DISPATCH=never`` or ``FLASHKDA_DISABLE=1``; ValueError on a bad value)."""
    return dispatch_mode() == "never"


def competitors(*args, **kwargs) -> tuple[str, ...]:
    """The backends that would serve this fla call if we declined: ``"fla"`` (its own path, always) and each other
    registered, enabled backend whose verifier accepts the call (e.g. ``"flash_kda"``, the CUTLASS FlashKDA)."""
    from inspect import unwrap

    from fla.backends import _function_registries
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    names = ["fla"]
    registry = _function_registries.get(unwrap(fla_chunk_kda))
    for backend in registry._get_sorted_backends() if registry is not None else ():
        if backend.backend_type == BACKEND_TYPE or not (backend.is_available() and backend.is_enabled()):
            continue
        if backend.verify("chunk_kda", *args, **kwargs)[0]:
            names.append(backend.backend_type)
    return tuple(names)


def decide(q: torch.Tensor, v: torch.Tensor, cu_seqlens, training: bool, mode: str,
           rivals: tuple[str, ...]) -> Decision:
    """`DispatchPolicy.decide` for this call, memoised on what the decision depends on (it runs on every fla call,
    where the host time it takes can show up between kernels)."""
    key = (q.shape, v.shape, q.dtype, q.device, cu_seqlens is None, training, mode, rivals,
           os.environ.get(CALIBRATION_ENV))
    decision = _DECISIONS.get(key)
    if decision is None:
        if len(_DECISIONS) >= _MAX_DECISIONS:
            _DECISIONS.clear()
        decision = _POLICY.decide(ShapeClass.of_call(q, v, cu_seqlens, training), device_arch(q.device), rivals, mode,
                                  device_name(q.device))
        _DECISIONS[key] = decision
    return decision


def chunk_kda_verifier(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
    lower_bound=None, disable_recompute=False, return_intermediate_states=False, state_v_first=False,
    cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, **kwargs,
) -> tuple[bool, str | None]:
    """Whether ``flashkda.chunk_kda`` can serve this fla call; ``(False, reason)`` sends it back to fla."""
    from flashkda import checks
    from flashkda.chunk import needs_grad

    if cp_context is not None:
        return False, "context parallelism (cp_context) is not supported"
    if return_intermediate_states:
        return False, "return_intermediate_states is not supported"
    if kwargs.get("chunk_size", 64) not in (32, 64):
        return False, "chunk_size must be 32 or 64"
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4):
        return False, "q and v must be 4-D tensors [B, T, H, K] and [B, T, HV, V]"
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False, f"{q.device.type} tensors need TRITON_INTERPRET=1"
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    training = needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if training and not (16 <= q.shape[-1] <= 256 and q.shape[-1] & (q.shape[-1] - 1) == 0):
        return False, f"training needs K in 16, 32, 64, 128, 256; got K={q.shape[-1]}"
    # The policy first: it is cheaper than the argument checks and declines most calls. A call we do not beat fla
    # on is declined without asking the other backends (more competitors only raise the bar).
    mode = dispatch_mode()
    decision = decide(q, v, cu_seqlens, training, mode, ("fla",))
    if decision.serve and mode == "auto":
        rivals = competitors(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                             disable_recompute, return_intermediate_states, state_v_first, cu_seqlens,
                             cu_seqlens_cpu, cp_context, use_graph, max_num_seqs, **kwargs)
        if rivals != ("fla",):
            decision = decide(q, v, cu_seqlens, training, mode, rivals)
    if not decision.serve:
        return False, decision.reason
    try:
        checks.check_kwargs(kwargs)
        s = checks.check_qkvgb(q, k, v, g, beta)
        s = checks.check_cu_seqlens(s, cu_seqlens, cu_seqlens_cpu, q.device)
        checks.check_state("initial_state", initial_state, s, state_v_first, q.device)
        checks.check_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval)
        checks.check_gate_params(s, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, q.device)
    except (TypeError, ValueError) as e:
        return False, str(e)
    return True, None


def chunk_kda(*args, **kwargs):
    """fla's ``chunk_kda`` call, served by ``flashkda.chunk_kda`` (logs once on the first dispatch)."""
    from flashkda.chunk import chunk_kda as ours

    if not _state["dispatched"]:
        _state["dispatched"] = True
        logger.info("flashkda: fla.ops.kda.chunk_kda calls are served by FlashKDA where calibrated faster "
                    "(%s=never turns it off)", DISPATCH_ENV)
    return ours(*args, **kwargs)


def register_with_fla() -> bool:
    """Register the FlashKDA backend with fla's ``chunk_kda`` dispatcher.

    Idempotent; imports fla. Returns True when registered (now or before), False when dispatch is off
    (``FLASHKDA_DISPATCH=never`` or ``FLASHKDA_DISABLE=1``).
    """
    if is_disabled():
        return False
    if _state["registered"]:
        return True
    from fla.backends import BaseBackend, register
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    class K3FlashKDABackend(BaseBackend):
        """FlashKDA Triton kernels (k3-infra) for ``fla.ops.kda.chunk_kda``; off with ``FLASHKDA_DISPATCH=never``."""

        backend_type = BACKEND_TYPE
        package_name = "flashkda"
        priority = PRIORITY

        def is_enabled(self) -> bool:
            return not is_disabled()

        def chunk_kda_verifier(self, *args, **kwargs):
            return chunk_kda_verifier(*args, **kwargs)

        def chunk_kda(self, *args, **kwargs):
            return chunk_kda(*args, **kwargs)

    register(fla_chunk_kda)(K3FlashKDABackend)
    _state["registered"] = True
    logger.debug("flashkda: registered backend %r (priority %d) with fla", BACKEND_TYPE, PRIORITY)
    return True
