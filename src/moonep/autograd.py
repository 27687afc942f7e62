"""Autograd for dispatch, combine and redundant-expert weights: each backward is the other's forward.

Shape suffixes: R ranks, S max tokens per rank, s tokens this call, K top-k, H hidden, C slots on this
rank, T = R*S received rows, P home experts, N redundant weight slots (``num_redundant_slots``), W weight dims.

- dispatch: ``x_sH -> x_CH`` (rows all-gathered and stored into slots by the buffer, which passes the
  work in as ``produce``); backward = unweighted combine.
  The gate weights ride along (``topk_weights_sK -> weights_C``); their gradient travels back per hit.
- combine: ``(y_CH, weights_C) -> out_sH``; backward = dispatch of ``grad_out`` with the saved plan.
- prefetch: ``weight_PW -> weight_(P+N)W``; backward = `reduce_grad` (redundant gradients go home).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from moonep.layout import DispatchHandle
from moonep.ops import expand_rows, reduce_own_and_sum, reduce_slots, sum_ranks
from moonep.plan import Plan
from moonep.transports.torch_dist import TorchDistTransport


class Buffer(Protocol):
    """What these functions read of a `moonep.Buffer` (passed in by it; this module never imports it)."""

    num_ranks: int
    rank: int
    S: int
    K: int
    P: int
    num_redundant_slots: int
    chunks: list[tuple[int, int]]
    combine_path: str
    transport: TorchDistTransport


def start_row_gather(buffer: Buffer, x_sH: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start all-gathering token rows; the returned function waits and gives ``[R*S + 1, H]`` (last row 0)."""
    R, S = buffer.num_ranks, buffer.S
    s, H = x_sH.shape
    x_SH = x_sH if s == S else torch.cat([x_sH, x_sH.new_zeros(S - s, H)])
    rows_XH = x_sH.new_empty(R * S + 1, H)
    rows_XH[-1].zero_()
    finish = buffer.transport.start_all_gather(rows_XH[: R * S], x_SH, "dispatch token all_gather")
    return lambda: (finish(), rows_XH)[1]


def gather_rows(buffer: Buffer, handle: DispatchHandle, x_sH: torch.Tensor) -> torch.Tensor:
    """All-gather token rows and expand them into this rank's slots: ``[s, H] -> [C, H]``."""
    return expand_rows(start_row_gather(buffer, x_sH)(), handle.slot_src_C)


def return_rows(
    buffer: Buffer, handle: DispatchHandle, y_CH: torch.Tensor, weights_C: torch.Tensor | None
) -> torch.Tensor:
    """Reduce each token's slots on this rank, send partials home, sum them in fp32: ``[C, H] -> [s, H]``.

    Token chunk by chunk: a chunk's partials travel while the next chunk is reduced. Every rank sends
    every chunk (static shapes), also chunks past its own ``s``.
    """
    transport = buffer.transport
    if buffer.combine_path == "remote_only":
        return _return_rows_remote_only(buffer, handle, y_CH, weights_C)
    if not transport.chunked_combine:
        partial_TH = reduce_slots(y_CH, handle.recv_slots_TK, weights_C, y_CH.dtype)
        return transport.sum_partials(partial_TH, handle.num_tokens).to(y_CH.dtype)
    R, S, K, H, s = buffer.num_ranks, buffer.S, buffer.K, y_CH.shape[1], handle.num_tokens
    slots_RSK = handle.recv_slots_TK.view(R, S, K)
    pending = []
    for first, size in buffer.chunks:
        partial_nH = reduce_slots(y_CH, slots_RSK[:, first : first + size].reshape(R * size, K), weights_C, y_CH.dtype)
        finish = transport.start_all_to_all(torch.empty_like(partial_nH), partial_nH, "combine all_to_all")
        pending.append((first, size, partial_nH, finish))
    out_sH = y_CH.new_empty(s, H)
    for first, size, _, finish in pending:
        back_RnH = finish().view(R, size, H)
        mine = min(max(s - first, 0), size)
        if mine:
            sum_ranks(back_RnH, out_sH[first : first + mine])
    return out_sH


