"""B3 of the v2 backward: the chunk-local gradients, from the checkpoints, B2's state gradients and the workspace.

Two kernels through an fp32 scratch (`local_split_kernel`): B3a, the sequential state part per (checkpoint segment,
value head) with the whole state ``[K, K]`` (K = 64 or 128) in registers, then B3b, K1 backwards per (chunk, value head); B3b is the
Gluon kernel of `local_k1_gluon` on a Hopper GPU at 16-token chunks, else the Triton one (chunk 32, and the CPU).

Kernels are imported on the first launch only; on a machine without a GPU the Triton ones run under
``TRITON_INTERPRET=1`` on CPU tensors. The torch twin of B3 is the ``B1`` + ``B3`` stages of
``emulate.emulate_backward`` (``_states`` and ``_local_grads``) plus the reductions after them.
"""

from __future__ import annotations

import functools

import torch

from flashkda.bwd.v2.checkpoints import checkpoint_bound, checkpoint_offsets
from flashkda.bwd.v2.emulate import KDAGrads
from flashkda.bwd.v2.tail import zero_rows_past_end
from flashkda.fwd.v2.workspace import HEAD_DIMS, ChunkLayout, Workspace

__all__ = ["CHUNKS", "local_grads_bwd", "segment_table"]

#: The chunk sizes B3 serves (K1's workspaces of `workspace` and `workspace32`).
CHUNKS = (16, 32)
#: B3a's warps per program: 255 registers, one CTA per SM (the warp-count A/B: ``docs/flashkda-v2-backward.md``).
B3A_NUM_WARPS = 8
#: The Gluon B3b's per-thread register cap (``maxnreg``): two CTAs per SM; faster than uncapped (one CTA) and 64.
K1_GLUON_MAX_REGISTERS = 128


@functools.cache
def _split_kernels(gluon_k1: bool):
    """The split's B3a and B3b kernels, and the launch options the Gluon B3b is built for (None: the Triton B3b,
    launched at 8 warps)."""
    from flashkda.bwd.v2 import local_split_kernel

    walk = local_split_kernel.kda_bwd_v2_local_state_kernel
    if not gluon_k1:
        return walk, local_split_kernel.kda_bwd_v2_local_chunk_kernel, None
    from flashkda.bwd.v2 import local_k1_gluon

    k1_launch = dict(num_warps=int(local_k1_gluon.NUM_WARPS), maxnreg=K1_GLUON_MAX_REGISTERS)
    return walk, local_k1_gluon.kda_bwd_v2_k1_gluon_kernel, k1_launch


