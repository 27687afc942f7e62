"""One low-precision copy of each master weight per optimizer step, its gradient added straight into ``.grad``.

Gradient accumulation over micro-batches casts every fp32 weight that a bf16 computation reads once per
micro-batch, and autograd brings each micro-batch's bf16 weight gradient back as a new fp32 tensor (a cast) that
``AccumulateGrad`` then adds to ``.grad``: 24 bytes per weight and micro-batch outside the matrix products. Inside
`cast_once` the cast is made the first time a weight is read and reused until the block ends, and the bf16 gradient
is added to the fp32 ``.grad`` in one mixed-dtype pass (10 bytes), as Megatron-LM's gradient-accumulation fusion
writes weight gradients into ``main_grad``. The arithmetic is that of the plain path (each micro-batch's gradient
rounded to bf16, summed in fp32), so ``.grad`` is bitwise equal to it.

Inside the block, a weight's gradient reaches its ``.grad`` without passing ``AccumulateGrad``: gradient hooks on
the weight do not see it, and ``torch.autograd.grad`` does not return it. The block is for a trainer that owns
``.grad`` (`k3infra.train.Trainer` opens it around one optimizer step's micro-batches); the weights must not change
inside it. Parameters that FSDP gathers in fp32 must not be read through it (their gradients have to reach FSDP's
reduce-scatter); FSDP gathering in the compute dtype, as the trainer's does, leaves nothing to cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["active", "cast_once", "compute_weight", "compute_weights_cat"]

# process-wide, not thread-local: activation checkpointing replays forwards on autograd's device threads
_casts: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], torch.Tensor]] | None = None


def active() -> bool:
    """Whether a `cast_once` block is open."""
    return _casts is not None


@contextlib.contextmanager
def cast_once() -> Iterator[None]:
    """Within the block, `compute_weight` casts each weight once and accumulates its gradient into ``.grad``.

    Nested blocks share the outermost block's casts; they are dropped when it ends.
    """
    global _casts
    if _casts is not None:
        yield
        return
    _casts = {}
    try:
        yield
    finally:
        _casts = None


class _CastOnce(torch.autograd.Function):
    """The cached low-precision copy of ``weights`` (concatenated along dim 0); backward adds each weight's rows of
    the gradient into its ``.grad``."""

    @staticmethod
    def forward(ctx, cast, *weights):
        ctx.weights = weights
        return cast.detach()

    @staticmethod
    def backward(ctx, grad):
        weights = ctx.weights
        parts = grad.split([w.shape[0] for w in weights]) if len(weights) > 1 else (grad,)
        for weight, part in zip(weights, parts):
            if not weight.requires_grad:
                continue
            if weight.grad is None:
                weight.grad = torch.empty_like(weight).copy_(part)
            else:
                weight.grad.add_(part)
        return (None,) * (1 + len(weights))


def _cacheable(weights: tuple[torch.Tensor, ...], dtype: torch.dtype) -> bool:
    return (_casts is not None and not torch.compiler.is_compiling() and any(w.requires_grad for w in weights)
            and all(type(w) in (torch.Tensor, nn.Parameter) and w.is_leaf and w.dtype != dtype for w in weights))


def compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` for a computation, with its gradient in ``weight``'s own dtype.

    Outside `cast_once` (or under ``torch.compile``, or for a weight that is not a plain leaf tensor requiring
    grad) this is ``weight.to(dtype)``. Inside, the weight is cast on its first read and the copy reused; its
    gradient goes into ``weight.grad`` (see the module docstring).

    Shapes and dtypes: any ``weight``; returns the same shape in ``dtype``.
    """
    if not _cacheable((weight,), dtype):
        return weight.to(dtype)
    return _cached((weight,), dtype, lambda: weight.to(dtype))


def compute_weights_cat(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``torch.cat(weights).to(dtype)`` with `compute_weight`'s caching (one copy per block for the tuple).

    Shapes and dtypes: ``weights`` ``[O_i, *W]`` each, one dtype; returns ``[Σ O_i, *W]`` in ``dtype``.
    """
    weights = tuple(weights)
    if not _cacheable(weights, dtype):
        return torch.cat(weights).to(dtype)

    def cat():
        out = torch.empty((sum(w.shape[0] for w in weights), *weights[0].shape[1:]), dtype=dtype,
                          device=weights[0].device)
        torch.cat(weights, out=out)  # the cast happens in the copy: no full-width concatenation first
        return out

    return _cached(weights, dtype, cat)


def _cached(weights: tuple[torch.Tensor, ...], dtype: torch.dtype, make) -> torch.Tensor:
    key = tuple(id(w) for w in weights)
    _, cast = _casts.get(key, (None, None))
    if cast is None or cast.dtype != dtype:
        with torch.no_grad():
            cast = make()
        _casts[key] = weights, cast
    if not torch.is_grad_enabled():
        return cast
    return _CastOnce.apply(cast, *weights)
