"""K1 of one token segment overlapped with K2 of the previous one: the v2 forward over ``P`` segments on two streams.

The tokens of a batch (flattened to ``T_total = B * T`` rows, each fixed-length sequence a varlen piece) are cut
into ``P`` segments at chunk multiples (16 or 32 tokens) within each sequence, so every chunk of the unsegmented forward is a chunk
of exactly one segment. K1 of segment ``s + 1`` runs while K2 runs segment ``s``; K2 of a segment starts from the fp32
state that K2 of the previous segment wrote (a sequence crossing a boundary continues from its piece before it).
Per segment ``s`` with token rows ``[a, b)`` and sequences ``lo .. hi - 1``:

- inputs, ``o`` and the workspace's token tensors are the row views ``[a, b)``; ``inv, mqk, glast`` are views of one
  allocation at the segment's chunk offset;
- the sequences' pieces are ``[max(cu[n], a), min(cu[n + 1], b)) - a``, i.e. ``cu_s = clamp(cu[lo : hi + 1], a, b) - a``;
- K2 reads and writes rows ``lo .. hi - 1`` of one ``[N, H, 128, 128]`` fp32 state buffer in place (each CTA loads
  its state slice before it stores the same slice); segment 0 reads the caller's ``initial_state`` instead, and the
  rows of sequences that first appear in a later segment are filled from it (or zeroed) before K2 starts.

The plan (segments, per-segment chunk layouts and tile offsets) is a `SegmentPlan`, built once per batch shape
(fixed length) or per host ``cu_seqlens`` values (varlen) and cached, so a segmented call does no more host work
than its launches.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from flashkda.fwd.v2.workspace import CHUNK, HEAD_DIM, ChunkLayout, Workspace, build_chunk_layout

__all__ = ["K2_CHAINS_PER_SM", "MAX_SEGMENTS", "MIN_SEGMENT_TOKENS", "Segment", "SegmentPlan", "auto_segments",
           "build_segment_plan", "cached_segment_plan", "default_segments", "launch_recurrence", "plan_segments",
           "segmented_forward"]

#: Tokens per segment below which splitting does not pay (and the most segments the default rule takes).
MIN_SEGMENT_TOKENS = 2048
MAX_SEGMENTS = 16
#: K2 CTAs (serial chains) per SM up to which K2 leaves room for K1's CTAs (`auto_segments`).
K2_CHAINS_PER_SM = 2
#: K2 CTAs per (sequence, value head): the recurrences split the 128 state columns in two.
K2_CTAS_PER_HEAD = 2


@dataclass(frozen=True)
class Segment:
    """One token segment: rows ``start .. end - 1`` of the flattened batch, sequences ``seq_lo .. seq_hi - 1``.

    Attributes:
        start, end: token rows of the flattened ``[B * T]`` batch.
        seq_lo, seq_hi: the sequences with a piece (possibly empty) in the segment.
        lengths: token count of each piece, in sequence order (they sum to ``end - start``).
        continues: the first piece continues a sequence begun in the previous segment (its state is handed over).
    """

    start: int
    end: int
    seq_lo: int
    seq_hi: int
    lengths: tuple[int, ...]
    continues: bool


def default_segments(total_tokens: int) -> int:
    """The number of segments for ``total_tokens`` rows: one per `MIN_SEGMENT_TOKENS`, at most `MAX_SEGMENTS`."""
    return max(1, min(MAX_SEGMENTS, total_tokens // MIN_SEGMENT_TOKENS))


def auto_segments(total_tokens: int, num_seqs: int, heads: int, num_sms: int) -> int:
    """The segments ``segments=None`` takes: `default_segments` when K2's chains leave SMs for K1, else 1.

    K2 runs ``num_seqs * heads * 2`` CTAs, each a serial chain. Overlap pays only while those chains use a small
    part of the GPU: up to `K2_CHAINS_PER_SM` chains per SM, K1's CTAs fit beside them and K1's time hides under
    K2's; past that K2 is throughput-bound (varlen 1k x 8 at H64: 1024 CTAs) and K1 could only take SM time from it.

    Args:
        total_tokens: ``B * T`` (or ``cu_seqlens[-1]``).
        num_seqs: sequences ``N``; heads: value heads ``HV``; num_sms: the device's SM count.
    """
    if num_seqs * heads * K2_CTAS_PER_HEAD > K2_CHAINS_PER_SM * num_sms:
        return 1
    return default_segments(total_tokens)


def _check_cu(cu: Sequence[int]) -> None:
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {list(cu)[:8]}...")


def plan_segments(cu: Sequence[int], num_segments: int, chunk: int = CHUNK) -> list[Segment]:
    """Cut the tokens ``0 .. cu[-1] - 1`` into at most ``num_segments`` segments of about equal size.

    Each cut is moved to the nearest ``chunk``-token multiple of the sequence it falls in (or that sequence's end),
    so chunks never straddle segments; cuts that coincide are merged. Empty sequences belong to the segment that holds
    their position (the last one when they sit at the end).

    Args:
        cu: ``[N + 1]`` host cumulative sequence lengths (non-decreasing, from 0).
        num_segments: the wanted number of segments, >= 1.
        chunk: tokens per chunk (16 or 32).

    Returns:
        The segments in token order, covering ``0 .. cu[-1] - 1`` once and every sequence at least once.
    """
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(f"num_segments must be an int >= 1, got {num_segments!r}")
    cu = [int(x) for x in cu]
    _check_cu(cu)
    total, N = cu[-1], len(cu) - 1
    cuts = {0, total}
    for i in range(1, num_segments):
        t = round(i * total / num_segments)
        n = bisect.bisect_right(cu, t) - 1  # cu[n] <= t < cu[n + 1]
        if n >= N:
            continue
        cuts.add(min(cu[n] + (t - cu[n] + chunk // 2) // chunk * chunk, cu[n + 1]))
    bounds = sorted(cuts)
    if len(bounds) == 1:  # no tokens: one empty segment holding every sequence
        bounds = [0, 0]
    segments = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = i == len(bounds) - 2
        # sequences not entirely before a: the one crossing a, those starting at or after a
        lo = next((n for n in range(N) if cu[n + 1] > a or cu[n] >= a), N)
        hi = N if last else next((n for n in range(N) if cu[n] >= b), N)
        lengths = tuple(min(cu[n + 1], b) - max(cu[n], a) for n in range(lo, hi))
        segments.append(Segment(a, b, lo, hi, lengths, lo < N and cu[lo] < a))
    return segments


@functools.cache
def _side_stream(device_index: int, high_priority: bool) -> torch.cuda.Stream:
    # created once per device: CUDA-graph capture may not create streams, and a fresh stream per call leaks
    return torch.cuda.Stream(device=device_index, priority=-1 if high_priority else 0)


def _used_on(stream, tensors) -> None:
    if stream is None:
        return
    for t in tensors:
        if t is not None:
            t.record_stream(stream)


def launch_recurrence(ws: Workspace, v: torch.Tensor, o: torch.Tensor, h0: torch.Tensor | None, ht: torch.Tensor,
                      order: torch.Tensor | None) -> None:
    """K2 of one segment into caller-owned outputs (the segmented form of ``recurrence.recurrence_fwd``).

    Args:
        ws: the segment's workspace (views), its layout with ``N_s`` sequences.
        v: ``[1, T_s, H, 128]`` bf16 row view of the values; o: the same rows of the output (written).
        h0: ``[N_s, H, 128, 128]`` fp32 start states or None (zeros); ht: ``[N_s, H, 128, 128]`` fp32 final states
            (written; may be ``h0`` itself: each CTA reads its slice before writing it).
        order: ``[N_s]`` int32 launch order of the sequences (longest first), or None when ``N_s == 1``.
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashkda.fwd.v2 import recurrence as rec

    rec._check(ws, v, h0, rec.BLOCK_V, rec.STAGES)
    layout = ws.layout
    _, T_s, H, V = v.shape
    if layout.num_chunks == 0 or T_s == 0:
        if h0 is None:
            ht.zero_()
        elif h0.data_ptr() != ht.data_ptr():
            ht.copy_(h0)
        return
    tok_layout, tile_layout = rec._smem_layouts()
    NT = layout.num_chunks

    def tokens(x):
        return TensorDescriptor(x, [T_s, H * HEAD_DIM], [H * HEAD_DIM, 1], [CHUNK, HEAD_DIM], tok_layout)

    def tiles(x):
        return TensorDescriptor(x, [NT * H * CHUNK, CHUNK], [CHUNK, 1], [CHUNK, CHUNK], tile_layout)

    N = layout.num_seqs
    rec._kernel()[(H * (V // rec.BLOCK_V), N)](
        tokens(ws.kd), tokens(ws.qd), tokens(ws.kr), tiles(ws.inv), tiles(ws.mqk),
        ws.glast, ws.beta, v, o, h0 if h0 is not None else ht, ht,
        layout.cu_seqlens, layout.seq_chunks, order if order is not None else layout.seq_chunks,
        v, layout.seq_chunks,  # no training checkpoints (EVERY = 0)
        H=H, BV=rec.BLOCK_V, STAGES=rec.STAGES, USE_ORDER=order is not None, USE_H0=h0 is not None,
        STORE_HT=True, EVERY=0, num_warps=rec.BLOCK_V // 16,
    )


def _prepare_kernel(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws):
    if layout.chunk == CHUNK:
        from flashkda.fwd.v2.prepare import prepare_fwd

        prepare_fwd(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws=ws)
    else:
        from flashkda.fwd.v2.prepare32 import prepare32_fwd

        prepare32_fwd(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws=ws)


def _recurrence_kernel(ws, v, o, h0, ht, order):
    if ws.layout.chunk == CHUNK:
        launch_recurrence(ws, v, o, h0, ht, order)
    else:
        from flashkda.fwd.v2.recurrence32 import launch_recurrence32

        launch_recurrence32(ws, v, o, h0, ht, order)


@dataclass(frozen=True)
class SegmentPlan:
    """Everything a segmented call needs besides its tensors, built once per batch (`cached_segment_plan`).

    Attributes:
        segments: from `plan_segments`.
        layouts: the chunk layout of each segment (segments whose pieces have the same lengths share one).
        tile_offsets: first row of each segment's ``inv, mqk, glast`` in the one allocation of all segments.
        tile_rows: rows of that allocation (each segment reserves its layout's ``num_chunks``).
        chunk: tokens per chunk (16 or 32).
    """

    segments: tuple[Segment, ...]
    layouts: tuple[ChunkLayout, ...]
    tile_offsets: tuple[int, ...]
    tile_rows: int
    chunk: int

    def __len__(self) -> int:
        return len(self.segments)


def build_segment_plan(cu: Sequence[int], segments: Sequence[Segment], cu_seqlens: torch.Tensor | None, T: int,
                       device: torch.device, chunk: int = CHUNK) -> SegmentPlan:
    """The per-segment chunk layouts of ``segments`` (device ops only: no host synchronisation).

    Args:
        cu: ``[N + 1]`` host token offsets of the sequences in the flattened rows.
        segments: ``plan_segments(cu, P, chunk)``.
        cu_seqlens: the same offsets on ``device`` (varlen), or None for fixed length (``cu = b * T``).
        T: rows per batch element of the inputs (fixed length).
        device: where the layouts live.
        chunk: tokens per chunk.
    """
    built: dict[tuple[int, ...], ChunkLayout] = {}
    cu_dev = cu_seqlens
    layouts, offsets, rows = [], [], 0
    for seg in segments:
        layout = built.get(seg.lengths)
        if layout is None:
            a, b = seg.start, seg.end
            if len(seg.lengths) == 1:
                layout = build_chunk_layout(1, b - a, None, device, chunk)
            else:
                if cu_dev is None:  # fixed length: B sequences of T rows
                    cu_dev = torch.arange(len(cu), dtype=torch.int32, device=device) * T
                layout = build_chunk_layout(1, b - a, cu_dev[seg.seq_lo:seg.seq_hi + 1].clamp(a, b) - a, device,
                                            chunk)
            built[seg.lengths] = layout
        layouts.append(layout)
        offsets.append(rows)
        rows += layout.num_chunks
    return SegmentPlan(tuple(segments), tuple(layouts), tuple(offsets), rows, chunk)


_PLANS: dict[tuple, SegmentPlan] = {}
#: segment plans kept (oldest dropped first)
_PLANS_MAX = 16


def cached_segment_plan(B: int, T: int, cu: Sequence[int] | None, cu_seqlens: torch.Tensor | None, num_segments: int,
                        device: torch.device, chunk: int = CHUNK) -> SegmentPlan:
    """`build_segment_plan` of ``plan_segments(cu, num_segments, chunk)``, reused across calls: per ``(B, T)`` for
    fixed length (``cu`` None) and per host offsets ``cu`` for varlen (keyed by value, so a new ``cu_seqlens``
    tensor with the same lengths, or an inference tensor, reuses it). The cached tensors are never written after
    they are built; a model's KDA layers all see one batch, so only the first layer builds its plan.

    Args:
        B, T: shape of the ``[B, T, ...]`` inputs.
        cu: ``[N + 1]`` host offsets (varlen), or None for ``B`` sequences of ``T`` rows.
        cu_seqlens: the device offsets (varlen) or None.
        num_segments: the wanted number of segments ``P``.
        device: the inputs' device.
        chunk: tokens per chunk.
    """
    device = torch.device(device)
    key = (B, T, None if cu is None else tuple(int(x) for x in cu), num_segments, device, chunk)
    plan = _PLANS.get(key)
    if plan is None:
        host = [b * T for b in range(B + 1)] if cu is None else key[2]
        plan = build_segment_plan(host, plan_segments(host, num_segments, chunk), cu_seqlens, T, device, chunk)
        _PLANS[key] = plan
        while len(_PLANS) > _PLANS_MAX:
            del _PLANS[next(iter(_PLANS))]
    return plan


class _Tiles:
    """``inv, mqk, glast`` of every segment, as views of one allocation each."""

    def __init__(self, rows: int, H: int, chunk: int, device: torch.device):
        self.inv = torch.empty(rows, H, chunk, chunk, dtype=torch.bfloat16, device=device)
        self.mqk = torch.empty_like(self.inv)
        self.glast = torch.empty(rows, H, HEAD_DIM, dtype=torch.float32, device=device)

    def tensors(self):
        return self.inv, self.mqk, self.glast


def segmented_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    lower_bound: float, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None, output_final_state: bool,
    cu: Sequence[int], cu_seqlens: torch.Tensor | None, segments: SegmentPlan | list[Segment], *,
    prepare: Callable | None = None, recurrence: Callable | None = None, recurrence_on_side: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The v2 forward over ``segments``: K1 of segment ``s + 1`` overlapped with K2 of segment ``s`` (CUDA).

    Streams: with ``recurrence_on_side`` (default) K1 runs on the caller's stream and K2 on a high-priority side
    stream, so K2's CTAs (the serial chain) are placed before waiting K1 CTAs; otherwise K1 runs on a side stream
    and K2 on the caller's. One event per segment orders K2(s) after K1(s); the caller's stream waits for the side
    stream before returning, so ``o`` and the final state are ready on ``torch.cuda.current_stream()``. Nothing
    synchronises the host (CUDA-graph safe once the plan is cached). On the CPU (tests) everything runs in order on
    the host.

    Args:
        q, k: ``[B, T, Hq, 128]`` bf16 contiguous; v, g: ``[B, T, H, 128]``; beta: ``[B, T, H]`` (validated inputs).
        scale, lower_bound, A_log, dt_bias: as for ``prepare_fwd``.
        initial_state: ``[N, H, 128, 128]`` fp32 contiguous or None; output_final_state: return the final state.
        cu: ``[N + 1]`` host token offsets of the sequences in the flattened ``[B * T]`` rows.
        cu_seqlens: the same on the device (``[N + 1]`` int32/int64), or None for fixed length.
        segments: a `SegmentPlan` (`cached_segment_plan`), or ``plan_segments(cu, P)`` (16-token chunks; its
            layouts are then built in this call).
        prepare: K1 stand-in ``(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws)`` filling ``ws``
            (default: the Gluon kernel of the plan's chunk size).
        recurrence: K2 stand-in with `launch_recurrence`'s arguments (default: the Gluon kernel of the chunk size).
        recurrence_on_side: which stream runs K2 (see above).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, 128]`` bf16 (rows after ``cu[-1]`` unwritten), ``final_state``
        ``[N, H, 128, 128]`` fp32 or None.
    """
    prepare = prepare or _prepare_kernel
    recurrence = recurrence or _recurrence_kernel
    B, T, Hq, _ = q.shape
    H = v.shape[2]
    N = len(cu) - 1
    device = q.device
    plan = segments if isinstance(segments, SegmentPlan) else build_segment_plan(cu, segments, cu_seqlens, T, device)
    rows = B * T
    flat = [x.reshape(1, rows, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o = torch.empty_like(v)
    o_flat = o.view(1, rows, H, v.shape[3])
    state = torch.empty(N, H, HEAD_DIM, v.shape[3], dtype=torch.float32, device=device)
    fresh = plan.segments[0].seq_hi  # rows of sequences that first appear after segment 0
    if fresh < N:
        if initial_state is not None:
            state[fresh:].copy_(initial_state[fresh:])
        else:
            state[fresh:].zero_()
    tokens = [torch.empty(rows, H, HEAD_DIM, dtype=torch.bfloat16, device=device) for _ in range(3)]
    beta_ws = torch.empty(rows, H, dtype=torch.float32, device=device)
    tiles = _Tiles(plan.tile_rows, H, plan.chunk, device)

    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None
    side = _side_stream(device.index if device.index is not None else torch.cuda.current_device(),
                        recurrence_on_side) if caller is not None else None
    k1_stream, k2_stream = (caller, side) if recurrence_on_side else (side, caller)
    if side is not None:
        # the plan's tensors and the caller's need no record_stream: the caller's stream waits for the side stream
        # before returning, so nothing is freed before the side stream's work is done
        side.wait_stream(caller)
        _used_on(side, [o, state, *tokens, beta_ws, *tiles.tensors()])

    for i, (seg, layout) in enumerate(zip(plan.segments, plan.layouts)):
        a, b, lo, hi = seg.start, seg.end, seg.seq_lo, seg.seq_hi
        nt = slice(plan.tile_offsets[i], plan.tile_offsets[i] + layout.num_chunks)
        ws = Workspace(kd=tokens[0][a:b], qd=tokens[1][a:b], kr=tokens[2][a:b], inv=tiles.inv[nt],
                       mqk=tiles.mqk[nt], glast=tiles.glast[nt], beta=beta_ws[a:b], layout=layout)
        qs, ks, vs, gs, bs = (x[:, a:b] for x in flat)
        event = None
        with torch.cuda.stream(k1_stream) if k1_stream is not None else nullcontext():
            prepare(qs, ks, gs, bs, scale, layout, lower_bound, A_log, dt_bias, ws)
            if k1_stream is not None:
                event = torch.cuda.Event()
                event.record(k1_stream)
        with torch.cuda.stream(k2_stream) if k2_stream is not None else nullcontext():
            if event is not None:
                k2_stream.wait_event(event)
            h0 = (initial_state[lo:hi] if initial_state is not None else None) if i == 0 else state[lo:hi]
            recurrence(ws, vs, o_flat[:, a:b], h0, state[lo:hi], layout.seq_order)
    if side is not None:
        caller.wait_stream(side)
    return o, (state if output_final_state else None)
