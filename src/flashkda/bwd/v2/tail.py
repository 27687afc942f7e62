"""Zero the token rows past the last sequence of a varlen batch, in several outputs, with one launch.

B3's kernels write every token row that lies in a sequence; rows from ``cu_seqlens[-1]`` on belong to no chunk, and
their gradients are zero. Filling the whole outputs with zeros first would write every byte of them; this kernel
writes only those rows, reading the end from the device (no host synchronisation).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["MAX_OUTPUTS", "zero_rows_past_end"]

#: Outputs one launch zeroes.
MAX_OUTPUTS = 5
_BLOCK_ROWS = 16
_BLOCK_ELEMS = 1024


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _zero_rows(x0, x1, x2, x3, x4, w0, w1, w2, w3, w4, cu_seqlens, N, ROWS, BLOCK_R: tl.constexpr,
                   BLOCK_E: tl.constexpr):
        """Program (row block, output k): zero rows ``>= cu_seqlens[N]`` of ``xk`` (an int16 view, ``wk``
        elements per row)."""
        i_r, i_x = tl.program_id(0), tl.program_id(1)
        end = tl.load(cu_seqlens + N).to(tl.int64)
        r0 = i_r.to(tl.int64) * BLOCK_R
        if r0 + BLOCK_R > end:
            if i_x == 0:
                base, width = x0, w0
            elif i_x == 1:
                base, width = x1, w1
            elif i_x == 2:
                base, width = x2, w2
            elif i_x == 3:
                base, width = x3, w3
            else:
                base, width = x4, w4
            rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
            live = (rows >= end) & (rows < ROWS)
            for e0 in range(0, width, BLOCK_E):
                cols = e0 + tl.arange(0, BLOCK_E)
                mask = live[:, None] & (cols < width)[None, :]
                tl.store(base + rows[:, None] * width + cols[None, :],
                         tl.zeros([BLOCK_R, BLOCK_E], dtype=tl.int16), mask=mask)

    return _zero_rows


def zero_rows_past_end(outputs: list[torch.Tensor], cu_seqlens: torch.Tensor) -> None:
    """Set rows ``cu_seqlens[-1]:`` of every tensor in ``outputs`` to zero, in place.

    Args:
        outputs: up to `MAX_OUTPUTS` contiguous tensors on one device with the same number of rows (dim 0, the
            token rows), any dtype of 2 or more bytes per element.
        cu_seqlens: ``[N + 1]`` int32/int64 token offsets on the same device; ``cu_seqlens[-1]`` is not read on the
            host.

    Raises:
        ValueError: no outputs or more than `MAX_OUTPUTS`, a tensor that is not contiguous, has 1-byte elements or
            another row count, or lives on another device.
    """
    if not 1 <= len(outputs) <= MAX_OUTPUTS:
        raise ValueError(f"outputs must hold 1 to {MAX_OUTPUTS} tensors, got {len(outputs)}")
    rows = outputs[0].shape[0]
    device = cu_seqlens.device
    for i, x in enumerate(outputs):
        if x.dim() < 1 or x.shape[0] != rows or not x.is_contiguous() or x.element_size() < 2:
            raise ValueError(f"outputs[{i}] must be contiguous with {rows} rows and elements of 2+ bytes, got "
                             f"{x.dtype} {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"outputs[{i}] is on {x.device}, cu_seqlens on {device}")
    if rows == 0:
        return
    views = [x.view(torch.int16) for x in outputs]
    widths = [v.numel() // rows for v in views]
    pad = MAX_OUTPUTS - len(views)
    grid = (-(-rows // _BLOCK_ROWS), len(views))
    _kernel()[grid](*views, *views[:1] * pad, *widths, *widths[:1] * pad, cu_seqlens, cu_seqlens.shape[0] - 1, rows,
                    BLOCK_R=_BLOCK_ROWS, BLOCK_E=_BLOCK_ELEMS)
