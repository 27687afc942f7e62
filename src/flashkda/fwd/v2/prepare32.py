"""K1 of the chunk-32 v2 forward: L2 norm, bounded gate, beta sigmoid and the 32x32 chunk matrices, written to the
chunk-32 workspace (`workspace32`).

Two Gluon kernels, the same workspace: ``"wide"`` (`flashkda.fwd.v2.prepare32_kernel`, the default: global loads
into registers, 8 warps, 3 CTAs per SM) and ``"tma"`` (`flashkda.fwd.v2.prepare32_tma_kernel`: TMA copies into
shared memory behind an mbarrier, 4 warps, 7 CTAs per SM; Hopper only). Each is imported on its first launch only,
so ``import flashkda`` works with any Triton (or none) and on machines without a GPU.
"""

from __future__ import annotations

import functools
import math

import torch

from flashkda.fwd.v2.prepare import _check
from flashkda.fwd.v2.workspace import ChunkLayout, Workspace, allocate_workspace
from flashkda.fwd.v2.workspace32 import CHUNK32

__all__ = ["KERNELS32", "prepare32_fwd"]

#: The K1 c32 kernels `prepare32_fwd` can launch.
KERNELS32 = ("wide", "tma")
#: ``[tokens, channels]`` of the TMA kernel's copies (`prepare32_tma_kernel`): q, k by the chunk, the gate by the
#: half chunk (its halves go to separate tiles), half a head each
_TMA_BOX = (32, 64)
_TMA_GATE_BOX = (16, 64)


@functools.cache
def _kernel_module(kernel: str = "wide"):
    if kernel == "tma":
        from flashkda.fwd.v2 import prepare32_tma_kernel

        return prepare32_tma_kernel
    from flashkda.fwd.v2 import prepare32_kernel

    return prepare32_kernel


@functools.cache
def _tma_layout(box: tuple[int, int]):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(box), gl.bfloat16)


def _tma_descriptor(x: torch.Tensor, name: str, box: tuple[int, int] = _TMA_BOX):
    """A TMA descriptor over the ``[B, T, heads, 128]`` bf16 tensor ``x`` seen as ``[B * T, heads * 128]``, with
    ``box`` boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if x.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address for the TMA prepare kernel, got "
                         f"{x.data_ptr()} (pass a fresh contiguous tensor)")
    rows, cols = x.shape[0] * x.shape[1], x.shape[2] * x.shape[3]
    return TensorDescriptor(x, [rows, cols], [cols, 1], list(box), _tma_layout(box))


def prepare32_fwd(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                  layout: ChunkLayout, lower_bound: float, A_log: torch.Tensor | None = None,
                  dt_bias: torch.Tensor | None = None, ws: Workspace | None = None, *, kernel: str = "wide",
                  ) -> Workspace:
    """Run the chunk-32 K1 (same contract as ``emulate32.emulate_prepare32``).

    Args:
        q, k: ``[B, T, H, 128]`` bf16, contiguous, on a GPU (sm_80 or newer: mma.sync).
        g: ``[B, T, HV, 128]`` raw gate, ``HV`` a multiple of ``H`` (GVA); beta: ``[B, T, HV]`` logits.
        scale: query scale.
        layout: from ``workspace32.build_chunk_layout32(B, T, cu_seqlens, device)``.
        lower_bound: the bounded gate's floor, in ``[-5, 0)``.
        A_log: ``[HV]`` or None; dt_bias: ``[HV * 128]`` or None.
        ws: a chunk-32 workspace to fill (``allocate_workspace`` for the same layout and HV), or None.
        kernel: ``"wide"`` (``kda_fwd_v2_prepare32_wide_kernel``, sm_80 or newer) or ``"tma"``
            (``kda_fwd_v2_prepare32_tma_kernel``, sm_90: TMA and wgmma; a bf16 gate comes by TMA, another dtype by
            plain loads). Both write the same workspace.

    Returns:
        The chunk-32 `Workspace` with ``HV`` heads; every element the chunk-32 K2 reads is written.

    Raises:
        ValueError: on inputs the kernels do not take, an unknown ``kernel``, or (``"tma"``) q, k or a bf16 g not
            16-byte aligned.
    """
    if kernel not in KERNELS32:
        raise ValueError(f"kernel must be one of {KERNELS32}, got {kernel!r}")
    _check(q, k, g, beta, layout)
    if layout.chunk != CHUNK32:
        raise ValueError(f"layout must be a 32-token chunk layout (build_chunk_layout32), got {layout.chunk}-token "
                         "chunks")
    H = g.shape[2]
    if ws is None:
        ws = allocate_workspace(layout, H, q.device)
    if layout.num_chunks == 0 or H == 0:
        return ws
    dummy = ws.glast
    mod = _kernel_module(kernel)
    gate = (A_log.contiguous() if A_log is not None else dummy, dt_bias.contiguous() if dt_bias is not None else dummy)
    args = (layout.chunk_index, ws.kd, ws.qd, ws.kr, ws.inv, ws.mqk, ws.glast, ws.beta,
            float(scale), float(lower_bound) / math.log(2.0), layout.num_chunks, H)
    flags = dict(GROUP=H // q.shape[2], HAS_A_LOG=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
                 num_warps=int(mod.NUM_WARPS), maxnreg=int(mod.MAX_REGISTERS))
    grid = (layout.num_chunks * H,)
    if kernel == "wide":
        mod.kda_fwd_v2_prepare32_wide_kernel[grid](q, k, g, beta, *gate, *args, **flags)
        return ws
    g_tma = g.dtype == torch.bfloat16
    q_desc, k_desc = _tma_descriptor(q, "q"), _tma_descriptor(k, "k")
    # without a bf16 gate, a placeholder descriptor of the gate's type that the kernel never reads
    g_desc = _tma_descriptor(g if g_tma else k, "g", _TMA_GATE_BOX)
    mod.kda_fwd_v2_prepare32_tma_kernel[grid](q_desc, k_desc, g_desc, g, beta, *gate, *args, G_TMA=g_tma, **flags)
    return ws
