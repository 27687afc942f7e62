"""B3 of the v2 backward: the chunk-local gradients, from the checkpoints, B2's state gradients and the workspace.

One Triton kernel, one program per (checkpoint segment, value head), in two layouts until their device A/B decides
(`flashkda.bwd.v2.local_grad_kernel`, tiles ``[C, 128]``; `local_grad_fm_kernel`, tiles ``[128, C]``), imported
on the first launch only; on a machine without a GPU it runs under ``TRITON_INTERPRET=1`` on CPU tensors. Its torch
twin is the ``B1`` + ``B3`` stages of ``emulate.emulate_backward`` (``_states`` and ``_local_grads``) plus the
reductions after them.
"""

from __future__ import annotations

import functools

import torch

from flashkda.bwd.v2.checkpoints import checkpoint_bound, checkpoint_offsets
from flashkda.bwd.v2.emulate import KDAGrads
from flashkda.fwd.v2.workspace import HEAD_DIM, ChunkLayout, Workspace

__all__ = ["CHUNKS", "local_grads_bwd", "segment_table"]

#: The chunk sizes B3 serves (K1's workspaces of `workspace` and `workspace32`).
CHUNKS = (16, 32)


@functools.cache
def _kernel(feature_major: bool):
    if feature_major:
        from flashkda.bwd.v2 import local_grad_fm_kernel

        return local_grad_fm_kernel.kda_bwd_v2_local_fm_kernel
    from flashkda.bwd.v2 import local_grad_kernel

    return local_grad_kernel.kda_bwd_v2_local_kernel


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
    B, T, HV, K = g.shape
    for name, x, heads in (("q", q, q.shape[2]), ("k", k, q.shape[2]), ("v", v, HV), ("g", g, HV), ("do", do, HV)):
        if x.dim() != 4 or tuple(x.shape) != (B, T, heads, HEAD_DIM) or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{B}, {T}, {heads}, {HEAD_DIM}], got {tuple(x.shape)}")
        if x.device != g.device:
            raise ValueError(f"{name} is on {x.device}, g on {g.device}")
    if HV % q.shape[2] != 0:
        raise ValueError(f"g has {HV} value heads, not a multiple of q's {q.shape[2]} heads")
    if tuple(beta.shape) != (B, T, HV) or not beta.is_contiguous():
        raise ValueError(f"beta must be contiguous [{B}, {T}, {HV}], got {tuple(beta.shape)}")
    if ws.kd.shape[:2] != (B * T, HV) or ws.layout.total_tokens != B * T:
        raise ValueError(f"ws has kd {tuple(ws.kd.shape)}, expected [{B * T}, {HV}, {HEAD_DIM}]")
    n_ck = checkpoint_bound(ws.layout, every)
    if checkpoints.dim() != 4 or tuple(checkpoints.shape[1:]) != (HV, HEAD_DIM, HEAD_DIM) \
            or checkpoints.shape[0] < n_ck or not checkpoints.is_contiguous():
        raise ValueError(f"checkpoints must be contiguous [>= {n_ck}, {HV}, {HEAD_DIM}, {HEAD_DIM}] for every={every}, "
                         f"got {tuple(checkpoints.shape)}")
    if tuple(ds.shape) != (ws.layout.num_chunks, HV, HEAD_DIM, HEAD_DIM) or not ds.is_contiguous():
        raise ValueError(f"ds must be contiguous [{ws.layout.num_chunks}, {HV}, {HEAD_DIM}, {HEAD_DIM}], "
                         f"got {tuple(ds.shape)}")


