"""Next-token cross-entropy through the LM head, in pieces of tokens, each piece's gradient formed in the forward.

The ``[N, V]`` logits of a training batch are the model's largest activation. `linear_cross_entropy_sum` walks the
tokens in pieces of ``chunk`` rows. Per piece: the logits (one GEMM in the compute dtype), then one pass over them
that writes the rows' losses and turns the logits, in place, into ``d(loss sum)/d(logits) = softmax - onehot``,
then the head's two backward GEMMs. Backward only scales the input gradient ``[N, D]`` and the weight gradient
``[V, D]`` (fp32, or fp64 for an fp64 head) kept from the forward by the incoming gradient: no logits are kept,
none are recomputed. The alternative (checkpointing each piece) runs every piece's GEMM and softmax twice and
casts the logits to fp32 and back in both passes.

The pass over the logits is a Triton kernel on CUDA (and on the CPU under ``TRITON_INTERPRET=1`` when
``fused.MODE`` is ``"on"``); elsewhere the same math runs in torch on fp32 copies of one piece.

Shape suffixes: N tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3infra.model import fused
from k3infra.model.weight_casts import compute_weight

__all__ = ["IGNORE_INDEX", "linear_cross_entropy_sum"]

IGNORE_INDEX = -100
"""Targets with this value add no loss and no gradient (as in ``F.cross_entropy``)."""

_BLOCK_V = 4096


@triton.jit
def _ce_grad_kernel(logits_ptr, target_ptr, loss_ptr, V, stride, IGNORE: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row: its loss ``logsumexp(x) - x[t]`` and, in place, ``softmax(x) - onehot(t)`` (zero if ignored)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    target = tl.load(target_ptr + row).to(tl.int32)
    cols = tl.arange(0, BLOCK_V)
    run_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(run_max - new_max))
        run_sum = run_sum * scale + tl.where(x == float("-inf"), 0.0, tl.exp(x - new_max))
        run_max = new_max
    row_max = tl.max(run_max, 0)
    total = tl.sum(run_sum * tl.where(run_max == float("-inf"), 0.0, tl.exp(run_max - row_max)), 0)
    lse = row_max + tl.log(total)
    ignored = target == IGNORE
    safe_target = tl.where(ignored, 0, target)
    x_target = tl.load(base + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - x_target))
    keep = tl.where(ignored, 0.0, 1.0)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)) * keep
        tl.store(base + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _ce_grad_inplace(logits_NV: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    """Per-row losses ``[N]`` fp32; ``logits_NV`` (contiguous rows) becomes ``softmax - onehot`` in place."""
    N, V = logits_NV.shape
    loss_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    if N == 0:
        return loss_N
    if fused.use_fused(logits_NV):
        _ce_grad_kernel[(N,)](logits_NV, target_N, loss_N, V, logits_NV.stride(0), IGNORE=IGNORE_INDEX,
                              BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(V)))
        return loss_N
    x_NV = logits_NV.float()
    ignored_N = target_N == IGNORE_INDEX
    safe_N = target_N.long().clamp(min=0).unsqueeze(1)
    lse_N = torch.logsumexp(x_NV, dim=1)
    loss_N.copy_(torch.where(ignored_N, 0.0, lse_N - x_NV.gather(1, safe_N).squeeze(1)))
    grad_NV = torch.exp(x_NV - lse_N.unsqueeze(1))
    grad_NV.scatter_add_(1, safe_N, torch.full_like(safe_N, -1.0, dtype=grad_NV.dtype))
    logits_NV.copy_(grad_NV.masked_fill_(ignored_N.unsqueeze(1), 0.0))
    return loss_N


def _compute_dtype(h_ND: torch.Tensor, weight_VD: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on for the device (what ``F.linear`` would compute in), else the
    promoted dtype of the two inputs."""
    device = h_ND.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h_ND.dtype, weight_VD.dtype)


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, weight_VD, target_N, chunk, dtype, grad_enabled):
        want_h, want_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        with torch.autocast(h_ND.device.type, enabled=False):
            w_VD = compute_weight(weight_VD, dtype)
            grad_h_ND = torch.empty(h_ND.shape, dtype=dtype, device=h_ND.device) if want_h else None
            acc = torch.promote_types(torch.float32, weight_VD.dtype)
            grad_w_VD = torch.zeros(weight_VD.shape, dtype=acc, device=h_ND.device) if want_w else None
            total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
            for start in range(0, h_ND.shape[0], chunk):
                h_cD = h_ND[start : start + chunk].to(dtype)
                logits_cV = h_cD @ w_VD.t()
                total += _ce_grad_inplace(logits_cV, target_N[start : start + chunk]).sum()
                if want_h:
                    torch.mm(logits_cV, w_VD, out=grad_h_ND[start : start + chunk])
                if want_w:
                    grad_w_VD += (logits_cV.t() @ h_cD).to(acc)
        ctx.save_for_backward(grad_h_ND, grad_w_VD)
        ctx.dtypes = (h_ND.dtype, weight_VD.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        grad_h = None if grad_h_ND is None else (grad_h_ND * grad_total).to(h_dtype)
        grad_w = None if grad_w_VD is None else (grad_w_VD * grad_total).to(w_dtype)
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, target_N: torch.Tensor,
                             chunk: int = 4096) -> torch.Tensor:
    """``F.cross_entropy(h_ND @ weight_VD.T, target_N, ignore_index=-100, reduction="sum")`` without the ``[N, V]``
    logits: at most ``[chunk, V]`` in the compute dtype at a time (see the module docstring).

    Args:
        h_ND: ``[N, D]`` hidden states (fp32, bf16 or fp16; under autocast the GEMMs take the autocast dtype, as
            ``F.linear`` would).
        weight_VD: ``[V, D]`` the LM head's weight.
        target_N: ``[N]`` integer targets in ``[0, V)`` or `IGNORE_INDEX`.
        chunk: tokens per piece, a positive int.

    Returns:
        The fp32 scalar sum of the non-ignored rows' losses; differentiable in ``h_ND`` and ``weight_VD`` (their
        gradients are formed during this call when they require grad, and only then).

    Raises:
        ValueError: a shape, dtype or ``chunk`` that does not fit (the message names the argument).
    """
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or h_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"h_ND must be [N, D] and weight_VD [V, D] with the same D, got {tuple(h_ND.shape)} and "
                         f"{tuple(weight_VD.shape)}")
    if target_N.shape != (h_ND.shape[0],) or target_N.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"target_N must be int32/int64 [{h_ND.shape[0]}], got {target_N.dtype} "
                         f"{tuple(target_N.shape)}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    return _LinearCrossEntropySum.apply(h_ND, weight_VD, target_N.contiguous(), chunk,
                                        _compute_dtype(h_ND, weight_VD), torch.is_grad_enabled())
