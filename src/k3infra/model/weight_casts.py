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
inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["cast_once", "compute_weight"]

# process-wide, not thread-local: activation checkpointing replays forwards on autograd's device threads
_casts: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


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
    """The cached low-precision copy of ``weight``; backward adds the gradient into ``weight.grad``."""

    @staticmethod
    def forward(ctx, weight, cast):
        ctx.weight = weight
        return cast.detach()

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = torch.empty_like(weight).copy_(grad)
        else:
            weight.grad.add_(grad)
        return None, None


def compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` for a computation, with its gradient in ``weight``'s own dtype.

    Outside `cast_once` (or under ``torch.compile``, or for a weight that is not a leaf requiring grad) this is
    ``weight.to(dtype)``. Inside, a leaf weight is cast on its first read and the copy reused; its gradient goes
    into ``weight.grad`` (see the module docstring).

    Shapes and dtypes: any ``weight``; returns the same shape in ``dtype``.
    """
    if (weight.dtype == dtype or _casts is None or not (weight.is_leaf and weight.requires_grad)
            or torch.compiler.is_compiling()):
        return weight.to(dtype)
    _, cast = _casts.get(id(weight), (None, None))
    if cast is None or cast.dtype != dtype:
        with torch.no_grad():
            cast = weight.to(dtype)
        _casts[id(weight)] = weight, cast
    if not torch.is_grad_enabled():
        return cast
    return _CastOnce.apply(weight, cast)