def _return_rows_remote_only(
    buffer: Buffer, handle: DispatchHandle, y_CH: torch.Tensor, weights_C: torch.Tensor | None
) -> torch.Tensor:
    """`return_rows` (``combine_path="remote_only"``): only the other ranks' partial rows travel.

    Per token chunk: the partials of the other ranks' tokens are reduced and sent (``(R-1)*n`` rows, this
    rank's split 0); once a chunk's partials from the peers have landed, this rank's own tokens of that chunk
    are reduced from their slots and summed with them in one pass (`ops.reduce_own_and_sum`), so the own
    partial is never written, copied to itself and read back. Same bits as the all-to-all path.
    """
    R, S, K, H, s = buffer.num_ranks, buffer.S, buffer.K, y_CH.shape[1], handle.num_tokens
    rank = buffer.rank
    slots_RSK = handle.recv_slots_TK.view(R, S, K)
    # The other ranks' rows in rank order: one slice when this rank is first or last, else a small gather.
    if rank == 0:
        others_QSK = slots_RSK[1:]
    elif rank == R - 1:
        others_QSK = slots_RSK[: R - 1]
    else:
        others_QSK = torch.cat([slots_RSK[:rank], slots_RSK[rank + 1 :]])
    pending = []
    for first, size in buffer.chunks:
        remote = others_QSK[:, first : first + size].reshape((R - 1) * size, K)
        partial_nH = reduce_slots(y_CH, remote, weights_C, y_CH.dtype)
        finish = buffer.transport.start_all_to_all_remote(
            torch.empty_like(partial_nH), partial_nH, "combine all_to_all (remote rows)"
        )
        pending.append((first, size, finish))
    out_sH = y_CH.new_empty(s, H)
    for first, size, finish in pending:
        recv_QnH = finish().view(R - 1, size, H)
        mine = min(max(s - first, 0), size)
        if mine:
            own_nK = slots_RSK[rank, first : first + size]
            reduce_own_and_sum(y_CH, own_nK, weights_C, recv_QnH, rank, out_sH[first : first + mine])
    return out_sH


def return_slot_values(buffer: Buffer, handle: DispatchHandle, v_C: torch.Tensor) -> torch.Tensor:
    """Send one value per slot back to its (token, k) on the source rank: ``[C] -> [s, K]`` fp32."""
    R, S, K = buffer.num_ranks, buffer.S, buffer.K
    v_ext = torch.cat([v_C.float(), v_C.new_zeros(1, dtype=torch.float32)])
    slots = handle.recv_slots_TK
    v_TK = v_ext[torch.where(slots >= 0, slots, v_C.shape[0])]
    back = buffer.transport.all_to_all(torch.empty_like(v_TK), v_TK, "gate-gradient all_to_all")
    return back.view(R, S, K)[:, : handle.num_tokens].sum(0)


class DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x_sH: torch.Tensor,
        topk_weights_sK: torch.Tensor,
        weights_C: torch.Tensor,
        buffer: Buffer,
        handle: DispatchHandle,
        produce: Callable[[], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.buffer, ctx.handle, ctx.w_dtype = buffer, handle, topk_weights_sK.dtype
        return produce(), weights_C.clone()

    @staticmethod
    def backward(ctx: Any, grad_x_CH: torch.Tensor, grad_w_C: torch.Tensor) -> tuple[Any, ...]:
        buffer, handle = ctx.buffer, ctx.handle
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = return_rows(buffer, handle, grad_x_CH.contiguous(), None)
        if ctx.needs_input_grad[1]:
            grad_w = return_slot_values(buffer, handle, grad_w_C).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None


class CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        y_CH: torch.Tensor,
        weights_C: torch.Tensor | None,
        buffer: Buffer,
        handle: DispatchHandle,
    ) -> torch.Tensor:
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(y_CH, weights_C)
        return return_rows(buffer, handle, y_CH, weights_C)

    @staticmethod
    def backward(ctx: Any, grad_out_sH: torch.Tensor) -> tuple[Any, ...]:
        y_CH, weights_C = ctx.saved_tensors
        g_CH = gather_rows(ctx.buffer, ctx.handle, grad_out_sH.contiguous().to(y_CH.dtype))
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = g_CH if weights_C is None else (g_CH.float() * weights_C[:, None].float()).to(y_CH.dtype)
        if weights_C is not None and ctx.needs_input_grad[1]:
            grad_w = (y_CH.float() * g_CH.float()).sum(-1).to(weights_C.dtype)
        return grad_y, grad_w, None, None


