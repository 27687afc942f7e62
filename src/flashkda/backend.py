"""FlashKDA as a backend of fla-core 0.6.0's ``chunk_kda`` dispatcher (``fla.backends``).

fla has no entry-point discovery: backends are classes registered with ``@register(chunk_kda)``. The start-up
hook (``flashkda_hook``, loaded by ``k3_flashkda.pth``) calls ``register_with_fla()`` right after
``fla.ops.kda.chunk`` is imported, so programs that only import fla run our kernels. Lower priority wins in fla;
MoonshotAI's CUTLASS backend uses 3, so ours (2) is tried first. Each call is verified: anything we reject (a
feature we lack, a bad argument, a training call with an unsupported head dim) falls back to fla's own
path, and fla logs each rejection reason once. ``FLASHKDA_DISABLE=1`` turns the backend off at any time.
"""

from __future__ import annotations

import logging
import os

import torch

from flashkda.env import env_flag

logger = logging.getLogger(__name__)

BACKEND_TYPE = "k3_flashkda"
PRIORITY = 2
DISABLE_ENV = "FLASHKDA_DISABLE"
_state = {"registered": False, "dispatched": False}


def is_disabled() -> bool:
    """``FLASHKDA_DISABLE`` (0 or 1; any other value raises ValueError naming it, see `flashkda.env`)."""
    return env_flag(DISABLE_ENV, False)


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
    if not isinstance(q, torch.Tensor):
        return False, "q is not a tensor"
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False, f"{q.device.type} tensors need TRITON_INTERPRET=1"
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    if needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        K = q.shape[-1]
        if K < 16 or K > 256 or K & (K - 1):
            return False, f"training needs K in 16, 32, 64, 128, 256; got K={K}"
    try:
        s = checks.check_qkvgb(q, k, v, g, beta)
        s = checks.check_cu_seqlens(s, cu_seqlens, cu_seqlens_cpu, q.device)
        checks.check_state("initial_state", initial_state, s, state_v_first, q.device)
        checks.check_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval)
        checks.check_gate_params(s, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, q.device)
    except ValueError as e:
        return False, str(e)
    return True, None


def chunk_kda(*args, **kwargs):
    """fla's ``chunk_kda`` call, served by ``flashkda.chunk_kda`` (logs once on the first dispatch)."""
    from flashkda.chunk import chunk_kda as ours

    if not _state["dispatched"]:
        _state["dispatched"] = True
        logger.info("flashkda: fla.ops.kda.chunk_kda is served by FlashKDA (set %s=1 to turn off)", DISABLE_ENV)
    return ours(*args, **kwargs)


def register_with_fla() -> bool:
    """Register the FlashKDA backend with fla's ``chunk_kda`` dispatcher.

    Idempotent; imports fla. Returns True when registered (now or before), False when disabled by
    ``FLASHKDA_DISABLE=1``.
    """
    if is_disabled():
        return False
    if _state["registered"]:
        return True
    from fla.backends import BaseBackend, register
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    class K3FlashKDABackend(BaseBackend):
        """FlashKDA Triton kernels (k3-infra) for ``fla.ops.kda.chunk_kda``; off with ``FLASHKDA_DISABLE=1``."""

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
