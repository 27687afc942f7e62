"""Fused Triton kernels for the KDA layer's short convolution: ``Swish(causal depthwise conv)``, forward and backward.

``y[t] = s · σ(s)`` with ``s[t] = Σ_j w[:, W−1−j] · u[t−j]`` over the taps ``j < W`` that stay inside ``t``'s sequence
(``j ≤ pos[t]``), the eager `kda.causal_depthwise_conv` followed by ``F.silu``. The forward reads ``u`` once and
writes ``y`` once, computing in fp32 (the eager chain rounds every tap's product to the activation dtype). The
backward is one kernel that walks along the tokens of a segment: it recomputes ``s`` from ``u`` (nothing but ``u`` is
saved) into the fp32 gradient ``ds`` at ``s``, keeps the last W − 1 rows of ``u`` and ``ds`` in registers, and emits
``du`` of a row once the ``ds`` of the W − 1 rows after it are known, with per-segment fp32 partial sums of ``dw``;
it reads ``u`` and ``dy`` once and writes ``du`` once, plus W − 1 rows of halo a segment.
Rows of ``u`` may be a column slice of a wider projection output; both kernels declare a row stride that is a
multiple of 8 elements when it is one, so that their loads of ``u`` are vectors. Both are operators
(``k3infra::fused_conv_silu`` and its backward), so compiled graphs call them too. `fused.MODE` decides where it runs
(`fused.use_fused`).

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
# the backward: SEG rows a program, walked ROWS at a time (their loads in flight together); BLOCK_D channels over
# WARPS warps (2 a thread: 64 registers at W = 4 for sm_90a); VEC: a row stride of 8·k elements declared as such
_BWD_SEG = 64
_BWD_ROWS = 4
_BWD_BLOCK_D = 128
_BWD_WARPS = 2
_BWD_VEC = True
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
def _load_row(u_ptr, dy_ptr, pos_ptr, t, o_d, m_d, N, D, SU):
    """Row ``t`` (may run past ``N``: zeros there): ``u`` and ``dy`` in their dtype (``[BD]``) and the int32 position
    in its sequence."""
    t = tl.cast(t, tl.int32)  # a Python int in the interpreter's loops
    # a select, not `m_d & (t < N)`: Triton's interpreter splats a scalar comparison as int32, not as a mask
    m = tl.where(t < N, m_d, False)
    b_u = tl.load(u_ptr + t.to(tl.int64) * SU + o_d, mask=m, other=0.0)
    b_dy = tl.load(dy_ptr + t.to(tl.int64) * D + o_d, mask=m, other=0.0)
    p = tl.load(pos_ptr + t, mask=t < N, other=0)
    return b_u, b_dy, p


@triton.jit
def _silu_grad(b_u, b_dy, p, b_uw, b_w, W: tl.constexpr, MASKED: tl.constexpr):
    """fp32 gradient at the pre-activation, ``dy · σ(s) · (1 + s(1 − σ(s)))``, of a row at position ``p`` with its
    ``u`` and the ``u`` of the W − 1 rows before it (``b_uw``, newest first); unless ``MASKED``, ``p ≥ W − 1``."""
    b_s = b_w[0] * b_u.to(tl.float32)
    for j in tl.static_range(1, W):
        b_uj = b_uw[j - 1].to(tl.float32)
        if MASKED:
            b_uj = tl.where(p >= j, b_uj, 0.0)  # u[t - j] is in an earlier sequence
        b_s += b_w[j] * b_uj
    b_sig = tl.sigmoid(b_s)
    return b_dy.to(tl.float32) * b_sig * (1.0 + b_s * (1.0 - b_sig))


@triton.jit
def _walk_row(b_u, b_dy, p, b_uw, b_dsw, p_w, b_dw, b_w, n, du_ptr, o_d, m_d, N, D, W: tl.constexpr,
              MASKED: tl.constexpr):
    """Row ``t = n + W − 1`` of the walk: its ``ds``, then ``du[n]`` (stored) and ``n``'s terms of ``dw``. Returns
    the window (``u``, ``ds``, pos of rows ``t, t − 1, ..`` now) and the ``dw`` sums moved on by the row; unless
    ``MASKED``, rows ``n + 1 .. t`` are all at least W − 1 tokens into their sequence."""
    n = tl.cast(n, tl.int32)  # a Python int in the interpreter's loops
    b_ds = _silu_grad(b_u, b_dy, p, b_uw, b_w, W, MASKED)
    b_ua = (b_u,) + b_uw  # rows t, t - 1, .., n: u of row n + j is b_ua[W - 1 - j]
    b_dsa = (b_ds,) + b_dsw
    p_a = (p,) + p_w
    b_un = b_ua[W - 1].to(tl.float32)  # zero past N: no dw from rows past the end
    b_du = tl.zeros_like(b_ds)
    b_dwn = ()
    for j in tl.static_range(W):
        b_g = b_dsa[W - 1 - j]
        if MASKED:
            b_g = tl.where(p_a[W - 1 - j] >= j, b_g, 0.0)  # row n + j is in a later sequence than n
        b_du += b_w[j] * b_g
        b_dwn += (b_dw[j] + b_un * b_g,)
    tl.store(du_ptr + n.to(tl.int64) * D + o_d, b_du.to(du_ptr.dtype.element_ty), mask=tl.where(n < N, m_d, False))
    return b_ua[:W - 1], b_dsa[:W - 1], p_a[:W - 1], b_dwn


@triton.jit
def _conv_silu_bwd_kernel(u_ptr, w_ptr, pos_ptr, dy_ptr, du_ptr, dw_part_ptr, N, D, SU_BY_VEC, W: tl.constexpr,
                          VEC: tl.constexpr, SEG: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """``du`` of the rows ``[t0, t0 + SEG)`` and their ``dw`` partial sums, channels ``[i_d · BLOCK_D, +BLOCK_D)``.

    Token ``n`` feeds tap ``j`` of token ``n + j``: ``du[n] = Σ_j w_j · ds[n + j]`` and ``dw_j += u[n] · ds[n + j]``
    (``w_j = w[:, W − 1 − j]``, the tap of the token ``j`` rows back) over ``j`` with ``pos[n + j] ≥ j``. The walk
    goes forward over rows ``t`` from ``t0`` to ``t0 + SEG + W − 2``, computing ``ds[t]`` from ``u[t − W + 1 .. t]``
    and ``dy[t]``; then row ``n = t − W + 1`` has every ``ds`` it needs. The window (``u``, ``ds`` and pos of the last
    W − 1 rows, newest first) stays in registers: each row of ``u`` and ``dy`` is read once, plus W − 1 rows of ``u``
    before the segment and W − 1 rows of both after it. Groups of ROWS rows away from sequence starts skip the masks.
    """
    tl.static_assert(SEG % ROWS == 0)
    SU = SU_BY_VEC * VEC
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    t0 = i_n * SEG
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_w = ()  # W x [BD] fp32: b_w[j] multiplies u[t - j]
    b_dw = ()  # W x [BD] fp32: the partial sums of dw_j
    for j in tl.static_range(W):
        b_w += (tl.load(w_ptr + o_d * W + (W - 1 - j), mask=m_d, other=0.0).to(tl.float32),)
        b_dw += (tl.zeros([BLOCK_D], dtype=tl.float32),)
    # -- the history: u of the W - 1 rows before t0 (zeros before row 0), the s of rows t0 .. t0 + W - 2 needs them
    b_uw = ()  # W - 1 x [BD], u's dtype: b_uw[k] = u[t - 1 - k]
    for k in tl.static_range(W - 1):
        t_h = t0 - 1 - k
        b_uw += (tl.load(u_ptr + t_h.to(tl.int64) * SU + o_d, mask=tl.where(t_h >= 0, m_d, False), other=0.0),)
    # -- the warm-up: ds of rows t0 .. t0 + W - 2, whose outputs n < t0 belong to the previous segment
    b_dsw = ()  # W - 1 x [BD] fp32: b_dsw[k] = ds[t - 1 - k]
    p_w = ()  # W - 1 int32: p_w[k] = pos[t - 1 - k]
    for k in tl.static_range(W - 1):
        b_u, b_dy, p = _load_row(u_ptr, dy_ptr, pos_ptr, t0 + k, o_d, m_d, N, D, SU)
        b_dsw = (_silu_grad(b_u, b_dy, p, b_uw, b_w, W, True),) + b_dsw
        p_w = (p,) + p_w
        b_uw = ((b_u,) + b_uw)[:W - 1]
    # -- the walk, ROWS rows a step: their loads first (in flight together), then row by row through the window
    for t_r in range(t0 + W - 1, t0 + W - 1 + SEG, ROWS):
        b_ur, b_dyr, p_r = (), (), ()
        p_min = tl.cast(W - 1, tl.int32)
        for r in tl.static_range(ROWS):
            b_u, b_dy, p = _load_row(u_ptr, dy_ptr, pos_ptr, t_r + r, o_d, m_d, N, D, SU)
            b_ur += (b_u,)
            b_dyr += (b_dy,)
            p_r += (p,)
            p_min = tl.minimum(p_min, p)
        for k in tl.static_range(W - 1):
            p_min = tl.minimum(p_min, p_w[k])
        if p_min >= W - 1:
            # every row here and in the window is W - 1 or more tokens into its sequence, so every tap is inside
            # it (all groups but those at a sequence start or past N): no masks, nor their registers
            for r in tl.static_range(ROWS):
                b_uw, b_dsw, p_w, b_dw = _walk_row(b_ur[r], b_dyr[r], p_r[r], b_uw, b_dsw, p_w, b_dw, b_w,
                                                   t_r + r - (W - 1), du_ptr, o_d, m_d, N, D, W, False)
        else:
            # a runtime loop, rows reloaded (cache hits): registers for one row at a time, not ROWS
            for i_r in range(ROWS):
                b_u, b_dy, p = _load_row(u_ptr, dy_ptr, pos_ptr, t_r + i_r, o_d, m_d, N, D, SU)
                b_uw, b_dsw, p_w, b_dw = _walk_row(b_u, b_dy, p, b_uw, b_dsw, p_w, b_dw, b_w, t_r + i_r - (W - 1),
                                                   du_ptr, o_d, m_d, N, D, W, True)
    for j in tl.static_range(W):
        tl.store(dw_part_ptr + (i_n * W + (W - 1 - j)) * D + o_d, b_dw[j], mask=m_d)


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


def _conv_silu_bwd(u_ND: torch.Tensor, weight_DW: torch.Tensor, pos_T: torch.Tensor, dy_ND: torch.Tensor, *,
                   seg: int, rows: int, block_d: int, warps: int, vec: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # moves 3 activation-dtype elements per (token, channel): u and dy in, du out (6 bytes in bf16, the HBM bound it
    # aims at), plus W − 1 halo rows of u and dy a segment and the [N / seg, W, D] fp32 dw partial sums (8 MB at
    # N = 32768, D = 1024, seg = 64, W = 4), written once and summed here
    N, D = u_ND.shape
    W, T = weight_DW.shape[1], pos_T.shape[0]
    du = torch.empty(N, D, dtype=u_ND.dtype, device=u_ND.device)
    segs = triton.cdiv(N, seg)
    dw_part = torch.empty(segs, W, D, dtype=torch.float32, device=u_ND.device)
    if N:
        su, v = _row_stride(u_ND) if vec else (u_ND.stride(0), 1)
        grid = (segs, triton.cdiv(D, block_d))
        # positions by row: no `row % T` per row in the kernel (B > 1 costs a copy of N ints here)
        pos_N = pos_T if T == N else pos_T.repeat(N // T)
        _conv_silu_bwd_kernel[grid](u_ND, weight_DW, pos_N, dy_ND.contiguous(), du, dw_part, N, D, su, W=W, VEC=v,
                                    SEG=seg, ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return du, dw_part.sum(0).t().contiguous().to(weight_DW.dtype)


@torch.library.custom_op("k3infra::fused_conv_silu_backward", mutates_args=())
def _conv_silu_bwd_op(u_ND: torch.Tensor, weight_DW: torch.Tensor, pos_T: torch.Tensor,
                      dy_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _conv_silu_bwd(_readable_rows(u_ND), weight_DW, pos_T, dy_ND, seg=_BWD_SEG, rows=_BWD_ROWS,
                          block_d=_BWD_BLOCK_D, warps=_BWD_WARPS, vec=_BWD_VEC)


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
