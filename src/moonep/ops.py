"""Local (no communication) steps of dispatch and combine: slot expansion and per-token partial sums.

Shape suffixes: R ranks, S max tokens per rank, K top-k, H hidden, C slot capacity of this rank.

A received token row ``src * S + t`` is expanded into the slots it hits on this rank; combine reduces a
token's slots on this rank into one fp32 partial sum that travels back (one row per token and rank).
On CUDA these run as Triton kernels (`moonep.kernels`), imported on first use; elsewhere as torch ops.
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


def new_slot_rows(C: int, H: int, used: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[C, H]`` slot buffer whose rows from ``used`` (0-d int64 device tensor) on are zero; the others are
    left for `scatter_rows` to fill (no host synchronisation)."""
    if torch.device(device).type != "cuda":
        return torch.zeros((C, H), dtype=dtype, device=device)
    from moonep.kernels import zero_rows_from_triton

    out = torch.empty((C, H), dtype=dtype, device=device)
    zero_rows_from_triton(out, used)
    return out


def scatter_rows(dst_CH: torch.Tensor, src_nH: torch.Tensor, rows_n: torch.Tensor, recv_slots_TK: torch.Tensor) -> None:
    """Store each source row into every slot it hits on this rank.

    Args:
        dst_CH: ``[C, H]`` slot rows, written in place.
        src_nH: ``[n, H]`` token rows (a rank's ``x``, or a chunk of the all-gathered rows).
        rows_n: ``[n]`` int64 received-row index (``src*S + t``) of each source row; -1 skips it.
        recv_slots_TK: ``[R*S, K]`` int64 slot on this rank of each received (row, k); -1 if elsewhere.
    """
    if dst_CH.is_cuda:
        from moonep.kernels import scatter_rows_triton

        scatter_rows_triton(dst_CH, src_nH, rows_n, recv_slots_TK)
        return
    keep = rows_n >= 0
    slots_nK = torch.where(keep[:, None], recv_slots_TK[rows_n.clamp(min=0)], -1)
    for k in range(slots_nK.shape[1]):
        use = slots_nK[:, k] >= 0
        dst_CH.index_copy_(0, slots_nK[use, k], src_nH[use])


def sum_ranks(src_RnH: torch.Tensor, out_mH: torch.Tensor) -> None:
    """``out[t] = sum_r src[r, t]`` for ``t < m``, accumulated in fp32, stored in ``out``'s dtype."""
    if src_RnH.is_cuda:
        from moonep.kernels import sum_ranks_triton

        sum_ranks_triton(src_RnH, out_mH)
        return
    m = out_mH.shape[0]
    out_mH.copy_(torch.sum(src_RnH[:, :m], dim=0, dtype=torch.float32))


def reduce_own_and_sum(
    y_CH: torch.Tensor,
    own_slots_nK: torch.Tensor,
    weights_C: torch.Tensor | None,
    recv_QnH: torch.Tensor,
    rank: int,
    out_mH: torch.Tensor,
) -> None:
    """The remote-only combine's last step: reduce this rank's own token rows and add the peers' partials.

    ``out[t] = sum_r p_r[t]`` in rank order with an fp32 accumulator, where ``p_rank`` is this rank's own
    (weighted) slot sum for token ``t`` rounded to the wire dtype (``recv_QnH``'s), and the other ``p_r``
    are the received partials: bit for bit what `reduce_slots` + all-to-all + `sum_ranks` give, without
    writing, sending and reading back this rank's own partial rows.

    Args:
        y_CH: ``[C, H]`` expert outputs per slot.
        own_slots_nK: ``[n, K]`` int64 slot of each own token's hits on this rank (-1: computed elsewhere).
        weights_C: ``[C]`` fp32 gate weights per slot, or None for an unweighted sum.
        recv_QnH: ``[R-1, n, H]`` partials received from the other ranks (rank order, this rank skipped).
        rank: this rank (where its own partial goes in the rank order).
        out_mH: ``[m, H]`` output rows (``m <= n``), written in their dtype.
    """
    if y_CH.is_cuda:
        from moonep.kernels import reduce_own_and_sum_triton

        reduce_own_and_sum_triton(y_CH, own_slots_nK, weights_C, recv_QnH, rank, out_mH)
        return
    m = out_mH.shape[0]
    own_mH = reduce_slots(y_CH, own_slots_nK[:m], weights_C, recv_QnH.dtype)
    parts = list(recv_QnH[:, :m].unbind(0))
    parts.insert(rank, own_mH)
    out_mH.copy_(torch.sum(torch.stack(parts), dim=0, dtype=torch.float32))


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
