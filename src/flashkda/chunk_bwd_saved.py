"""The forward's saved per-chunk states made into the training backward's operands (fp32, one head slice).

The split state path of the forward stores ``h`` (the state at every chunk start, ``[NC, HV, K, V]``, bf16 for bf16
input) for its output kernel; the training backward can take it instead of recomputing it
(``FLASHKDA_BWD_SAVE_STATES=1``). A head slice of it is a strided view; `widen_head_slice` copies it into a
contiguous fp32 ``[NC, HS, K, V]`` in one pass (torch's generic strided copy ran at ~1.2 TB/s for such views).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["widen_head_slice"]


@triton.jit
def widen_head_slice_kernel(x, out, hv0, HV, HS, BLOCK: tl.constexpr, E: tl.constexpr):
    # program (chunk c, head j of the slice, block b): E = elements per (chunk, head) matrix
    i_ch, i_b = tl.program_id(0), tl.program_id(1)
    i_c, i_j = i_ch // HS, i_ch % HS
    o = i_b * BLOCK + tl.arange(0, BLOCK)
    m = o < E
    b_x = tl.load(x + (i_c.to(tl.int64) * HV + hv0 + i_j) * E + o, mask=m).to(tl.float32)
    tl.store(out + i_ch.to(tl.int64) * E + o, b_x, mask=m)


def widen_head_slice(x: torch.Tensor, hv0: int, hv1: int, num_chunks: int) -> torch.Tensor:
    """``x[:num_chunks, hv0:hv1]`` as a contiguous fp32 tensor.

    Args:
        x: ``[NC', HV, ...]`` contiguous (``NC' >= num_chunks``; varlen forwards allocate an upper bound), any float
            dtype.
        hv0, hv1: the head slice, ``0 <= hv0 < hv1 <= HV``.
        num_chunks: chunks to keep.

    Returns:
        ``[num_chunks, hv1 - hv0, ...]`` fp32.
    """
    assert x.is_contiguous() and 0 <= hv0 < hv1 <= x.shape[1] and num_chunks <= x.shape[0], "bad head slice"
    HV, HS = x.shape[1], hv1 - hv0
    E = x[0, 0].numel()
    out = torch.empty((num_chunks, HS, *x.shape[2:]), dtype=torch.float32, device=x.device)
    if num_chunks and E:
        BLOCK = min(4096, triton.next_power_of_2(E))
        widen_head_slice_kernel[(num_chunks * HS, triton.cdiv(E, BLOCK))](x, out, hv0, HV, HS, BLOCK=BLOCK, E=E,
                                                                          num_warps=4)
    return out