def local_grads_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float, lower_bound: float, do: torch.Tensor, ws: Workspace, checkpoints: torch.Tensor,
                    ds: torch.Tensor, every: int, A_log: torch.Tensor | None = None,
                    dt_bias: torch.Tensor | None = None, *, num_warps: int = 8,
                    num_stages: int | None = None, feature_major: bool = False) -> KDAGrads:
    """B3: the gradients of the raw inputs, one program per (checkpoint segment, value head), walking the segment's
    chunks from its checkpoint (the state part, then K1 backwards per chunk).

    Args:
        q, k: ``[B, T, Hq, 128]``; v, g, do: ``[B, T, HV, 128]`` (``HV`` a multiple of ``Hq``); beta:
            ``[B, T, HV]`` logits; all contiguous (the forward's inputs and the output gradient).
        scale, lower_bound, A_log (``[HV]`` or None), dt_bias (``[HV * 128]`` or None): the forward's.
        ws: K1's `Workspace` of 16- or 32-token chunks for these inputs.
        checkpoints: ``[>= NCK, HV, 128, 128]`` (bf16 or fp32, K-first) the forward's state checkpoints, one every
            ``every`` chunks of each sequence (`checkpoints.checkpoint_offsets`).
        ds: ``[NT, HV, 128, 128]`` (bf16 or fp32, K-first) B2's gradient of the state leaving each chunk.
        every: chunks between checkpoints.
        num_warps: warps per program (4, 8 or 16).
        num_stages: Triton's software pipelining depth of the chunk loop's loads (None: Triton's default).
        feature_major: run `local_grad_fm_kernel` (the per-chunk tiles ``[128, C]``, the state products with
            M = 128) instead of `local_grad_kernel` (``[C, 128]``); same results up to fp32 summation order.

    Returns:
        `emulate.KDAGrads` with ``dh0=None`` (B2's): ``dq, dk`` like ``q``; ``dv, dg, dbeta`` like ``v, g, beta``;
        ``dA_log`` ``[HV]`` and ``ddt_bias`` ``[HV * 128]`` fp32, or None without ``A_log`` / ``dt_bias``.

    Raises:
        ValueError: a shape, dtype or layout does not fit, the workspace's chunks are not 16 or 32 tokens, or ``every``
            is not a positive int, or a launch option is out of range.
    """
    _check(q, k, v, g, beta, do, ws, checkpoints, ds, every)
    if num_warps not in (4, 8, 16):
        raise ValueError(f"num_warps must be 4, 8 or 16, got {num_warps!r}")
    if num_stages is not None and num_stages not in (1, 2, 3, 4):
        raise ValueError(f"num_stages must be 1 to 4 or None, got {num_stages!r}")
    B, T, HV, K = g.shape
    Hq = q.shape[2]
    total = B * T
    dev = g.device
    # GVA: fp32 per value head, summed over the value heads of a q/k head after; else straight in q's dtype
    acc_dtype = torch.float32 if Hq != HV else q.dtype
    dq = torch.zeros(total, HV, K, dtype=acc_dtype, device=dev)
    dk = torch.zeros(total, HV, K, dtype=acc_dtype, device=dev)
    dv = torch.zeros_like(v)
    dg = torch.zeros_like(g)
    dbeta = torch.zeros_like(beta)
    seg = segment_table(ws.layout, every)
    n_seg = seg.shape[0]
    C = int(ws.inv.shape[-1])
    part_alog = torch.zeros(n_seg, HV, K, dtype=torch.float32, device=dev)  # the A_log / dt_bias partials
    part_dt = torch.zeros(n_seg, HV, K, dtype=torch.float32, device=dev)
    pipelining = {} if num_stages is None else {"num_stages": num_stages}
    if n_seg and total:
        dummy = ws.beta
        _kernel(bool(feature_major))[(n_seg, HV)](
            q, k, v, g, do, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
            ws.kd, ws.qd, ws.kr, ws.inv, ws.mqk, ws.glast, ws.beta,
            checkpoints, ds, ws.layout.chunk_index, seg,
            dq, dk, dv, dg, dbeta, part_alog, part_dt,
            float(scale), float(lower_bound),
            HQ=Hq, HV=HV, C=C, K=K, V=K, HAS_ALOG=A_log is not None, HAS_DT=dt_bias is not None,
            num_warps=num_warps, **pipelining,
        )
    if Hq != HV:
        dq, dk = (x.reshape(total, Hq, HV // Hq, K).sum(2) for x in (dq, dk))
    dq, dk = (x.reshape(B, T, Hq, K).to(q.dtype) for x in (dq, dk))
    dA_log = part_alog.sum((0, 2)) if A_log is not None else None
    ddt_bias = part_dt.sum(0).reshape(HV * K) if dt_bias is not None else None
    return KDAGrads(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dA_log=dA_log, ddt_bias=ddt_bias, dh0=None)
