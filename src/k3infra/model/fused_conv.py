"""Fused Triton kernels for the KDA layer's short convolution: ``Swish(causal depthwise conv)``, forward and backward.

``y[t] = s · σ(s)`` with ``s[t] = Σ_j w[:, W−1−j] · u[t−j]`` over the taps ``j < W`` that stay inside ``t``'s sequence
(``j ≤ pos[t]``), the eager `kda.causal_depthwise_conv` followed by ``F.silu``. The forward reads ``u`` once and
writes ``y`` once, computing in fp32 (the eager chain rounds every tap's product to the activation dtype). The
backward recomputes ``s`` from ``u`` (nothing but ``u`` is saved) into the fp32 gradient ``ds`` at ``s``, then
gathers ``du`` and per-block fp32 partial sums of ``dw`` from the taps' ``ds``.
Rows of ``u`` may be a column slice of a wider projection output; the forward declares a row stride that is a
multiple of 8 elements so, so its loads are 16-byte vectors. Both are operators (``k3infra::fused_conv_silu`` and its
backward), so compiled graphs call them too. `fused.MODE` decides where it runs (`fused.use_fused`).

Shape suffixes: N tokens (``B·T`` rows), D channels, W taps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv_silu"]

_BLOCK_N = 32
_BLOCK_D = 128
_WARPS = 4
_BWD_BLOCK_N = 64
_BWD_BLOCK_D = 128
_BWD_WARPS = 4
_MAX_TAPS = 8


@triton.jit
def _pre_activation(u_ptr, w_ptr, pos_ptr, rows, cols, N, D, SU, T, W: tl.constexpr):
    """fp32 ``s`` at ``rows`` (``[BN]``, may run past ``N``) and ``cols`` (``[BD]``); ``u``'s rows ``SU`` apart."""
    col_ok = cols < D
    pos = tl.load(pos_ptr + rows % T, mask=rows < N, other=0)
    s = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for j in tl.static_range(W):
        w = tl.load(w_ptr + cols * W + (W - 1 - j), mask=col_ok, other=0.0).to(tl.float32)
        src = rows - j
        ok = (rows < N) & (pos >= j) & (src >= 0)
        u = tl.load(u_ptr + src.to(tl.int64)[:, None] * SU + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        s += u * w[None, :]
    return s


@triton.jit
def _conv_silu_fwd_kernel(u_ptr, w_ptr, pos_ptr, y_ptr, N, D, SU_BY_VEC, T, W: tl.constexpr, VEC: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    SU = SU_BY_VEC * VEC
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = _pre_activation(u_ptr, w_ptr, pos_ptr, rows, cols, N, D, SU, T, W)
    y = s * tl.sigmoid(s)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_silu_bwd_pre_kernel(u_ptr, w_ptr, pos_ptr, dy_ptr, ds_ptr, N, D, SU, T, W: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = _pre_activation(u_ptr, w_ptr, pos_ptr, rows, cols, N, D, SU, T, W)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(s)
    tl.store(ds_ptr + offs, dy * sig * (1.0 + s * (1.0 - sig)), mask=mask)


@triton.jit
def _conv_silu_bwd_taps_kernel(u_ptr, w_ptr, pos_ptr, ds_ptr, du_ptr, dw_part_ptr, N, D, SU, T, W: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = (rows < N)[:, None] & col_ok[None, :]
    u_here = tl.load(u_ptr + rows.to(tl.int64)[:, None] * SU + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    du = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # token n feeds tap j of token n + j: du[n] = Σ_j w[W−1−j] · ds[n + j] (when n + j is still in n's sequence),
    # dw[W−1−j] = Σ_n u[n] · ds[n + j] over the same pairs
    for j in tl.static_range(W):
        out = rows + j
        pos = tl.load(pos_ptr + out % T, mask=out < N, other=0)
        ok = (out < N) & (pos >= j)
        ds = tl.load(ds_ptr + out.to(tl.int64)[:, None] * D + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                     other=0.0)
        w = tl.load(w_ptr + cols * W + (W - 1 - j), mask=col_ok, other=0.0).to(tl.float32)
        du += ds * w[None, :]
        tl.store(dw_part_ptr + (pid_n * W + (W - 1 - j)) * D + cols, tl.sum(ds * u_here, axis=0), mask=col_ok)
    tl.store(du_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)


def _readable_rows(u_ND: torch.Tensor) -> torch.Tensor:
    """``u_ND`` itself when its channels are contiguous and its rows do not overlap (a column slice of a wider
    projection output), else a contiguous copy; the operators check it, since a compiled graph may hand over
    another layout than eager's."""
    return u_ND if u_ND.stride(1) == 1 and u_ND.stride(0) >= u_ND.shape[1] else u_ND.contiguous()


def _row_stride(u_ND: torch.Tensor) -> tuple[int, int]:
    """``(stride // vec, vec)``: 8 when the row stride is a multiple of 8 elements (16-byte rows in bf16)."""
    stride = u_ND.stride(0)
    vec = 8 if stride % 8 == 0 else 1
    return stride // vec, vec


@torch.library.custom_op("k3infra::fused_conv_silu", mutates_args=())
def _conv_silu_op(u_ND: torch.Tensor, weight_DW: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    N, D = u_ND.shape
    W, T = weight_DW.shape[1], pos_T.shape[0]
    u_ND = _readable_rows(u_ND)
    y = torch.empty(N, D, dtype=u_ND.dtype, device=u_ND.device)
    if N:
        su, vec = _row_stride(u_ND)
        grid = (triton.cdiv(N, _BLOCK_N), triton.cdiv(D, _BLOCK_D))
        _conv_silu_fwd_kernel[grid](u_ND, weight_DW, pos_T, y, N, D, su, T, W=W, VEC=vec, BLOCK_N=_BLOCK_N,
                                    BLOCK_D=_BLOCK_D, num_warps=_WARPS)
    return y


@_conv_silu_op.register_fake
def _(u_ND, weight_DW, pos_T):
    return u_ND.new_empty(u_ND.shape)


@torch.library.custom_op("k3infra::fused_conv_silu_backward", mutates_args=())
def _conv_silu_bwd_op(u_ND: torch.Tensor, weight_DW: torch.Tensor, pos_T: torch.Tensor,
                      dy_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, D = u_ND.shape
    W, T = weight_DW.shape[1], pos_T.shape[0]
    u_ND = _readable_rows(u_ND)
    du = torch.empty(N, D, dtype=u_ND.dtype, device=u_ND.device)
    ds = torch.empty(N, D, dtype=torch.float32, device=u_ND.device)
    blocks = triton.cdiv(N, _BWD_BLOCK_N)
    dw_part = torch.empty(blocks, W, D, dtype=torch.float32, device=u_ND.device)
    if N:
        grid = (blocks, triton.cdiv(D, _BWD_BLOCK_D))
        # the row stride as is: declaring 16-byte rows made both kernels slower (more registers) in the A/B
        meta = dict(W=W, BLOCK_N=_BWD_BLOCK_N, BLOCK_D=_BWD_BLOCK_D, num_warps=_BWD_WARPS)
        _conv_silu_bwd_pre_kernel[grid](u_ND, weight_DW, pos_T, dy_ND.contiguous(), ds, N, D, u_ND.stride(0), T,
                                        **meta)
        _conv_silu_bwd_taps_kernel[grid](u_ND, weight_DW, pos_T, ds, du, dw_part, N, D, u_ND.stride(0), T, **meta)
    return du, dw_part.sum(0).t().contiguous().to(weight_DW.dtype)


@_conv_silu_bwd_op.register_fake
def _(u_ND, weight_DW, pos_T, dy_ND):
    return u_ND.new_empty(u_ND.shape), weight_DW.new_empty(weight_DW.shape)


def _conv_silu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_silu_backward(ctx, dy):
    u_ND, weight_DW, pos_T = ctx.saved_tensors
    du, dw = _conv_silu_bwd_op(u_ND, weight_DW, pos_T, dy)
    return du, dw, None


_conv_silu_op.register_autograd(_conv_silu_backward, setup_context=_conv_silu_setup)


def conv_silu(u_BTD: torch.Tensor, weight_DW: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    """Fused ``F.silu(causal_depthwise_conv(u, weight, None, pos))`` (no decode state); the operator
    ``k3infra::fused_conv_silu`` (and its backward), so compiled graphs call these kernels as well.

    Args:
        u_BTD: ``[B, T, D]`` fp32/bf16/fp16 inputs: read in place when its channels are contiguous and its tokens
            evenly spaced (a column slice of a wider projection output), else copied contiguous first.
        weight_DW: ``[D, W]`` depthwise taps (the last column multiplies the current token), ``W <= 8``, any float
            dtype (computed in fp32; its gradient comes back in its dtype).
        pos_T: ``[T]`` int position of each token in its sequence (``B == 1`` packed), or ``arange(T)``.

    Returns:
        ``[B, T, D]`` in ``u``'s dtype.
    """
    B, T, D = u_BTD.shape
    if weight_DW.dim() != 2 or weight_DW.shape[0] != D or not 1 <= weight_DW.shape[1] <= _MAX_TAPS:
        raise ValueError(f"conv_silu: weight must be [{D}, W] with 1 <= W <= {_MAX_TAPS}, got "
                         f"{tuple(weight_DW.shape)}")
    if pos_T.shape != (T,):
        raise ValueError(f"conv_silu: pos_T must be [{T}], got {tuple(pos_T.shape)}")
    # made readable before the operator too, so that the tensor saved for backward is the readable one
    u_ND = _readable_rows(u_BTD.reshape(B * T, D))
    y = _conv_silu_op(u_ND, weight_DW.contiguous(), pos_T.to(torch.int32).contiguous())
    return y.view(B, T, D)
