"""K1 of one token segment overlapped with K2 of the previous one: the v2 forward over ``P`` segments on two streams.

The tokens of a batch (flattened to ``T_total = B * T`` rows, each fixed-length sequence a varlen piece) are cut
into ``P`` segments at 16-token multiples within each sequence, so every chunk of the unsegmented forward is a chunk
of exactly one segment. K1 of segment ``s + 1`` runs while K2 runs segment ``s``; K2 of a segment starts from the fp32
state that K2 of the previous segment wrote (a sequence crossing a boundary continues from its piece before it).
Per segment ``s`` with token rows ``[a, b)`` and sequences ``lo .. hi - 1``:

- inputs, ``o`` and the workspace's token tensors are the row views ``[a, b)``; ``inv, mqk, glast`` are views of one
  allocation at the segment's chunk offset;
- the sequences' pieces are ``[max(cu[n], a), min(cu[n + 1], b)) - a``, i.e. ``cu_s = clamp(cu[lo : hi + 1], a, b) - a``;
- K2 reads and writes rows ``lo .. hi - 1`` of one ``[N, H, 128, 128]`` fp32 state buffer in place (each CTA loads
  its state slice before it stores the same slice); segment 0 reads the caller's ``initial_state`` instead, and the
  rows of sequences that first appear in a later segment are filled from it (or zeroed) before K2 starts.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from flashkda.fwd.v2.workspace import CHUNK, HEAD_DIM, ChunkLayout, Workspace, build_chunk_layout

__all__ = ["MAX_SEGMENTS", "MIN_SEGMENT_TOKENS", "Segment", "default_segments", "launch_recurrence",
           "plan_segments", "segmented_forward"]

#: Tokens per segment below which splitting does not pay (and the most segments the default rule takes).
MIN_SEGMENT_TOKENS = 2048
MAX_SEGMENTS = 16


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


def _check_cu(cu: Sequence[int]) -> None:
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {list(cu)[:8]}...")


def plan_segments(cu: Sequence[int], num_segments: int) -> list[Segment]:
    """Cut the tokens ``0 .. cu[-1] - 1`` into at most ``num_segments`` segments of about equal size.

    Each cut is moved to the nearest 16-token multiple of the sequence it falls in (or that sequence's end), so
    chunks never straddle segments; cuts that coincide are merged. Empty sequences belong to the segment that holds
    their position (the last one when they sit at the end).

    Args:
        cu: ``[N + 1]`` host cumulative sequence lengths (non-decreasing, from 0).
        num_segments: the wanted number of segments, >= 1.

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
        cuts.add(min(cu[n] + (t - cu[n] + CHUNK // 2) // CHUNK * CHUNK, cu[n + 1]))
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
    from flashkda.fwd.v2.prepare import prepare_fwd

    prepare_fwd(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws=ws)


class _Tiles:
    """``inv, mqk, glast`` of every segment, as views of one allocation each."""

    def __init__(self, rows: int, H: int, device: torch.device):
        self.inv = torch.empty(rows, H, CHUNK, CHUNK, dtype=torch.bfloat16, device=device)
        self.mqk = torch.empty_like(self.inv)
        self.glast = torch.empty(rows, H, HEAD_DIM, dtype=torch.float32, device=device)

    def tensors(self):
        return self.inv, self.mqk, self.glast


def segmented_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    lower_bound: float, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None, output_final_state: bool,
    cu: Sequence[int], cu_seqlens: torch.Tensor | None, segments: list[Segment], *,
    prepare: Callable | None = None, recurrence: Callable | None = None, recurrence_on_side: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The v2 forward over ``segments``: K1 of segment ``s + 1`` overlapped with K2 of segment ``s`` (CUDA).

    Streams: with ``recurrence_on_side`` (default) K1 and the segment layouts run on the caller's stream and K2 on a
    high-priority side stream, so K2's CTAs (the serial chain) are placed before waiting K1 CTAs; otherwise K1 runs
    on a side stream and K2 on the caller's. One event per segment orders K2(s) after K1(s); the caller's stream
    waits for the side stream before returning, so ``o`` and the final state are ready on
    ``torch.cuda.current_stream()``. Nothing synchronises the host (CUDA-graph safe). On the CPU (tests) everything
    runs in order on the host.

    Args:
        q, k: ``[B, T, Hq, 128]`` bf16 contiguous; v, g: ``[B, T, H, 128]``; beta: ``[B, T, H]`` (validated inputs).
        scale, lower_bound, A_log, dt_bias: as for ``prepare_fwd``.
        initial_state: ``[N, H, 128, 128]`` fp32 contiguous or None; output_final_state: return the final state.
        cu: ``[N + 1]`` host token offsets of the sequences in the flattened ``[B * T]`` rows.
        cu_seqlens: the same on the device (``[N + 1]`` int32/int64), or None for fixed length.
        segments: from ``plan_segments(cu, P)``.
        prepare: K1 stand-in ``(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws)`` filling ``ws``
            (default: the Gluon kernel).
        recurrence: K2 stand-in with `launch_recurrence`'s arguments (default: `launch_recurrence`).
        recurrence_on_side: which stream runs K2 (see above).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, 128]`` bf16 (rows after ``cu[-1]`` unwritten), ``final_state``
        ``[N, H, 128, 128]`` fp32 or None.
    """
    prepare = prepare or _prepare_kernel
    recurrence = recurrence or launch_recurrence
    B, T, Hq, _ = q.shape
    H = v.shape[2]
    N = len(cu) - 1
    device = q.device
    rows = B * T
    flat = [x.reshape(1, rows, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o = torch.empty_like(v)
    o_flat = o.view(1, rows, H, v.shape[3])
    state = torch.empty(N, H, HEAD_DIM, v.shape[3], dtype=torch.float32, device=device)
    fresh = segments[0].seq_hi  # rows of sequences that first appear after segment 0
    if initial_state is not None:
        state[fresh:].copy_(initial_state[fresh:])
    else:
        state[fresh:].zero_()
    tokens = [torch.empty(rows, H, HEAD_DIM, dtype=torch.bfloat16, device=device) for _ in range(3)]
    beta_ws = torch.empty(rows, H, dtype=torch.float32, device=device)
    # chunk rows per segment: an upper bound of build_chunk_layout's count, checked when the layout is built
    reserve = [-(-(s.end - s.start) // CHUNK) + max(len(s.lengths) - 1, 0) for s in segments]
    tiles = _Tiles(sum(reserve), H, device)

    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None
    side = _side_stream(device.index if device.index is not None else torch.cuda.current_device(),
                        recurrence_on_side) if caller is not None else None
    k1_stream, k2_stream = (caller, side) if recurrence_on_side else (side, caller)
    if side is not None:
        # the caller's own tensors need no record_stream: its stream waits for the side stream before returning
        side.wait_stream(caller)
        _used_on(side, [o, state, *tokens, beta_ws, *tiles.tensors()])

    layouts: dict[tuple[int, ...], tuple[ChunkLayout, torch.Tensor | None]] = {}
    cu_dev = cu_seqlens
    offset = 0
    for i, seg in enumerate(segments):
        a, b, lo, hi = seg.start, seg.end, seg.seq_lo, seg.seq_hi
        with torch.cuda.stream(k1_stream) if k1_stream is not None else nullcontext():
            built = layouts.get(seg.lengths)
            if built is None:
                if len(seg.lengths) == 1:
                    layout = build_chunk_layout(1, b - a, None, device)
                else:
                    if cu_dev is None:  # fixed length: B sequences of T rows
                        cu_dev = torch.arange(B + 1, dtype=torch.int32, device=device) * T
                    layout = build_chunk_layout(1, b - a, cu_dev[lo:hi + 1].clamp(a, b) - a, device)
                built = layouts[seg.lengths] = (layout, layout.seq_order)
                if k2_stream is not None:  # built on K1's stream, read by K2's
                    _used_on(k2_stream, [layout.chunk_index, layout.seq_chunks, layout.cu_seqlens, built[1]])
            layout, order = built
            if layout.num_chunks > reserve[i]:
                raise RuntimeError(f"segment {i}: {layout.num_chunks} chunk rows, {reserve[i]} reserved")
            nt = slice(offset, offset + layout.num_chunks)
            offset += reserve[i]
            ws = Workspace(kd=tokens[0][a:b], qd=tokens[1][a:b], kr=tokens[2][a:b], inv=tiles.inv[nt],
                           mqk=tiles.mqk[nt], glast=tiles.glast[nt], beta=beta_ws[a:b], layout=layout)
            qs, ks, vs, gs, bs = (x[:, a:b] for x in flat)
            prepare(qs, ks, gs, bs, scale, layout, lower_bound, A_log, dt_bias, ws)
            event = None
            if k1_stream is not None:
                event = torch.cuda.Event()
                event.record(k1_stream)
        with torch.cuda.stream(k2_stream) if k2_stream is not None else nullcontext():
            if event is not None:
                k2_stream.wait_event(event)
            h0 = (initial_state[lo:hi] if initial_state is not None else None) if i == 0 else state[lo:hi]
            recurrence(ws, vs, o_flat[:, a:b], h0, state[lo:hi], order)
    if side is not None:
        caller.wait_stream(side)
    return o, (state if output_final_state else None)
