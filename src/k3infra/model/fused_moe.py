"""A Triton kernel for the local expert path's slot sums: each token's ``K`` rows of a slot-ordered tensor, summed.

The local path (`moe.K3MoE`) sorts the ``s·K`` (token, expert) pairs by expert into ``C = s·K`` slots. Two steps
sum each token's ``K`` slot rows: the combine of the experts' outputs (forward) and the gradient of the sorted copies
of the tokens (backward). In torch that is a gather of all ``C`` rows into token order, then a sum over ``K``: the
``[C, L]`` rows are written and read once more. `slot_sum` reads each slot row once, accumulates in fp32 and writes
the ``[s, L]`` sums: 2 + 4/K bytes per bf16 slot element (fp32 sums) against the torch path's 6 + 4/K.
`fused.MODE` decides where it runs (`fused.use_fused`), also inside ``torch.compile``'s graphs (it is the
operator ``k3infra::slot_sum`` there).

Shape suffixes: s tokens, K slots per token, C = s·K slots, L row width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3infra.model import fused

__all__ = ["slot_sum"]

_BLOCK_S = 8
_MAX_BLOCK_L = 512


@triton.jit
def _slot_sum_kernel(src_ptr, slots_ptr, out_ptr, S, L, K: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_L: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < S
    mask = row_ok[:, None] & (cols < L)[None, :]
    acc = tl.zeros([BLOCK_S, BLOCK_L], dtype=tl.float32)
    for k in tl.static_range(K):
        slot = tl.load(slots_ptr + rows.to(tl.int64) * K + k, mask=row_ok, other=0).to(tl.int64)
        acc += tl.load(src_ptr + slot[:, None] * L + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * L + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def slot_sum(src_CL: torch.Tensor, slots_sK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = Σ_k src_CL[slots_sK[t, k]]``, accumulated in fp32 (fp64 for fp64 inputs), returned in ``dtype``.

    Args:
        src_CL: ``[C, L]`` rows (fp32, bf16, fp16 or fp64).
        slots_sK: ``[s, K]`` int64 row indices into ``src_CL`` (each token's slots).
        dtype: the output dtype.

    Returns:
        ``[s, L]`` in ``dtype``.
    """
    if src_CL.dim() != 2:
        raise ValueError(f"slot_sum: src_CL must be [C, L], got shape {tuple(src_CL.shape)}")
    if slots_sK.dim() != 2 or slots_sK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_sum: slots_sK must be an int32/int64 [s, K] tensor, got {slots_sK.dtype} "
                         f"{tuple(slots_sK.shape)}")
    if not fused.use_fused(src_CL, while_compiling=True) or src_CL.device != slots_sK.device:
        s, K = slots_sK.shape
        acc = torch.promote_types(src_CL.dtype, torch.float32)
        return src_CL[slots_sK.flatten()].view(s, K, -1).sum(1, dtype=acc).to(dtype)
    return _slot_sum_op(src_CL.contiguous(), slots_sK.contiguous(), dtype)


@torch.library.custom_op("k3infra::slot_sum", mutates_args=())
def _slot_sum_op(src_CL: torch.Tensor, slots_sK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # an operator, so that compiled graphs (and the backward graphs of the autograd Functions that call it) call
    # the kernel with real tensors
    s, K = slots_sK.shape
    L = src_CL.shape[1]
    out = torch.empty(s, L, dtype=dtype, device=src_CL.device)
    if s and L:
        block_l = min(_MAX_BLOCK_L, triton.next_power_of_2(L))
        grid = (triton.cdiv(s, _BLOCK_S), triton.cdiv(L, block_l))
        _slot_sum_kernel[grid](src_CL, slots_sK, out, s, L, K=K, BLOCK_S=_BLOCK_S, BLOCK_L=block_l, num_warps=4)
    return out


@_slot_sum_op.register_fake
def _(src_CL, slots_sK, dtype):
    return src_CL.new_empty(slots_sK.shape[0], src_CL.shape[1], dtype=dtype)
