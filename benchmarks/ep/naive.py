"""The baseline: a naive expert-parallel dispatcher (Megatron-style all-to-all, no dedup, no balancing).

Shape suffixes: s tokens, K top-k, H hidden, R ranks, P experts per rank, M received copies.

Dispatch copies every token ``K`` times (one copy per hit), sorts the copies by destination rank, exchanges
the per-rank counts and reads them on the host (``.tolist()``: a host synchronisation), then moves the
copies with a variable-split ``all_to_all_single`` and sorts them by local expert. Combine runs the same
steps backwards and sums the ``K`` weighted outputs of each token in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class NaiveHandle:
    order_sK: torch.Tensor
    """``[s*K]`` hits sorted by destination rank."""
    local_order_M: torch.Tensor
    """``[M]`` received copies sorted by local expert."""
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


def naive_dispatch(
    x_sH: torch.Tensor, topk_idx_sK: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor, NaiveHandle]:
    """Returns ``(x_MH grouped by local expert, counts per local expert [P], handle)``."""
    R = dist.get_world_size(group)
    P = num_experts // R
    s, K = topk_idx_sK.shape
    flat = topk_idx_sK.reshape(-1)
    dest = torch.div(flat, P, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    x_copies = x_sH.index_select(0, torch.div(order, K, rounding_mode="floor"))
    send_counts = torch.bincount(dest, minlength=R)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # host synchronisation
    x_recv = x_sH.new_empty(sum(recv_splits), x_sH.shape[1])
    dist.all_to_all_single(x_recv, x_copies, recv_splits, send_splits, group=group)
    e_recv = flat.new_empty(sum(recv_splits))
    dist.all_to_all_single(e_recv, flat[order], recv_splits, send_splits, group=group)
    local_e = e_recv - dist.get_rank(group) * P
    local_order = torch.sort(local_e, stable=True).indices
    counts = torch.bincount(local_e, minlength=P)
    handle = NaiveHandle(
        order_sK=order, local_order_M=local_order, send_splits=send_splits, recv_splits=recv_splits, num_tokens=s
    )
    return x_recv.index_select(0, local_order), counts, handle


def naive_combine(
    y_MH: torch.Tensor, topk_weights_sK: torch.Tensor, handle: NaiveHandle, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * y[copy(t,k)]`` in fp32, returned in ``y_MH``'s dtype: ``[s, H]``."""
    y_recv_order = torch.empty_like(y_MH)
    y_recv_order[handle.local_order_M] = y_MH
    y_back = y_MH.new_empty(sum(handle.send_splits), y_MH.shape[1])
    dist.all_to_all_single(y_back, y_recv_order, handle.send_splits, handle.recv_splits, group=group)
    y_hits = torch.empty_like(y_back)
    y_hits[handle.order_sK] = y_back
    s, K = topk_weights_sK.shape
    out = (y_hits.view(s, K, -1).float() * topk_weights_sK.float()[:, :, None]).sum(1)
    return out.to(y_MH.dtype)