def _rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A row mask shaped to broadcast over ``like``'s trailing dims, in its dtype."""
    return mask.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def fetch_redundant(buffer: Buffer, plan: Plan, weight_PW: torch.Tensor, out_NW: torch.Tensor) -> torch.Tensor:
    """Write the weights of this rank's redundant experts into ``out_NW`` (``[N, *W]``; zeros past the
    number held). Moves ``R*N`` rows per rank (static shape), of which the holders' rows are real."""
    R, P, N, rank = buffer.num_ranks, buffer.P, buffer.num_redundant_slots, buffer.rank
    ids_RN = plan.redundant_ids_RN[:, :N]
    home_RN = torch.where(ids_RN >= 0, torch.div(ids_RN, P, rounding_mode="floor"), -1)
    mine_RN = home_RN == rank
    # Row n of chunk d: the weight rank d needs in its redundant slot n, if this rank is its home.
    send = weight_PW.index_select(0, torch.where(mine_RN, ids_RN - rank * P, 0).reshape(-1))
    send.mul_(_rows(mine_RN, send))
    recv = buffer.transport.all_to_all(torch.empty_like(send), send, "prefetch_weight all_to_all")
    recv = recv.view(R, N, *weight_PW.shape[1:])
    src_N = home_RN[rank].clamp(min=0)
    torch.index_select(
        recv.view(R * N, *weight_PW.shape[1:]), 0, src_N * N + torch.arange(N, device=src_N.device), out=out_NW
    )
    return out_NW.mul_(_rows(home_RN[rank] >= 0, out_NW))


def prefetch(buffer: Buffer, plan: Plan, weight_PW: torch.Tensor) -> torch.Tensor:
    """Home weights plus the weights of this rank's redundant experts: ``[P, *W] -> [P + N, *W]``."""
    N = buffer.num_redundant_slots
    out = weight_PW.new_empty((weight_PW.shape[0] + N, *weight_PW.shape[1:]))
    out[: weight_PW.shape[0]].copy_(weight_PW)
    if N:
        fetch_redundant(buffer, plan, weight_PW, out[weight_PW.shape[0] :])
    return out


def reduce_grad(buffer: Buffer, plan: Plan, grad_LW: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """Home gradients plus every redundant copy's gradient from the ranks that held it: ``[P+N] -> [P]``.

    With ``inplace`` the result accumulates into ``grad_LW[:P]`` (no copy of the home gradients).
    """
    R, P, N, rank = buffer.num_ranks, buffer.P, buffer.num_redundant_slots, buffer.rank
    home_grad = grad_LW[:P] if inplace else grad_LW[:P].clone()
    if N == 0:
        return home_grad
    ids_RN = plan.redundant_ids_RN[:, :N]
    home_RN = torch.where(ids_RN >= 0, torch.div(ids_RN, P, rounding_mode="floor"), -1)
    ranks = torch.arange(R, device=ids_RN.device)
    to_d_RN = home_RN[rank][None, :] == ranks[:, None]
    send = grad_LW[P:][None] * _rows(to_d_RN, grad_LW).view(R, N, *([1] * (grad_LW.dim() - 1)))
    send = send.reshape(R * N, *grad_LW.shape[1:])
    recv = buffer.transport.all_to_all(torch.empty_like(send), send, "reduce_grad all_to_all")
    # Rows not homed here arrive as zeros (the sender masked them), so adding them to row 0 is harmless.
    from_src = (home_RN == rank).reshape(-1)
    return home_grad.index_add_(0, torch.where(from_src, ids_RN.reshape(-1) - rank * P, 0), recv)


class PrefetchWeightFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight_PW: torch.Tensor, buffer: Buffer, plan: Plan) -> torch.Tensor:
        ctx.buffer, ctx.plan = buffer, plan
        return prefetch(buffer, plan, weight_PW)

    @staticmethod
    def backward(ctx: Any, grad_LW: torch.Tensor) -> tuple[Any, ...]:
        return reduce_grad(ctx.buffer, ctx.plan, grad_LW.contiguous()), None, None
