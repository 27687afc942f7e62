"""Muon's quintic Newton–Schulz with the two symmetric products computed once per pair of tiles.

One iteration over ``X`` (``[m, n]``, ``m ≤ n``) is ``A = X·Xᵀ``, ``B = b·A + c·A·A``, ``X ← a·X + B·X``. ``A`` is
symmetric, and so is ``A·A = A·Aᵀ``: of the ``2m²n + 2m³`` FLOPs of the first two products only the tiles on and
below the diagonal are needed. `symmetric_product` computes those tiles and writes each off-diagonal one twice
(itself and its transpose), so ``A`` and ``B`` cost ``T(T + 1)/2`` instead of ``T²`` tiles of ``T = ⌈m / BLOCK⌉``
(a third fewer FLOPs per iteration for a square-ish matrix). The third product is a plain batched GEMM.

`newton_schulz` runs the iterations with either these products or cuBLAS's (bf16 operands, fp32 accumulation,
bf16 results after each product both ways); the results differ only by the products' summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkda.rounding import INTERPRET, cast_for_store

__all__ = ["newton_schulz", "symmetric_product"]


@triton.jit
def _symmetric_product_kernel(x_ptr, add_ptr, out_ptr, M, K, sx_b, sx_m, sx_k, alpha, beta, HAS_ADD: tl.constexpr,
                              EVEN_K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    # program t owns the lower-triangle tile (i, j), j <= i, numbered t = i (i + 1) / 2 + j
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    i = ((tl.sqrt(8.0 * t.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where(i * (i + 1) // 2 > t, i - 1, i)
    i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)
    j = t - i * (i + 1) // 2
    rows = i * BLOCK + tl.arange(0, BLOCK)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    x = x_ptr + b * sx_b
    # rows past M read row M - 1 again (no mask in the loop); their results are never stored
    a_ptrs = x + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * sx_m + ks[None, :] * sx_k
    bt_ptrs = x + tl.minimum(cols, M - 1).to(tl.int64)[None, :] * sx_m + ks[:, None] * sx_k
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            bt = tl.load(bt_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(ks + k0 < K)[None, :], other=0.0)
            bt = tl.load(bt_ptrs, mask=(ks + k0 < K)[:, None], other=0.0)
        if INTERPRET:  # the interpreter multiplies bf16 operands wrongly; their fp32 values are exact
            a, bt = a.to(tl.float32), bt.to(tl.float32)
        acc = tl.dot(a, bt, acc)
        a_ptrs += BLOCK_K * sx_k
        bt_ptrs += BLOCK_K * sx_k
    acc = acc * alpha
    out = out_ptr + b * M * M
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < M)[None, :]
    if HAS_ADD:
        acc += beta * tl.load(add_ptr + b * M * M + rows64[:, None] * M + cols64[None, :], mask=mask,
                              other=0.0).to(tl.float32)
    val = cast_for_store(acc, out_ptr.dtype.element_ty)
    if i == j:  # the lower half mirrored: a diagonal tile's two halves may round their sums differently
        val = tl.where(rows[:, None] >= cols[None, :], val, tl.trans(val))
    tl.store(out + rows64[:, None] * M + cols64[None, :], val, mask=mask)
    if i != j:
        tl.store(out + cols64[:, None] * M + rows64[None, :], tl.trans(val), mask=tl.trans(mask))


_MAX_GRID_Y = 65535

#: Tile configurations the autotuner picks from per (m, k): (tile side, k step, warps, pipeline stages).
CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (128, 32, 8, 4), (64, 64, 4, 3)]
_symmetric_product_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK": block, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)
             for block, block_k, warps, stages in (CONFIGS[:1] if INTERPRET else CONFIGS)],
    key=["M", "K", "HAS_ADD"],
)(_symmetric_product_kernel)


def symmetric_product(x: torch.Tensor, alpha: float = 1.0, add: torch.Tensor | None = None,
                      beta: float = 0.0) -> torch.Tensor:
    """``alpha·x·xᵀ + beta·add`` per batch entry, computing only the tiles on and below the diagonal and
    mirroring them.

    Args:
        x: ``[B, m, k]``, any strides (contiguous is fastest: a transposed view makes every load strided), bf16
            (or fp16/fp32).
        alpha: factor of the product.
        add: ``[B, m, m]``, contiguous, symmetric (its tiles on and below the diagonal are read, the rest are
            taken to be their transposes), any float dtype; None for no addend.
        beta: factor of ``add``.

    Returns:
        ``[B, m, m]`` in ``x``'s dtype, contiguous, exactly symmetric; fp32 accumulation, one rounding.
    """
    if x.ndim != 3:
        raise ValueError(f"`x` must be a [B, m, k] tensor, got shape {tuple(x.shape)}")
    B, M, K = x.shape
    if add is not None and (add.shape != (B, M, M) or not add.is_contiguous() or add.device != x.device):
        raise ValueError(f"`add` must be a contiguous {(B, M, M)} tensor on {x.device}, got {tuple(add.shape)} "
                         f"(contiguous: {add.is_contiguous()}) on {add.device}")
    out = torch.empty(B, M, M, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.copy_(add * beta) if add is not None else out.zero_()
    for start in range(0, B, _MAX_GRID_Y):  # the batch is the grid's second dimension
        stop = min(B, start + _MAX_GRID_Y)

        def grid(meta, batch=stop - start):
            tiles = triton.cdiv(M, meta["BLOCK"])
            return tiles * (tiles + 1) // 2, batch

        part = out[start:stop]
        _symmetric_product_tuned[grid](x[start:stop], add[start:stop] if add is not None else part, part, M, K,
                                       *x.stride(), float(alpha), float(beta), HAS_ADD=add is not None,
                                       EVEN_K=K % 64 == 0)
    return out


def newton_schulz(g_BNM: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float, *,
                  symmetric: bool) -> torch.Tensor:
    """`torch.optim.Muon`'s quintic Newton–Schulz of every ``[N, M]`` slice of ``g_BNM`` at once, in bf16 like
    torch's. ``symmetric``: ``X·Xᵀ`` and ``b·A + c·A·A`` from `symmetric_product` (a tall slice is transposed
    into a contiguous copy first, since the kernel reads rows along k); else cuBLAS's batched products.
    ``[B, N, M]`` → ``[B, N, M]`` bf16."""
    a, b, c = ns_coefficients
    x = g_BNM.bfloat16()
    tall = x.shape[1] > x.shape[2]
    if tall:
        x = x.mT.contiguous() if symmetric else x.mT
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(ns_steps):
        if symmetric:
            gram = symmetric_product(x)
            poly = symmetric_product(gram, c, gram, b)
        else:
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x