def _unfilled(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output every element of which the kernels write (`torch.empty`; the tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _gluon_k1(device: torch.device, C: int) -> bool:
    """Whether B3b runs the Gluon kernel: 16-token chunks on a Hopper GPU."""
    return device.type == "cuda" and C == 16 and torch.cuda.get_device_capability(device)[0] == 9


def segment_table(layout: ChunkLayout, every: int) -> torch.Tensor:
    """``[NSEG, 2]`` int32 (first chunk, chunks) of each checkpoint segment, segment ``s`` starting at checkpoint
    row ``s`` (`checkpoint_offsets`); ``NSEG = checkpoint_bound(layout, every)``, rows past the last segment
    ``(0, 0)``. Device ops only (no host synchronisation)."""
    dev = layout.seq_chunks.device
    n_seg = checkpoint_bound(layout, every)
    ck = checkpoint_offsets(layout, every, dev)
    seq_chunks = layout.seq_chunks.long()
    s = torch.arange(n_seg, device=dev, dtype=torch.long)
    n = torch.searchsorted(ck[1:], s, right=True).clamp(max=max(layout.num_seqs - 1, 0))
    first = seq_chunks[n] + (s - ck[n]) * every
    count = torch.clamp(seq_chunks[n + 1] - first, min=0, max=every)
    live = s < ck[-1]
    return torch.stack([torch.where(live, first, 0), torch.where(live, count, 0)], 1).to(torch.int32).contiguous()


def _check(q, k, v, g, beta, do, ws, checkpoints, ds, every):
    C = int(ws.inv.shape[-1])
    if C not in CHUNKS or ws.layout.chunk != C:
        raise ValueError(f"ws must have 16- or 32-token chunks, got inv {tuple(ws.inv.shape)} and a layout of "
                         f"{ws.layout.chunk}-token chunks")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be a positive int (chunks between state checkpoints), got {every!r}")
    if g.dim() != 4 or g.shape[3] not in HEAD_DIMS:
        raise ValueError(f"g must be [B, T, HV, K] with K in {HEAD_DIMS}, got {tuple(g.shape)}")
    B, T, HV, K = g.shape
    for name, x, heads in (("q", q, q.shape[2]), ("k", k, q.shape[2]), ("v", v, HV), ("g", g, HV), ("do", do, HV)):
        if x.dim() != 4 or tuple(x.shape) != (B, T, heads, K) or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{B}, {T}, {heads}, {K}] (g's), got {tuple(x.shape)}")
        if x.device != g.device:
            raise ValueError(f"{name} is on {x.device}, g on {g.device}")
    if HV % q.shape[2] != 0:
        raise ValueError(f"g has {HV} value heads, not a multiple of q's {q.shape[2]} heads")
    if tuple(beta.shape) != (B, T, HV) or not beta.is_contiguous():
        raise ValueError(f"beta must be contiguous [{B}, {T}, {HV}], got {tuple(beta.shape)}")
    if tuple(ws.kd.shape) != (B * T, HV, K) or ws.layout.total_tokens != B * T:
        raise ValueError(f"ws has kd {tuple(ws.kd.shape)}, expected [{B * T}, {HV}, {K}]")
    n_ck = checkpoint_bound(ws.layout, every)
    if checkpoints.dim() != 4 or tuple(checkpoints.shape[1:]) != (HV, K, K) \
            or checkpoints.shape[0] < n_ck or not checkpoints.is_contiguous():
        raise ValueError(f"checkpoints must be contiguous [>= {n_ck}, {HV}, {K}, {K}] for every={every}, "
                         f"got {tuple(checkpoints.shape)}")
    if tuple(ds.shape) != (ws.layout.num_chunks, HV, K, K) or not ds.is_contiguous():
        raise ValueError(f"ds must be contiguous [{ws.layout.num_chunks}, {HV}, {K}, {K}], got {tuple(ds.shape)}")


def _scratch_floats(C: int, K: int) -> int:
    """fp32 scratch floats per (chunk, value head) between B3a and B3b: dkd, dqd, dkr, dU W^T, do U^T, dglast,
    db."""
    return 3 * C * K + 2 * C * C + K + C


def _group_bounds(seg: torch.Tensor, group: int) -> torch.Tensor:
    """``[groups + 1]`` int32 first chunk of each group of ``group`` segments (and the end), device ops only: the
    segments cover the used chunks in order, so a group's chunks run from its first segment's to the next's."""
    cum = torch.cat([seg.new_zeros(1), seg[:, 1].cumsum(0).to(torch.int32)])
    bounds = cum[::group] if seg.shape[0] % group == 0 else torch.cat([cum[::group], cum[-1:]])
    return bounds.contiguous()


def _split_launch(q, k, v, g, do, A_log, dt_bias, ws, checkpoints, ds, seg, every, grads, parts, scale, lower_bound,
                  scratch_mb):
    """B3a over (segment, value head), then B3b over (chunk, value head), through the fp32 scratch; by groups of
    segments whose scratch fits in ``scratch_mb`` MiB (at least one segment)."""
    dq, dk, dv, dg, dbeta = grads
    part_alog, part_dt = parts
    NT, HV, K = ws.layout.num_chunks, g.shape[2], g.shape[3]
    C = int(ws.inv.shape[-1])
    state_kernel, chunk_kernel, k1_launch = _split_kernels(_gluon_k1(g.device, C))
    NV = 1  # B3a holds the whole state (one block of K value columns beat two of K / 2 at K = 128)
    n_seg = seg.shape[0]
    per_seg = NV * every * HV * _scratch_floats(C, K) * 4
    group = max(1, min(n_seg, int(scratch_mb * 2**20) // per_seg))  # segments per launch pair
    NTS = group * every  # scratch chunk rows
    bounds = ws.layout.derived(("B3 group bounds", every, group), lambda: _group_bounds(seg, group))
    part_ck = torch.empty(NV, NTS, HV, 3, C, K, dtype=torch.float32, device=g.device)  # dkd, dqd, dkr
    part_cc = torch.empty(NV, NTS, HV, 2, C, C, dtype=torch.float32, device=g.device)  # dU W^T, do U^T
    part_k = torch.empty(NV, NTS, HV, K, dtype=torch.float32, device=g.device)  # dglast
    part_c = torch.empty(NV, NTS, HV, C, dtype=torch.float32, device=g.device)  # db
    dummy = ws.beta
    chunk_consts = dict(HQ=q.shape[2], HV=HV, NV=NV, HAS_ALOG=A_log is not None, HAS_DT=dt_bias is not None)
    chunk_launch = dict(k1_launch, K=K) if k1_launch else dict(C=C, K=K, num_warps=8)
    state_launch = dict(HV=HV, C=C, K=K, V=K, BV=K, num_warps=B3A_NUM_WARPS)
    for grp, s0 in enumerate(range(0, n_seg, group)):
        state_kernel[(min(group, n_seg - s0) * NV, HV)](
            v, do, ws.kd, ws.kr, ws.inv, ws.mqk, ws.glast, ws.beta, checkpoints, ds, ws.layout.chunk_index, seg,
            dv, part_ck, part_cc, part_k, part_c, bounds, grp, s0, NTS, **state_launch,
        )
        chunk_kernel[(min(group, n_seg - s0) * every, HV)](
            q, k, g, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
            ws.kd, ws.qd, ws.kr, ws.inv, ws.glast, ws.beta, ws.layout.chunk_index,
            part_ck, part_cc, part_k, part_c, dq, dk, dg, dbeta, part_alog, part_dt,
            bounds, grp, float(scale), float(lower_bound), NT, NTS, **chunk_consts, **chunk_launch,
        )


def local_grads_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float, lower_bound: float, do: torch.Tensor, ws: Workspace, checkpoints: torch.Tensor,
                    ds: torch.Tensor, every: int, A_log: torch.Tensor | None = None,
                    dt_bias: torch.Tensor | None = None, *, scratch_mb: float = 512.0) -> KDAGrads:
    """B3: the gradients of the raw inputs, walking each checkpoint segment's chunks from its checkpoint (B3a, the
    state part), then K1 backwards per chunk (B3b, chunk-parallel).

    Args:
        q, k: ``[B, T, Hq, K]``; v, g, do: ``[B, T, HV, K]`` (``HV`` a multiple of ``Hq``, ``K`` 64 or 128);
            beta: ``[B, T, HV]`` logits; all contiguous (the forward's inputs and the output gradient).
        scale, lower_bound, A_log (``[HV]`` or None), dt_bias (``[HV * K]`` or None): the forward's.
        ws: K1's `Workspace` of 16- or 32-token chunks for these inputs.
        checkpoints: ``[>= NCK, HV, K, K]`` (bf16 or fp32, K-first) the forward's state checkpoints, one every
            ``every`` chunks of each sequence (`checkpoints.checkpoint_offsets`).
        ds: ``[NT, HV, K, K]`` (bf16 or fp32, K-first) B2's gradient of the state leaving each chunk.
        every: chunks between checkpoints.
        scratch_mb: the scratch bound, MiB: B3a + B3b run over groups of checkpoint segments whose
            ``3 C K + 2 C^2 + K + C`` fp32 floats per chunk and value head fit (at least one segment per group).

    Returns:
        `emulate.KDAGrads` with ``dh0=None`` (B2's): ``dq, dk`` like ``q``; ``dv, dg, dbeta`` like ``v, g, beta``;
        ``dA_log`` ``[HV]`` and ``ddt_bias`` ``[HV * K]`` fp32, or None without ``A_log`` / ``dt_bias``.

    Raises:
        ValueError: a shape, dtype or layout does not fit, the workspace's chunks are not 16 or 32 tokens, or ``every``
            is not a positive int, or ``scratch_mb`` is not a positive number.
    """
    _check(q, k, v, g, beta, do, ws, checkpoints, ds, every)
    if not isinstance(scratch_mb, (int, float)) or isinstance(scratch_mb, bool) or not scratch_mb > 0:
        raise ValueError(f"scratch_mb must be a positive number, got {scratch_mb!r}")
    B, T, HV, K = g.shape
    Hq = q.shape[2]
    total = B * T
    dev = g.device
    seg = ws.layout.derived(("B3 segments", every), lambda: segment_table(ws.layout, every))
    n_seg = seg.shape[0]
    launched = n_seg > 0 and total > 0
    # the kernels write every token row inside a sequence; a varlen layout's rows past the last one are zeroed after
    alloc = _unfilled if launched else torch.zeros
    # GVA: fp32 per value head, summed over the value heads of a q/k head after; else straight in q's dtype
    acc_dtype = torch.float32 if Hq != HV else q.dtype
    dq = alloc((total, HV, K), dtype=acc_dtype, device=dev)
    dk = alloc((total, HV, K), dtype=acc_dtype, device=dev)
    dv = alloc(v.shape, dtype=v.dtype, device=dev)
    dg = alloc(g.shape, dtype=g.dtype, device=dev)
    dbeta = alloc(beta.shape, dtype=beta.dtype, device=dev)
    # the A_log / dt_bias partials per chunk; a varlen layout's unused chunk rows write none
    part_alloc = _unfilled if launched and ws.layout.dense else torch.zeros
    part_alog = part_alloc((ws.layout.num_chunks, HV, K), dtype=torch.float32, device=dev)
    part_dt = part_alloc((ws.layout.num_chunks, HV, K), dtype=torch.float32, device=dev)
    if launched:
        _split_launch(q, k, v, g, do, A_log, dt_bias, ws, checkpoints, ds, seg, every, (dq, dk, dv, dg, dbeta),
                      (part_alog, part_dt), scale, lower_bound, scratch_mb)
    if launched and not ws.layout.dense:
        zero_rows_past_end([x.view(total, -1) for x in (dq, dk, dv, dg, dbeta)], ws.layout.cu_seqlens)
    if Hq != HV:
        dq, dk = (x.reshape(total, Hq, HV // Hq, K).sum(2) for x in (dq, dk))
    dq, dk = (x.reshape(B, T, Hq, K).to(q.dtype) for x in (dq, dk))
    dA_log = part_alog.sum((0, 2)) if A_log is not None else None
    ddt_bias = part_dt.sum(0).reshape(HV * K) if dt_bias is not None else None
    return KDAGrads(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dA_log=dA_log, ddt_bias=ddt_bias, dh0=None)
