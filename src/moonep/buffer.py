"""`Buffer`: one object owns an expert-parallel group's communication; layout → dispatch → combine.

Shape suffixes used in this module:
    R  ranks      S  max tokens per rank (``max_tokens_per_rank``)   s  tokens this call (<= S)
    K  top-k      E  routed experts      P  home experts per rank     L  local expert slots (P + E - P)
    H  hidden     C  slots this rank computes (``S*K`` balanced; ``R*S*K`` unbalanced)   W  weight dims

Data path of `dispatch` (torch.distributed transport):
    1. layout exchange (`moonep.layout`): every rank's ``topk_idx`` and gate weights (plus a status word)
       are all-gathered in one small collective;
    2. the all-gather of token rows starts, in ``num_chunks`` token chunks (static shapes; the rows do not
       depend on the plan);
    3. while they travel, every rank computes the same `Plan` on the device and places the hits it
       computes (`route_received`), then stores its own tokens into their slots;
    4. as each chunk lands, its rows are stored into their slots (each row read once, written once per
       hit: `ops.scatter_rows`).
`combine` reduces each token's slots on a rank in fp32 (weighted by the gate; Triton on CUDA) one token
chunk at a time, sends each chunk's partial rows back by all-to-all in the buffer dtype while the next
chunk is reduced, and sums the ``R`` partials with an fp32 accumulator. With ``validate=False`` neither
step synchronises with the host, so a dispatch+combine can be captured in a CUDA graph and replayed with
new routing copied into the captured input tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moonep import autograd as _ag
from moonep import layout as _lay
from moonep.event import EventOverlap
from moonep.layout import DispatchHandle, Layout
from moonep.ops import new_slot_rows, scatter_rows
from moonep.plan import Plan
from moonep.transports.torch_dist import TorchDistTransport

logger = logging.getLogger(__name__)

__all__ = ["Buffer", "DispatchHandle", "DispatchOutput", "PlannedDispatch"]

COMBINE_PATHS = ("all_to_all", "remote_only")


@dataclass(frozen=True, kw_only=True)
class DispatchOutput:
    """What `Buffer.dispatch` returns."""

    x_CH: torch.Tensor
    """``[C, H]`` tokens grouped by local expert (home experts ``0..P-1``, then redundant experts)."""
    weights_C: torch.Tensor
    """``[C]`` fp32 gate weight of each slot (differentiable w.r.t. ``topk_weights``)."""
    counts_L: torch.Tensor
    """``[L]`` int64 slots per local expert."""
    offsets_L: torch.Tensor
    """``[L]`` int64 first slot of each local expert."""
    handle: DispatchHandle
    event: EventOverlap


@dataclass(frozen=True, kw_only=True)
class PlannedDispatch:
    """A micro-batch's plan and this rank's slots, made by `Buffer.plan` ahead of its `Buffer.dispatch`.

    The plan needs only the routing, so it can be made while the previous micro-batch's experts run and
    passed as ``dispatch(..., plan=planned)``, which then moves token rows only. Reusable: dispatching
    other token rows with the same routing (e.g. a backward pass) takes the same object.
    """

    plan: Plan
    """The expert plan (identical on every rank); `Buffer.prefetch_weight` can start from it before dispatch."""
    handle: DispatchHandle
    """This rank's slots; its ``weights_C`` are the gate weights given to `Buffer.plan` (not differentiable:
    `Buffer.dispatch` attaches the differentiable ones)."""
    topk_idx: torch.Tensor
    """``[s, K]`` the routing it was made from; `Buffer.dispatch` must get this very tensor."""
    topk_weights: torch.Tensor
    """``[s, K]`` the gate weights it was made from; `Buffer.dispatch` must get this very tensor."""
    event: EventOverlap
    """Completion of the planning (``async_finish=True``); `Buffer.dispatch` waits for it itself."""


class Buffer:
    """Expert-parallel dispatch/combine for one process group, balanced by online redundant experts.

    Building it is collective (every rank of ``group`` must call it with the same sizes).

    Args:
        group: torch.distributed process group (None: the default group). Backend gloo or NCCL; an NCCL
            group built with ``ProcessGroupNCCL.Options(is_high_priority_stream=True)`` lets its copies
            overlap the slot stores and reductions better (2×H200, H7168: 1.26 vs 1.31 ms per step).
        max_tokens_per_rank: ``S``, the most tokens one rank passes to `dispatch`.
        hidden: ``H``, token width.
        top_k: ``K``, hits per token.
        num_experts: ``E`` routed experts, a multiple of the group size; expert ``e`` lives on rank ``e // P``.
        dtype: dtype of token rows on the wire (``x``'s dtype must match).
        balanced: plan redundant experts so every rank computes ``s*K`` slots; False: every slot on its
            expert's home rank (plain dedup'd expert parallelism, no weight movement).
        num_redundant_slots: how many redundant experts' weights `prefetch_weight` moves per rank
            (default ``min(P, E - P)``).
        timeout_s: seconds a collective may take before `CommError`. gloo: each wait is bounded on the host.
            NCCL: a watchdog thread times every collective from its turn (its issue, or the completion of
            the collective before it) and, past the timeout, aborts the process group and marks the buffer
            broken (see `check_comm`); build the group with a longer timeout of its own, or NCCL's watchdog
            ends the process first. Untested on NCCL so far.
        validate: check values (expert ids, token counts) on every rank before moving data; costs one host
            synchronisation per dispatch. Shapes and dtypes are always checked.
        device: where tensors live (default: ``cuda:<current>`` for NCCL, else CPU).
        transport: ``"torch"`` (torch.distributed collectives), ``"nvlink"`` (token rows and combine
            partials copied straight into peers' symmetric-memory buffers; one node, CUDA only) or
            ``"hierarchical"`` (rail inter-node + intra-node stages; needs ``ranks_per_node``).
        ranks_per_node: ranks of one node, numbered node-major (hierarchical transport only).
        num_chunks: token chunks the dispatch all-gather and the combine all-to-all are split into, so
            the wire of one chunk overlaps the slot stores (dispatch) or the reduction (combine) of
            another (at most ``max_tokens_per_rank``).
        planner: how the plan and this rank's slots are computed from the gathered routing: ``"auto"``
            (fused Triton kernels on CUDA where they fit, else torch ops), ``"fused"`` or ``"torch"``
            (`moonep.layout.Layout`); every choice gives the same plan and slots.
        combine_path: how combine returns partial sums (also dispatch's backward): ``"all_to_all"`` (every
            rank's partial rows of a token chunk, this rank's own included, go through one equal-split
            all-to-all, then the ``R`` partials are summed) or ``"remote_only"`` (only the other ranks'
            partial rows travel; this rank's own tokens are reduced from their slots straight into the
            output together with the received partials: ``S*H`` fewer rows written, self-copied and read
            back per combine). Both give the same bits. ``"remote_only"`` needs ``transport="torch"``.

    Raises:
        ValueError: bad sizes, or ranks disagree on them (raised on every rank).

    Examples::

        buffer = moonep.Buffer(None, max_tokens_per_rank=4096, hidden=7168, top_k=16, num_experts=896)
        out = buffer.dispatch(x_sH, topk_idx_sK, topk_weights_sK)
        y_CH = experts(out.x_CH, out.counts_L)          # grouped GEMM over local experts
        y_sH, _ = buffer.combine(y_CH, out.handle)
        buffer.destroy()
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        max_tokens_per_rank: int,
        hidden: int,
        top_k: int,
        num_experts: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        balanced: bool = True,
        num_redundant_slots: int | None = None,
        timeout_s: float = 60.0,
        validate: bool = True,
        device: torch.device | str | None = None,
        transport: str = "torch",
        ranks_per_node: int | None = None,
        num_chunks: int = 4,
        planner: str = "auto",
        combine_path: str = "all_to_all",
    ) -> None:
        if combine_path not in COMBINE_PATHS:
            raise ValueError(f"combine_path must be one of {COMBINE_PATHS}, got {combine_path!r}")
        if combine_path == "remote_only" and transport != "torch":
            raise ValueError(
                f"combine_path='remote_only' needs transport='torch', got transport={transport!r}; "
                "use combine_path='all_to_all' with that transport"
            )
        if planner not in _lay.PLANNERS:
            raise ValueError(f"planner must be one of {_lay.PLANNERS}, got {planner!r}")
        if transport not in ("torch", "nvlink", "hierarchical"):
            raise ValueError(f"transport must be 'torch', 'nvlink' or 'hierarchical', got {transport!r}")
        if (transport == "hierarchical") != (ranks_per_node is not None):
            raise ValueError("ranks_per_node is required with transport='hierarchical' and only there")
        if transport == "hierarchical":
            from moonep.transports.hierarchical import HierarchicalTransport

            self.transport: TorchDistTransport = HierarchicalTransport(group, timeout_s, ranks_per_node)
        else:
            self.transport = TorchDistTransport(group, timeout_s)
        R = self.transport.world_size
        self.rank, self.num_ranks = self.transport.rank, R
        for name, value in (("hidden", hidden), ("top_k", top_k), ("num_experts", num_experts)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 0:
            raise ValueError(f"max_tokens_per_rank must be an int >= 0, got {max_tokens_per_rank!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts}): a token's experts are distinct")
        if num_experts % R:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size ({R})")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if self.transport.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.S, self.H, self.K, self.E = max_tokens_per_rank, hidden, top_k, num_experts
        self.P = num_experts // R
        self.dtype, self.balanced, self.validate = dtype, balanced, validate
        self.combine_path = combine_path
        self.capacity = self.S * self.K * (1 if balanced else R)
        self.num_redundant_slots = (
            min(self.P, num_experts - self.P) if num_redundant_slots is None else num_redundant_slots
        )
        if not 0 <= self.num_redundant_slots <= num_experts - self.P:
            raise ValueError(f"num_redundant_slots must be in [0, {num_experts - self.P}], got {num_redundant_slots}")
        self.comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        config = torch.tensor(
            [
                *(max_tokens_per_rank, hidden, top_k, num_experts, int(balanced), self.num_redundant_slots),
                *(num_chunks, COMBINE_PATHS.index(combine_path)),
            ],
            dtype=torch.long,
            device=self.device,
        )
        gathered = self.transport.all_gather(config.new_empty(R * config.numel()), config, "Buffer config exchange")
        rows = gathered.view(R, -1).cpu()
        if not bool((rows == rows[0]).all()):
            raise ValueError(
                "ranks disagree on Buffer sizes (max_tokens_per_rank, hidden, top_k, num_experts, balanced, "
                f"num_redundant_slots, num_chunks, combine_path) per rank: {rows.tolist()}; build the Buffer with the "
                "same sizes everywhere"
            )
        self._destroyed = False
        self.layout = Layout(R, self.S, self.K, self.E, self.rank, self.capacity, balanced, self.device, planner)
        n = max(1, min(num_chunks, self.S))
        sizes = [self.S // n + (i < self.S % n) for i in range(n)]
        self.chunks = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
        """``(first token, tokens)`` of each chunk of the ``S`` token positions."""
        self._chunk_rows = []  # received-row index of each row of a gathered chunk; -1 for this rank's own
        for first, size in self.chunks:
            ranks, tokens = torch.arange(R, device=self.device), torch.arange(size, device=self.device)
            rows = ranks[:, None] * self.S + first + tokens[None, :]
            rows[self.rank] = -1
            self._chunk_rows.append(rows.reshape(-1))
        if transport == "nvlink":
            if self.device.type != "cuda":
                raise ValueError(f"transport='nvlink' needs CUDA tensors, got device {self.device}")
            from moonep.transports.nvlink import NVLinkTransport

            row_bytes = R * self.S * self.H * torch.empty((), dtype=dtype).element_size()
            self.transport = NVLinkTransport(group, timeout_s, max(row_bytes, 1 << 20), self.device)

    # -- layout ------------------------------------------------------------------------------------------

    def _status(self, x: torch.Tensor | None, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> int:
        """This rank's input status (`moonep.layout` ``STATUS_*``); ``x=None`` checks the routing only."""
        if topk_idx.dim() != 2 or topk_idx.shape[1] != self.K or topk_weights.shape != topk_idx.shape:
            return _lay.STATUS_SHAPE
        if x is not None and (x.dim() != 2 or x.shape[1] != self.H or topk_idx.shape[0] != x.shape[0]):
            return _lay.STATUS_SHAPE
        if topk_idx.shape[0] > self.S:
            return _lay.STATUS_TOO_MANY
        if (x is not None and x.dtype != self.dtype) or topk_idx.dtype not in (torch.int64, torch.int32):
            return _lay.STATUS_DTYPE
        if not topk_weights.is_floating_point():
            return _lay.STATUS_DTYPE
        if any(t is not None and t.device != self.device for t in (x, topk_idx, topk_weights)):
            return _lay.STATUS_DTYPE
        return _lay.STATUS_OK

    def get_dispatch_layout(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None) -> Plan:
        """Exchange every rank's routing and plan the micro-batch (collective; no host sync unless validating).

        Args:
            topk_idx: ``[s, K]`` int64/int32 expert ids, -1 for no selection.
            topk_weights: ``[s, K]`` gate weights (default: ones); only `dispatch` uses them.

        Returns:
            The `Plan`, identical on every rank.

        Raises:
            ValueError: on every rank, when any rank passed invalid input (and ``validate`` is on).
        """
        self._check_alive()
        if topk_weights is None:
            topk_weights = torch.ones(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        return self._exchange_layout(topk_idx, topk_weights, self._status(None, topk_idx, topk_weights))[0]

    def plan(
        self,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
    ) -> PlannedDispatch:
        """Plan a micro-batch ahead of its dispatch: layout exchange, plan and this rank's slots (collective).

        Everything `dispatch` does before moving token rows, from the routing alone: e.g. plan micro-batch
        ``n + 1`` on the communication stream while micro-batch ``n``'s experts run, then
        ``dispatch(x, topk_idx, topk_weights, plan=planned)`` moves only the token rows. No host
        synchronisation unless ``validate``.

        Args:
            topk_idx: ``[s, K]`` int64/int32 expert ids, -1 for no selection (``s <= max_tokens_per_rank``).
            topk_weights: ``[s, K]`` floating gate weights (carried by the handle; applied in `combine`).
            previous_event: wait for this event before starting (CUDA).
            async_finish: run on the buffer's communication stream and return at once; the result's
                ``event`` marks completion (`dispatch` waits for it).

        Returns:
            A `PlannedDispatch` for ``dispatch(..., plan=...)`` with these very ``topk_idx``/``topk_weights``.

        Raises:
            ValueError: any rank passed invalid routing (raised on every rank; values checked if ``validate``).
            CommError: a peer died or stalled.

        Examples::

            planned = buffer.plan(idx_next, w_next, async_finish=True)  # overlaps this micro-batch's experts
            y = experts(out.x_CH, out.counts_L)
            ...
            out_next = buffer.dispatch(x_next, idx_next, w_next, plan=planned)
        """
        self._check_alive()
        status = self._status(None, topk_idx, topk_weights)
        stream = self._enter(previous_event, async_finish)
        with _maybe_stream(stream):
            plan, hits = self._exchange_layout(topk_idx, topk_weights, status)
            handle = self.layout.handle(plan, hits, topk_idx.shape[0])
        tensors = [getattr(obj, f.name) for obj in (plan, handle) for f in dataclasses.fields(obj)]
        event = self._leave(stream, async_finish, tuple(t for t in tensors if isinstance(t, torch.Tensor)))
        return PlannedDispatch(plan=plan, handle=handle, topk_idx=topk_idx, topk_weights=topk_weights, event=event)

    def _check_planned(
        self, planned: PlannedDispatch, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> None:
        """`dispatch(..., plan=planned)`'s input checks; with ``validate`` every rank learns every rank's status."""
        if not isinstance(planned, PlannedDispatch):
            raise TypeError(f"plan must be the PlannedDispatch from Buffer.plan(), got {type(planned).__name__}")
        if topk_idx is not planned.topk_idx or topk_weights is not planned.topk_weights:
            status = _lay.STATUS_PLAN
        else:
            status = self._status(x, topk_idx, topk_weights)
        if not self.validate:
            # No collective here: a bad rank raises alone and its peers see `CommError` at the token all-gather.
            if status != _lay.STATUS_OK:
                raise ValueError(f"this rank (rank {self.rank}) {_lay.STATUS_TEXT[status]}")
            return
        mine = torch.tensor([status], dtype=torch.int32, device=self.device)
        statuses = self.transport.all_gather(mine.new_empty(self.num_ranks), mine, "dispatch status exchange")
        found = [f"rank {r} {_lay.STATUS_TEXT[c]}" for r, c in enumerate(statuses.tolist()) if c != _lay.STATUS_OK]
        self.transport.check()
        if found:
            raise ValueError("; ".join(found) + f" (buffer: max_tokens_per_rank={self.S}, hidden={self.H})")

    def _exchange_layout(
        self,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        status: int,
        before_plan: Callable[[], object] | None = None,
    ) -> tuple[Plan, _lay.FlatHits | _lay.SortedHits]:
        """Layout all-gather, the checks (if validating), ``before_plan()`` (issues the token rows), the plan."""
        if status == _lay.STATUS_OK:
            row = self.layout.row(topk_idx, topk_weights)
        else:
            row = _lay.empty_row(status, self.S, self.K, self.device)
        gathered = self.transport.all_gather(row.new_empty(self.num_ranks * row.numel()), row, "layout exchange")
        gathered = gathered.view(self.num_ranks, -1)
        if self.validate or status != _lay.STATUS_OK:
            found = _lay.problems(gathered, self.S, self.K, self.E)
            # That was a host synchronisation: on NCCL a stalled exchange returns only once the watchdog
            # aborted the group, and then the gathered rows are garbage.
            self.transport.check()
            if found:
                raise ValueError(
                    "; ".join(found) + f" (buffer: max_tokens_per_rank={self.S}, hidden={self.H}, top_k={self.K}, "
                    f"num_experts={self.E}, dtype={self.dtype}, device={self.device})"
                )
        if before_plan is not None:
            before_plan()
        return self.layout.plan(gathered)

    # -- dispatch / combine -----------------------------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        plan: PlannedDispatch | None = None,
    ) -> DispatchOutput:
        """Send each token once to every rank that computes one of its hits; expand into expert slots.

        Collective. Differentiable in ``x`` and ``topk_weights`` (backward is a combine).

        Args:
            x: ``[s, H]`` tokens, ``s <= max_tokens_per_rank``, dtype ``self.dtype``.
            topk_idx: ``[s, K]`` int64/int32 expert ids; -1 means no selection.
            topk_weights: ``[s, K]`` floating gate weights (travel with the handle; applied in `combine`).
            previous_event: wait for this event before starting (CUDA).
            async_finish: run on the buffer's communication stream and return at once; ``event`` then
                marks completion (use it as ``with event:``).
            plan: a `PlannedDispatch` from `Buffer.plan` for these ``topk_idx``/``topk_weights`` (the same
                tensor objects): no layout exchange and no planning here, only the token rows move (every
                rank passes one, or none). With ``validate``, one small status all-gather keeps bad input an
                error on every rank; without, a bad rank raises alone and its peers time out (`CommError`).

        Returns:
            A `DispatchOutput`; ``x_CH`` has ``C`` rows (exactly ``s*K`` per rank when balanced and every
            rank passes ``s`` tokens with ``K`` hits each); unused rows are zero.

        Raises:
            ValueError: any rank passed invalid input (raised on every rank).
            CommError: a peer died or stalled.
        """
        self._check_alive()
        if plan is not None:
            self._check_planned(plan, x, topk_idx, topk_weights)
        else:
            status = self._status(x, topk_idx, topk_weights)
        stream = self._enter(previous_event, async_finish)
        with _maybe_stream(stream):
            pending: list = []
            if plan is not None:
                if plan.event.event is not None:  # planned on the communication stream
                    torch.cuda.current_stream(self.device).wait_event(plan.event.event)
                pending.extend(self._start_token_gather(x))
                handle = plan.handle
            else:
                # Token rows do not depend on the plan: they start moving right after the layout exchange
                # (and its checks), and the plan is computed while they travel.
                expert_plan, hits = self._exchange_layout(
                    topk_idx, topk_weights, status, lambda: pending.extend(self._start_token_gather(x))
                )
                handle = self.layout.handle(expert_plan, hits, x.shape[0])

            def produce() -> torch.Tensor:
                return self._store_rows(x.detach(), handle, pending)

            x_CH, w_C = _ag.DispatchFunction.apply(x, topk_weights, handle.weights_C, self, handle, produce)
            # The handle given to the caller carries the differentiable weights, so combine(y, handle)
            # trains the router too.
            handle = dataclasses.replace(handle, weights_C=w_C)
        counts_L = handle.local_counts_L
        offsets_L = counts_L.cumsum(0) - counts_L
        event = self._leave(stream, async_finish, (x_CH, w_C, counts_L, offsets_L))
        return DispatchOutput(
            x_CH=x_CH, weights_C=w_C, counts_L=counts_L, offsets_L=offsets_L, handle=handle, event=event
        )

    def combine(
        self,
        y_CH: torch.Tensor,
        handle: DispatchHandle,
        weights_C: torch.Tensor | None = None,
        *,
        apply_weights: bool = True,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
    ) -> tuple[torch.Tensor, EventOverlap]:
        """Return expert outputs to their tokens: ``out[t] = sum_k w[t,k] * y[slot(t,k)]``, summed in fp32.

        Collective. Differentiable in ``y_CH`` and the gate weights (backward is a dispatch with the
        saved plan).

        Args:
            y_CH: ``[C, H]`` expert outputs in slot order (as `dispatch` laid them out).
            handle: the dispatch's handle (``DispatchOutput.handle``); it carries the slots' gate weights.
            weights_C: ``[C]`` gate weights per slot to use instead of the handle's.
            apply_weights: False for a plain sum of the ``K`` outputs (gate applied inside the experts).

        Returns:
            ``(out_sH, event)``: ``[s, H]`` in ``y_CH``'s dtype. Each rank's partial sum travels in that dtype.

        Raises:
            ValueError: ``y_CH`` does not have ``C`` rows of width ``H``, or ``weights_C`` not ``C`` rows.
            CommError: a peer died or stalled.
        """
        self._check_alive()
        if y_CH.dim() != 2 or y_CH.shape != (self.capacity, self.H):
            raise ValueError(f"y_CH must be [{self.capacity}, {self.H}], got {tuple(y_CH.shape)}")
        if weights_C is not None and weights_C.shape != (self.capacity,):
            raise ValueError(f"weights_C must be [{self.capacity}] or None, got {tuple(weights_C.shape)}")
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle from dispatch(), got {type(handle).__name__}")
        if apply_weights and weights_C is None:
            weights_C = handle.weights_C
        stream = self._enter(previous_event, async_finish)
        with _maybe_stream(stream):
            out = _ag.CombineFunction.apply(y_CH, weights_C if apply_weights else None, self, handle)
        return out, self._leave(stream, async_finish, (out,))

    # -- redundant experts --------------------------------------------------------------------------------

    def prefetch_weight(self, plan: Plan, weight_P: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Fetch the weights of this rank's redundant experts from their home ranks (collective).

        Differentiable: its backward is `reduce_grad`, so gradients of redundant copies reach home.

        Args:
            plan: the micro-batch's plan.
            weight_P: ``[P, *W]`` this rank's home experts' weights (any dtype).
            out: optional ``[num_redundant_slots, *W]`` destination for the redundant experts only (no copy
                of the home weights, no autograd); e.g. the tail of a persistent ``[P + N, *W]`` stack.

        Returns:
            ``[P + num_redundant_slots, *W]``: home weights, then the redundant table's experts (zeros past
            the number this rank holds); or ``out`` filled, when given.

        Raises:
            ValueError: ``weight_P`` has not ``P`` rows, or (with ``validate``) a rank needs more redundant
                experts than ``num_redundant_slots``.
        """
        if weight_P.dim() < 1 or weight_P.shape[0] != self.P:
            raise ValueError(f"weight_P must have {self.P} rows (home experts), got shape {tuple(weight_P.shape)}")
        if self.validate:
            self.check_plan(plan)
        if out is not None:
            if out.shape != (self.num_redundant_slots, *weight_P.shape[1:]) or out.dtype != weight_P.dtype:
                raise ValueError(
                    f"out must be [{self.num_redundant_slots}, {', '.join(map(str, weight_P.shape[1:]))}] "
                    f"{weight_P.dtype}, got {tuple(out.shape)} {out.dtype}"
                )
            with torch.no_grad():
                return _ag.fetch_redundant(self, plan, weight_P, out)
        return _ag.PrefetchWeightFunction.apply(weight_P, self, plan)

    def check_plan(self, plan: Plan) -> None:
        """Raise ValueError if a rank holds more redundant experts than ``num_redundant_slots`` (host sync)."""
        most = int(plan.num_redundant_R.max())
        if most > self.num_redundant_slots:
            raise ValueError(
                f"the plan needs {most} redundant experts on one rank but the buffer was built with "
                f"num_redundant_slots={self.num_redundant_slots}; raise it (at most {self.E - self.P})"
            )

    def reduce_grad(self, plan: Plan, grad_L: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """Sum redundant copies' gradients into their home experts (collective).

        Args:
            plan: the plan the weights were prefetched with.
            grad_L: ``[P + num_redundant_slots, *W]`` gradients of the prefetched weights.
            inplace: accumulate into ``grad_L[:P]`` and return that view (saves a copy of the home rows).

        Returns:
            ``[P, *W]`` gradient of this rank's home experts.
        """
        if grad_L.dim() < 1 or grad_L.shape[0] != self.P + self.num_redundant_slots:
            raise ValueError(
                f"grad_L must have {self.P + self.num_redundant_slots} rows, got shape {tuple(grad_L.shape)}"
            )
        return _ag.reduce_grad(self, plan, grad_L, inplace=inplace)

    def check_comm(self) -> None:
        """Raise `CommError` if one of this buffer's collectives failed or timed out (no host synchronisation).

        On gloo a fault raises inside the call that waits for it. On NCCL the calls return before their
        collectives finish, so a stall found by the watchdog raises from the buffer's next call, or from
        this check (e.g. once per step, or after a ``torch.cuda.synchronize()`` that the abort released).

        Raises:
            CommError: a peer died or stalled; destroy this buffer and rebuild the process group.
        """
        self.transport.check()

    def destroy(self) -> None:
        """Free communication resources; the buffer is unusable afterwards (idempotent)."""
        self._destroyed = True
        self.comm_stream = None
        self.transport.close()

    # -- internals ------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed; build a new one")
        self.transport.check()

    def _enter(self, previous_event: EventOverlap | None, async_finish: bool) -> torch.cuda.Stream | None:
        """The stream to issue on: the communication stream when ``async_finish``, else the current one.

        The communication stream is only touched when used, so a synchronous call can be captured in a
        CUDA graph (a stream forked into a capture and never joined back would break it).
        """
        if self.comm_stream is None:
            return None
        if not async_finish:
            if previous_event is not None:
                previous_event.current_stream_wait()
            return None
        if previous_event is not None and previous_event.event is not None:
            self.comm_stream.wait_event(previous_event.event)
        self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.comm_stream

    def _leave(
        self, stream: torch.cuda.Stream | None, async_finish: bool, outputs: tuple[torch.Tensor, ...]
    ) -> EventOverlap:
        if stream is None or not async_finish:
            return EventOverlap(None)
        event = torch.cuda.Event()
        event.record(stream)
        current = torch.cuda.current_stream(self.device)
        for tensor in outputs:
            tensor.record_stream(current)
        return EventOverlap(event, outputs)

    def _start_token_gather(
        self, x_sH: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Tensor]]]:
        """Issue the chunked all-gather of token rows: per chunk ``(rows_n, gathered [R*n, H], finish)``."""
        s, H = x_sH.shape
        x_SH = x_sH.detach() if s == self.S else torch.cat([x_sH.detach(), x_sH.new_zeros(self.S - s, H)])
        pending = []
        for (first, size), rows in zip(self.chunks, self._chunk_rows):
            out = x_SH.new_empty(self.num_ranks * size, H)
            finish = self.transport.start_all_gather(out, x_SH[first : first + size], "dispatch token all_gather")
            pending.append((rows, out, finish))
        return pending

    def _store_rows(self, x_sH: torch.Tensor, handle: DispatchHandle, pending: list) -> torch.Tensor:
        """``[C, H]`` slots: this rank's tokens first, then each gathered chunk's rows as it lands."""
        x_CH = new_slot_rows(self.capacity, self.H, handle.local_counts_L.sum(), self.dtype, self.device)
        s = x_sH.shape[0]
        own = self.rank * self.S + torch.arange(s, device=self.device)
        scatter_rows(x_CH, x_sH.contiguous(), own, handle.recv_slots_TK)
        for rows, out, finish in pending:
            finish()
            scatter_rows(x_CH, out, rows, handle.recv_slots_TK)
        return x_CH


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _maybe_stream(stream: torch.cuda.Stream | None) -> object:
    return torch.cuda.stream(stream) if stream is not None else _NullContext()
