"""Fused Triton kernels for the element-wise half of a Muon step (`optim.ShardedMuon`).

Around its Newton–Schulz GEMMs a Muon step is memory-bound: per fp32 weight, torch's ops read and write the
momentum, form the Nesterov update in fp32, cast it to bf16, decay the weight and subtract the scaled
orthogonalised update, one pass each. Two kernels do the same math in two passes:

- `momentum_update`: ``buf ← lerp(buf, grad, 1 − μ)`` and the bf16 update ``lerp(grad, buf, μ)`` (Nesterov) or
  ``buf``, reading ``grad`` and ``buf`` once (14 bytes per fp32 weight instead of 30);
- `decay_and_subtract`: ``param ← param·(1 − lr·wd) − scale·ortho`` from the bf16 orthogonalised update (10 bytes
  instead of 18).

They run where `k3infra.model.fused.use_fused` says the element-wise kernels run (CUDA tensors; CPU tensors under
Triton's interpreter with ``fused.MODE = "on"``), on plain tensors: a sharded parameter passes its local shard.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkda.rounding import cast_for_store

__all__ = ["decay_and_subtract", "momentum_update"]

_BLOCK = 2048
_TILE_N, _TILE_M = 32, 128


@triton.jit
def _lerp(start, end, weight):
    # torch.lerp's two forms: exact at both ends of the weight's range
    return tl.where(weight < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


@triton.jit
def _momentum_kernel(grad_ptr, buf_ptr, out_ptr, numel, momentum, NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(buf_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = _lerp(b, g, 1.0 - momentum)
    tl.store(buf_ptr + offs, b.to(buf_ptr.dtype.element_ty), mask=mask)
    if NESTEROV:
        update = _lerp(g, b, momentum)
    else:
        update = b
    tl.store(out_ptr + offs, cast_for_store(update, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decay_subtract_kernel(param_ptr, ortho_ptr, N, M, sp_b, sp_n, sp_m, so_b, so_n, so_m, decay, scale,
                           BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # 2-D tiles with both operands' strides: a tall matrix's orthogonalised update arrives transposed
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = (pid // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (pid % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < N)[:, None] & (cols < M)[None, :]
    p_offs = b * sp_b + rows.to(tl.int64)[:, None] * sp_n + cols[None, :] * sp_m
    o_offs = b * so_b + rows.to(tl.int64)[:, None] * so_n + cols[None, :] * so_m
    p = tl.load(param_ptr + p_offs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(ortho_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(param_ptr + p_offs, (p * decay - scale * o).to(param_ptr.dtype.element_ty), mask=mask)


def _check_flat(name: str, x: torch.Tensor, like: torch.Tensor) -> None:
    if x.shape != like.shape or not x.is_contiguous() or x.device != like.device:
        raise ValueError(f"`{name}` must be a contiguous {tuple(like.shape)} tensor on {like.device}, got "
                         f"{tuple(x.shape)} (contiguous: {x.is_contiguous()}) on {x.device}")


def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """One Muon momentum step in place of ``buf.lerp_(grad, 1 - momentum)`` followed by
    ``grad.lerp(buf, momentum)`` (``nesterov``) or ``buf``, cast to bf16.

    Args:
        grad: the gradient, any shape, contiguous, fp32 (or bf16/fp16).
        buf: the momentum buffer, same shape and device, contiguous; updated in place.
        momentum: μ in ``[0, 1)``.
        nesterov: return the Nesterov update instead of the momentum.
        out: where to write the update (same shape, contiguous, any float dtype); a new bf16 tensor if None.

    Returns:
        ``out``: the update, in ``out``'s dtype (bf16 by default: Newton–Schulz reads bf16).
    """
    _check_flat("buf", buf, grad)
    if out is None:
        out = torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device)
    _check_flat("out", out, grad)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"`momentum` must be in [0, 1), got {momentum}")
    numel = grad.numel()
    if numel:
        _momentum_kernel[(triton.cdiv(numel, _BLOCK),)](grad, buf, out, numel, float(momentum), NESTEROV=nesterov,
                                                        BLOCK=_BLOCK)
    return out


def decay_and_subtract(param: torch.Tensor, ortho: torch.Tensor, decay: float, scale: float) -> None:
    """``param ← param·decay − scale·ortho`` in place (decoupled weight decay ``decay = 1 − lr·wd``, then Muon's
    scaled step), in one pass.

    Args:
        param: ``[n, m]`` or ``[B, n, m]``, any strides (a view of a weight: a head block, an expert slice), fp32
            (or bf16/fp16); updated in place.
        ortho: the orthogonalised update, same shape, any strides (Newton–Schulz returns a tall matrix's update
            transposed), bf16 (or any float dtype).
        decay: the factor the weight is multiplied by first.
        scale: the factor of ``ortho`` subtracted after.
    """
    if param.shape != ortho.shape or param.ndim not in (2, 3) or param.device != ortho.device:
        raise ValueError(f"`param` and `ortho` must be [n, m] or [B, n, m] tensors of one shape on one device, got "
                         f"{tuple(param.shape)} on {param.device} and {tuple(ortho.shape)} on {ortho.device}")
    p3, o3 = (param[None], ortho[None]) if param.ndim == 2 else (param, ortho)
    B, N, M = p3.shape
    if p3.numel():
        grid = (triton.cdiv(N, _TILE_N) * triton.cdiv(M, _TILE_M), B)
        _decay_subtract_kernel[grid](p3, o3, N, M, *p3.stride(), *o3.stride(), float(decay), float(scale),
                                     BLOCK_N=_TILE_N, BLOCK_M=_TILE_M, num_warps=8)
