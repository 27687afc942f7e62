"""Per-decoder-layer ``torch.compile``, as torchtitan's ``apply_compile``: after activation checkpointing, before FSDP.

Each decoder layer's ``forward`` is compiled in place (parameter names and ``state_dict`` keys do not change, and the
FSDP hooks on the layer stay outside the compiled code). Scope ``"module"`` compiles the layer's children instead
(AttnRes sites, pre-norms, mixer, FFN), as torchtitan does inside MoE blocks: every layer of one kind then runs the
same graphs, so far fewer graphs are compiled (each layer's AttnRes source count makes it a graph of its own under
``"layer"``), at the price of the layer's glue (residual adds) running eager between them. Under activation
checkpointing the layer inside the `CheckpointWrapper` is compiled, so the recompute runs the compiled code and a
graph break inside a layer never sends the whole checkpointed layer back to eager.

What stays opaque to the compiler (deliberate graph breaks, ``torch.compiler.disable``), and why:

- the KDA recurrence (`K3KDA._chunk_kernel`: flashkda / fla ``chunk_kda``, Triton with host reads of
  ``cu_seqlens``; `K3KDA._mix`: the torch path lays the packed documents out by their host lengths);
- MLA attention over packed sequences (`K3MLA._attend`: host sequence bounds, one SDPA per sequence or one
  varlen flash call, and the QK-Clip max-logit record);
- the MoE expert loop without ``torch._grouped_mm`` (host expert counts) and MoonEP dispatch/combine;
- the fused element-wise Triton kernels of `k3infra.model.fused` are not called while compiling
  (`fused.use_fused` is False): inductor fuses the eager chains of `k3infra.model.layers` instead.

Everything else of a layer (projections, conv, norms, gates, AttnRes, router, the grouped-mm experts) is traced.
Packed batches keep a fixed token count; ``cu_seqlens`` changes length per batch, so the trainer marks its length
dynamic (`mark_packed_dynamic`) and new packings do not recompile.

The backend is inductor; the environment variable ``K3_COMPILE_BACKEND`` picks another (tests use ``aot_eager``).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

__all__ = ["BACKEND_ENV", "SCOPES", "apply_compile", "compile_backend", "mark_packed_dynamic"]

logger = logging.getLogger(__name__)

BACKEND_ENV = "K3_COMPILE_BACKEND"
"""Environment variable naming the ``torch.compile`` backend (default ``inductor``)."""
SCOPES = ("layer", "module")
"""What `apply_compile` compiles: each decoder layer, or each child module of a decoder layer."""


def compile_backend() -> str:
    """The backend `apply_compile` uses: ``$K3_COMPILE_BACKEND`` or ``inductor``."""
    return os.environ.get(BACKEND_ENV) or "inductor"


def _compile_target(layer: nn.Module) -> nn.Module:
    """The module whose forward is compiled: the layer itself, or the one a `CheckpointWrapper` wraps."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return layer._checkpoint_wrapped_module if isinstance(layer, CheckpointWrapper) else layer


def apply_compile(layers: list[nn.Module], *, scope: str = "layer", backend: str | None = None) -> None:
    """Compile the ``forward`` of each module in ``layers`` (decoder layers, maybe AC-wrapped) in place.

    Args:
        layers: the decoder layers (`k3infra.train.parallel.decoder_layers`), after activation checkpointing
            and before FSDP.
        scope: ``"layer"`` (each layer's forward) or ``"module"`` (the forward of each child of a layer).
        backend: a ``torch.compile`` backend (default: `compile_backend`).

    Raises:
        ValueError: ``scope`` is unknown, or ``layers`` is empty (the model has no ``model.layers``).
    """
    if scope not in SCOPES:
        raise ValueError(f"--compile must be one of {SCOPES} (or given without a value: layer), got {scope!r}")
    if not layers:
        raise ValueError("--compile needs model.model.layers (a transformers decoder) to compile layer by layer")
    backend = backend or compile_backend()
    # every layer runs the same forward code: one cache entry per distinct layer kind (mixer, FFN, AttnRes source
    # count), plus the resume functions after the deliberate graph breaks
    config = torch._dynamo.config
    for name, least in (("recompile_limit", 4 * len(layers)), ("accumulated_recompile_limit", 16 * len(layers))):
        if hasattr(config, name):  # both named so since torch 2.6
            setattr(config, name, max(getattr(config, name), least))
    for layer in layers:
        target = _compile_target(layer)
        for module in [target] if scope == "layer" else list(target.children()):
            module.forward = torch.compile(module.forward, backend=backend)
    logger.info("compiled %d decoder layers with torch.compile (scope %s, backend %s)", len(layers), scope, backend)


def mark_packed_dynamic(cu_seqlens: torch.Tensor | None) -> None:
    """Mark the length of a packed batch's ``cu_seqlens`` ``[N + 1]`` dynamic (it changes with every packing), so
    the compiled layers trace it symbolically on the first call instead of recompiling on the second."""
    if cu_seqlens is not None:
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
