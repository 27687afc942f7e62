"""Local (no communication) steps of dispatch and combine: slot expansion and per-token partial sums.

Shape suffixes: R ranks, S max tokens per rank, K top-k, H hidden, C slot capacity of this rank.

A received token row ``src * S + t`` is expanded into the slots it hits on this rank; combine reduces a
token's slots on this rank into one fp32 partial sum that travels back (one row per token and rank).
On CUDA the reduction runs as a Triton kernel (`moonep.kernels`), imported on first use; elsewhere as
torch ops.
"""

from __future__ import annotations

import torch


def expand_rows(rows_XH: torch.Tensor, slot_src_C: torch.Tensor) -> torch.Tensor:
    """Gather received rows into slots.

    Args:
        rows_XH: ``[R*S + 1, H]`` received rows with a zero row last (unused slots point at it).
        slot_src_C: ``[C]`` int64 row index per slot.

    Returns:
        ``[C, H]`` slot rows.
    """
    return rows_XH.index_select(0, slot_src_C)


def reduce_slots(
    y_CH: torch.Tensor,
    recv_slots_TK: torch.Tensor,
    weights_C: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Per received token row, the (weighted) sum of its slots on this rank, accumulated in fp32.

    Args:
        y_CH: ``[C, H]`` expert outputs per slot.
        recv_slots_TK: ``[T, K]`` int64 slot of each (row, k) on this rank, -1 where the hit is elsewhere.
        weights_C: ``[C]`` fp32 gate weight per slot, or None for an unweighted sum.
        out_dtype: dtype of the partial sums (they travel back in it).

    Returns:
        ``[T, H]`` partial sums in ``out_dtype``.
    """
    if y_CH.is_cuda:
        from moonep.kernels import reduce_slots_triton

        return reduce_slots_triton(y_CH, recv_slots_TK, weights_C, out_dtype)
    T, K = recv_slots_TK.shape
    C, H = y_CH.shape
    acc = torch.zeros((T, H), dtype=torch.float32, device=y_CH.device)
    zero_row = torch.zeros((1, H), dtype=y_CH.dtype, device=y_CH.device)
    y_ext = torch.cat([y_CH, zero_row])
    w_ext = None if weights_C is None else torch.cat([weights_C.float(), weights_C.new_zeros(1, dtype=torch.float32)])
    for k in range(K):
        slot = torch.where(recv_slots_TK[:, k] >= 0, recv_slots_TK[:, k], C)
        rows = y_ext.index_select(0, slot).float()
        acc += rows if w_ext is None else rows * w_ext[slot, None]
    return acc.to(out_dtype)
