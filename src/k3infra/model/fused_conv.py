"""Fused Triton kernels for the KDA layer's short convolution: ``Swish(causal depthwise conv)``, forward and backward.

``y[t] = s · σ(s)`` with ``s[t] = Σ_j w[:, W−1−j] · u[t−j]`` over the taps ``j < W`` that stay inside ``t``'s sequence
(``j ≤ pos[t]``), the eager `kda.causal_depthwise_conv` followed by ``F.silu``. Both kernels walk along the tokens
of a segment with the last rows in registers. The forward reads ``u`` once (plus W − 1 rows of halo a segment) and
writes ``y`` once, computing in fp32 (the eager chain rounds every tap's product to the activation dtype). The
backward recomputes ``s`` from ``u`` (nothing but ``u`` is saved) into the fp32 gradient ``ds`` at ``s``, keeps the
last W − 1 rows of ``u`` and ``ds`` in registers, and emits ``du`` of a row once the ``ds`` of the W − 1 rows after
it are known, with per-segment fp32 partial sums of ``dw``; it reads ``u`` and ``dy`` once and writes ``du`` once,
plus W − 1 rows of halo a segment.
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

# both kernels walk SEG rows a program, ROWS at a time (their loads in flight together), over BLOCK_D channels on
# WARPS warps; VEC: a row stride of 8·k elements declared as such (vector loads of u)
_FWD_SEG = 128
_FWD_ROWS = 8
_FWD_BLOCK_D = 128
_FWD_WARPS = 2
_BWD_SEG = 128
_BWD_ROWS = 4
_BWD_BLOCK_D = 128
_BWD_WARPS = 1
_BWD_VEC = True
_MAX_TAPS = 8


@triton.jit
def _taps(w_ptr, o_d, m_d, W: tl.constexpr):
    """W x ``[BD]`` fp32: element ``j`` multiplies ``u[t − j]``."""
    b_w = ()
    for j in tl.static_range(W):
        b_w += (tl.load(w_ptr + o_d * W + (W - 1 - j), mask=m_d, other=0.0).to(tl.float32),)
    return b_w


@triton.jit
def _history(u_ptr, t0, o_d, m_d, SU, W: tl.constexpr):
    """``u`` of the W − 1 rows before ``t0``, newest first, in its dtype (zeros before row 0)."""
    b_uw = ()
    for k in tl.static_range(W - 1):
        t_h = t0 - 1 - k
        b_uw += (tl.load(u_ptr + t_h.to(tl.int64) * SU + o_d, mask=tl.where(t_h >= 0, m_d, False), other=0.0),)
    return b_uw


@triton.jit
def _load_u_row(u_ptr, pos_ptr, t, o_d, m_d, N, SU):
    """Row ``t`` of ``u`` in its dtype (``[BD]``; zeros past ``N``) and the int32 position in its sequence."""
    t = tl.cast(t, tl.int32)  # a Python int in the interpreter's loops
    # a select, not `m_d & (t < N)`: Triton's interpreter splats a scalar comparison as int32, not as a mask
    b_u = tl.load(u_ptr + t.to(tl.int64) * SU + o_d, mask=tl.where(t < N, m_d, False), other=0.0)
    p = tl.load(pos_ptr + t, mask=t < N, other=0)
    return b_u, p


@triton.jit
def _load_row(u_ptr, dy_ptr, pos_ptr, t, o_d, m_d, N, D, SU):
    """`_load_u_row` and ``dy`` of row ``t`` in its dtype: ``(u, dy, pos)``."""
    b_u, p = _load_u_row(u_ptr, pos_ptr, t, o_d, m_d, N, SU)
    t = tl.cast(t, tl.int32)
    b_dy = tl.load(dy_ptr + t.to(tl.int64) * D + o_d, mask=tl.where(t < N, m_d, False), other=0.0)
    return b_u, b_dy, p


@triton.jit
def _pre_activation(b_u, p, b_uw, b_w, W: tl.constexpr, MASKED: tl.constexpr):
    """fp32 ``s`` of a row at position ``p`` from its ``u`` and the ``u`` of the W − 1 rows before it (``b_uw``,
    newest first); unless ``MASKED``, ``p ≥ W − 1``."""
    b_s = b_w[0] * b_u.to(tl.float32)
    for j in tl.static_range(1, W):
        b_uj = b_uw[j - 1].to(tl.float32)
        if MASKED:
            b_uj = tl.where(p >= j, b_uj, 0.0)  # u[t - j] is in an earlier sequence
        b_s += b_w[j] * b_uj
    return b_s


@triton.jit
def _forward_row(b_u, p, b_uw, b_w, y_ptr, t, o_d, m_d, N, D, W: tl.constexpr, MASKED: tl.constexpr):
    """Store ``y[t]``; returns the window moved on by the row."""
    t = tl.cast(t, tl.int32)
    b_s = _pre_activation(b_u, p, b_uw, b_w, W, MASKED)
    b_y = b_s * tl.sigmoid(b_s)
    tl.store(y_ptr + t.to(tl.int64) * D + o_d, b_y.to(y_ptr.dtype.element_ty), mask=tl.where(t < N, m_d, False))
    return ((b_u,) + b_uw)[:W - 1]


@triton.jit
def _conv_silu_fwd_kernel(u_ptr, w_ptr, pos_ptr, y_ptr, N, D, SU_BY_VEC, W: tl.constexpr, VEC: tl.constexpr,
                          SEG: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """``y`` of the rows ``[t0, t0 + SEG)``, channels ``[i_d · BLOCK_D, +BLOCK_D)``, walking the rows with ``u`` of
    the last W − 1 rows in registers: each row of ``u`` is read once, plus W − 1 rows before the segment. Groups of
    ROWS rows that are all W − 1 or more tokens into their sequences skip the masks."""
    tl.static_assert(SEG % ROWS == 0)
    SU = SU_BY_VEC * VEC
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    t0 = i_n * SEG
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_w = _taps(w_ptr, o_d, m_d, W)
    b_uw = _history(u_ptr, t0, o_d, m_d, SU, W)
    for t_r in range(t0, t0 + SEG, ROWS):
        b_ur, p_r = (), ()
        p_min = tl.cast(W - 1, tl.int32)
        for r in tl.static_range(ROWS):
            b_u, p = _load_u_row(u_ptr, pos_ptr, t_r + r, o_d, m_d, N, SU)
            b_ur += (b_u,)
            p_r += (p,)
            p_min = tl.minimum(p_min, p)
        if p_min >= W - 1:
            for r in tl.static_range(ROWS):
                b_uw = _forward_row(b_ur[r], p_r[r], b_uw, b_w, y_ptr, t_r + r, o_d, m_d, N, D, W, False)
        else:
            for r in tl.static_range(ROWS):
                b_uw = _forward_row(b_ur[r], p_r[r], b_uw, b_w, y_ptr, t_r + r, o_d, m_d, N, D, W, True)


@triton.jit
def _silu_grad(b_u, b_dy, p, b_uw, b_w, W: tl.constexpr, MASKED: tl.constexpr):
    """fp32 gradient at the pre-activation, ``dy · σ(s) · (1 + s(1 − σ(s)))``, of a row (`_pre_activation`)."""
    b_s = _pre_activation(b_u, p, b_uw, b_w, W, MASKED)
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
    b_w = _taps(w_ptr, o_d, m_d, W)
    b_dw = ()  # W x [BD] fp32: the partial sums of dw_j
    for _ in tl.static_range(W):
        b_dw += (tl.zeros([BLOCK_D], dtype=tl.float32),)
    # -- the history (b_uw[k] = u[t - 1 - k]): the s of rows t0 .. t0 + W - 2 needs it
    b_uw = _history(u_ptr, t0, o_d, m_d, SU, W)
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


def _positions_by_row(pos_T: torch.Tensor, N: int) -> torch.Tensor:
    """``[N]`` positions, one per row of ``B·T`` (a copy only when ``B > 1``): the kernels take no ``row % T``."""
    T = pos_T.shape[0]
    return pos_T if T == N else pos_T.repeat(N // T)


@torch.library.custom_op("k3infra::fused_conv_silu", mutates_args=())
def _conv_silu_op(u_ND: torch.Tensor, weight_DW: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    N, D = u_ND.shape
    W = weight_DW.shape[1]
    u_ND = _readable_rows(u_ND)
    y = torch.empty(N, D, dtype=u_ND.dtype, device=u_ND.device)
    if N:
        su, vec = _row_stride(u_ND)
        grid = (triton.cdiv(N, _FWD_SEG), triton.cdiv(D, _FWD_BLOCK_D))
        _conv_silu_fwd_kernel[grid](u_ND, weight_DW, _positions_by_row(pos_T, N), y, N, D, su, W=W, VEC=vec,
                                    SEG=_FWD_SEG, ROWS=_FWD_ROWS, BLOCK_D=_FWD_BLOCK_D, num_warps=_FWD_WARPS)
    return y


@_conv_silu_op.register_fake
def _(u_ND, weight_DW, pos_T):
    return u_ND.new_empty(u_ND.shape)


def _conv_silu_bwd(u_ND: torch.Tensor, weight_DW: torch.Tensor, pos_T: torch.Tensor, dy_ND: torch.Tensor, *,
                   seg: int, rows: int, block_d: int, warps: int, vec: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # moves 3 activation-dtype elements per (token, channel): u and dy in, du out, plus W − 1 halo rows of u and dy
    # a segment and the [N / seg, W, D] fp32 dw partial sums, written once and summed here
    N, D = u_ND.shape
    W = weight_DW.shape[1]
    du = torch.empty(N, D, dtype=u_ND.dtype, device=u_ND.device)
    segs = triton.cdiv(N, seg)
    dw_part = torch.empty(segs, W, D, dtype=torch.float32, device=u_ND.device)
    if N:
        su, v = _row_stride(u_ND) if vec else (u_ND.stride(0), 1)
        grid = (segs, triton.cdiv(D, block_d))
        _conv_silu_bwd_kernel[grid](u_ND, weight_DW, _positions_by_row(pos_T, N), dy_ND.contiguous(), du, dw_part, N,
                                    D, su, W=W, VEC=v, SEG=seg, ROWS=rows, BLOCK_D=block_d, num_warps=warps)
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
