"""Fused Triton kernels for the element-wise chains of `layers`: RMSNorm and SiTU-GLU, forward and backward.

Each kernel reads its inputs once (bf16 or fp32), computes in fp32 and writes its outputs once in the input dtype,
replacing the dozen memory-bound torch kernels of the eager autograd Functions in `layers`. The math and the
tensors saved for backward are those of the eager Functions (``x``, ``weight`` and the fp32 ``1/rms`` per row for
RMSNorm; ``a`` and ``c`` for SiTU-GLU; the sources, query, norm weight and fp32 ``[S, N]`` rms, scores and
weights for the AttnRes mix), which stay the reference.

`MODE` chooses the path: ``"auto"`` (the default: CUDA tensors take the kernels, others the eager path),
``"off"`` (eager everywhere), ``"on"`` (also CPU tensors, through Triton's interpreter; needs
``TRITON_INTERPRET=1`` before triton is imported). While ``torch.compile`` traces, the compiler fuses the RMSNorm
and AttnRes chains itself; SiTU-GLU stays these kernels there (operators ``k3infra::fused_situ_glu`` and its
backward, faster than the compiled chain). Measured speed-ups: docs/k3-training.md.

Shape suffixes: N rows, D hidden, F MLP width.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["MODE", "attn_res_mix", "rms_norm", "situ_glu", "use_fused"]

MODE = os.environ.get("K3_FUSED_ELEMENTWISE", "auto")
"""``"auto"``, ``"on"`` or ``"off"`` (see the module docstring); its start value comes from the environment
variable ``K3_FUSED_ELEMENTWISE`` (default ``"auto"``)."""

_MODES = ("auto", "on", "off")
_MAX_NORM_WIDTH = 1 << 16
_NORM_TILE = 8192
_SITU_BLOCK = 1024


def use_fused(x: torch.Tensor, while_compiling: bool = False) -> bool:
    """Whether ``x`` (fp32 or bf16/fp16) takes the fused kernels under the current `MODE`; while ``torch.compile``
    traces only with ``while_compiling`` (a kernel registered as an operator, which the compiler cannot fuse
    better itself)."""
    if MODE not in _MODES:
        raise ValueError(f"fused.MODE must be one of {_MODES}, got {MODE!r}")
    if MODE == "off" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if torch.compiler.is_compiling() and not while_compiling:
        return False
    if x.device.type == "cuda":
        return True
    return MODE == "on" and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _grid_rows(n: int, device: torch.device) -> int:
    """Programs for a row-blocked kernel: a few per SM on a GPU, a handful in the interpreter."""
    if device.type == "cuda":
        return max(1, min(n, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n, 4))


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, D, eps, BLOCKS_PER_PROG, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    for i in range(0, BLOCKS_PER_PROG):
        rows = (pid * BLOCKS_PER_PROG + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < N)[:, None] & (cols < D)[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rows < N)
        tl.store(y_ptr + offs, (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_part_ptr, N, D, BLOCKS_PER_PROG,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for i in range(0, BLOCKS_PER_PROG):
        rows = (pid * BLOCKS_PER_PROG + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < N)[:, None] & (cols < D)[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < N, other=0.0)
        xhat = x * rstd[:, None]
        dyw = dy * w[None, :]
        dx = rstd[:, None] * (dyw - xhat * (tl.sum(dyw * xhat, axis=1) / D)[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_part_ptr + pid * D + cols, tl.sum(dw, axis=0), mask=cols < D)


def _warps(tile: int) -> int:
    return 8 if tile >= 4096 else 4


def _rows_launch(n: int, d: int, device: torch.device, name: str) -> tuple[int, int, int, int]:
    """(programs, row blocks per program, BLOCK_N, BLOCK_D): row tiles of about `_NORM_TILE` elements."""
    if d > _MAX_NORM_WIDTH:
        raise ValueError(f"{name}: the fused kernel takes widths up to {_MAX_NORM_WIDTH}, got {d}")
    block_d = triton.next_power_of_2(d)
    block_n = min(triton.next_power_of_2(n), max(1, _NORM_TILE // block_d))
    blocks = triton.cdiv(n, block_n)
    programs = _grid_rows(blocks, device)
    return programs, triton.cdiv(blocks, programs), block_n, block_d


class _FusedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n, d = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        if n:
            programs, blocks, block_n, block_d = _rows_launch(n, d, x2.device, "rms_norm")
            _rms_norm_fwd_kernel[(programs,)](x2, weight.contiguous(), y, rstd, n, d, eps, blocks, BLOCK_N=block_n,
                                              BLOCK_D=block_d, num_warps=_warps(block_n * block_d))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n, d = x2.shape
        dy2 = dy.reshape(-1, d).contiguous()
        dx = torch.empty_like(x2)
        dw = torch.zeros(d, dtype=torch.float32, device=x2.device) if n == 0 else None
        if n:
            programs, blocks, block_n, block_d = _rows_launch(n, d, x2.device, "rms_norm")
            part = torch.empty(programs, d, dtype=torch.float32, device=x2.device)
            _rms_norm_bwd_kernel[(programs,)](x2, weight.contiguous(), rstd, dy2, dx, part, n, d, blocks,
                                              BLOCK_N=block_n, BLOCK_D=block_d, num_warps=_warps(block_n * block_d))
            dw = part.sum(0)
        dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused `layers.rms_norm`: ``x [..., D]`` (fp32/bf16/fp16) · fp32 ``1/rms`` · ``weight [D]``, in ``x``'s
    dtype. Saves ``x``, ``weight`` and the fp32 ``1/rms`` ``[N]``; backward gives ``dx`` in ``x``'s dtype and
    ``dw`` (fp32 per-program partial sums, then one reduction) in ``weight``'s dtype."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    return _FusedRMSNormFunction.apply(x, weight, eps)


@triton.jit
def _tanh(x):
    # 2σ(2x) − 1 saturates to ±1 without overflow (exp(−2x) → inf gives −1).
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _situ_glu_value(a, c, gate_beta, up_beta):
    """SiTU-GLU of fp32 tiles ``a`` and ``c``."""
    return gate_beta * _tanh(a / gate_beta) * tl.sigmoid(a) * (up_beta * _tanh(c / up_beta))


@triton.jit
def _situ_glu_fwd_kernel(a_ptr, c_ptr, y_ptr, numel, gate_beta, up_beta, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _situ_glu_value(a, c, gate_beta, up_beta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_grads(a, c, dy, gate_beta, up_beta):
    """``(da, dc, SiTU-GLU(a, c))`` for the output gradient ``dy`` (fp32 tiles)."""
    t1 = _tanh(a / gate_beta)
    s = tl.sigmoid(a)
    t2 = _tanh(c / up_beta)
    gate = gate_beta * t1 * s
    up = up_beta * t2
    return dy * up * ((1.0 - t1 * t1) * s + gate * (1.0 - s)), dy * gate * (1.0 - t2 * t2), gate * up


@triton.jit
def _situ_glu_bwd_kernel(a_ptr, c_ptr, dy_ptr, da_ptr, dc_ptr, numel, gate_beta, up_beta, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    da, dc, _ = _situ_glu_grads(a, c, dy, gate_beta, up_beta)
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(dc_ptr + offs, dc.to(dc_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("k3infra::fused_situ_glu", mutates_args=())
def _situ_glu_op(a: torch.Tensor, c: torch.Tensor, gate_beta: float, up_beta: float) -> torch.Tensor:
    # operators (forward and backward), so that torch.compile's graphs call these kernels too
    y = torch.empty_like(a)
    numel = a.numel()
    if numel:
        grid = (triton.cdiv(numel, _SITU_BLOCK),)
        _situ_glu_fwd_kernel[grid](a, c, y, numel, gate_beta, up_beta, BLOCK=_SITU_BLOCK)
    return y


@_situ_glu_op.register_fake
def _(a, c, gate_beta, up_beta):
    return torch.empty_like(a)


@torch.library.custom_op("k3infra::fused_situ_glu_backward", mutates_args=())
def _situ_glu_bwd_op(a: torch.Tensor, c: torch.Tensor, dy: torch.Tensor, gate_beta: float,
                     up_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    da, dc = torch.empty_like(a), torch.empty_like(c)
    numel = a.numel()
    if numel:
        grid = (triton.cdiv(numel, _SITU_BLOCK),)
        _situ_glu_bwd_kernel[grid](a, c, dy.contiguous(), da, dc, numel, gate_beta, up_beta, BLOCK=_SITU_BLOCK)
    return da, dc


@_situ_glu_bwd_op.register_fake
def _(a, c, dy, gate_beta, up_beta):
    return torch.empty_like(a), torch.empty_like(c)


def _situ_glu_setup(ctx, inputs, output):
    a, c, gate_beta, up_beta = inputs
    ctx.save_for_backward(a, c)
    ctx.betas = (gate_beta, up_beta)


def _situ_glu_backward(ctx, dy):
    a, c = ctx.saved_tensors
    da, dc = _situ_glu_bwd_op(a, c, dy, *ctx.betas)
    return da, dc, None, None


_situ_glu_op.register_autograd(_situ_glu_backward, setup_context=_situ_glu_setup)


@triton.jit
def _scaled_rows(s_ptr, N, BLOCK_N: tl.constexpr):
    """This program's ``BLOCK_N`` rows, which of them exist, and their fp32 scales."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    return rows, row_ok, tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def _row_tile(a_ptr, c_ptr, rows, row_ok, f0, F, BLOCK_F: tl.constexpr):
    """The ``[rows, f0 : f0 + BLOCK_F]`` tile of the ``[N, F]`` inputs: its mask, its offsets, ``a`` and ``c`` in
    fp32."""
    cols = f0 + tl.arange(0, BLOCK_F)
    mask = row_ok[:, None] & (cols < F)[None, :]
    offs = rows.to(tl.int64)[:, None] * F + cols[None, :]
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return mask, offs, a, c


@triton.jit
def _situ_glu_scaled_fwd_kernel(a_ptr, c_ptr, s_ptr, y_ptr, N, F, gate_beta, up_beta, BLOCK_N: tl.constexpr,
                                BLOCK_F: tl.constexpr):
    rows, row_ok, scale = _scaled_rows(s_ptr, N, BLOCK_N)
    for f0 in range(0, F, BLOCK_F):
        mask, offs, a, c = _row_tile(a_ptr, c_ptr, rows, row_ok, f0, F, BLOCK_F)
        y = _situ_glu_value(a, c, gate_beta, up_beta) * scale[:, None]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_scaled_bwd_kernel(a_ptr, c_ptr, s_ptr, dy_ptr, da_ptr, dc_ptr, ds_ptr, N, F, gate_beta, up_beta,
                                BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    rows, row_ok, scale = _scaled_rows(s_ptr, N, BLOCK_N)
    ds = tl.zeros([BLOCK_N], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        mask, offs, a, c = _row_tile(a_ptr, c_ptr, rows, row_ok, f0, F, BLOCK_F)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        da, dc, act = _situ_glu_grads(a, c, dy * scale[:, None], gate_beta, up_beta)
        ds += tl.sum(dy * act, axis=1)
        tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
        tl.store(dc_ptr + offs, dc.to(dc_ptr.dtype.element_ty), mask=mask)
    tl.store(ds_ptr + rows, ds.to(ds_ptr.dtype.element_ty), mask=row_ok)


def _scaled_launch(n: int, f: int) -> tuple[tuple[int], int, int]:
    block_f = min(256, triton.next_power_of_2(max(f, 1)))
    block_n = max(1, 2048 // block_f)
    return (triton.cdiv(n, block_n),), block_n, block_f


@torch.library.custom_op("k3infra::fused_situ_glu_scaled", mutates_args=())
def _situ_glu_scaled_op(a: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, gate_beta: float,
                        up_beta: float) -> torch.Tensor:
    y = torch.empty_like(a)
    n, f = a.shape
    if n and f:
        grid, block_n, block_f = _scaled_launch(n, f)
        _situ_glu_scaled_fwd_kernel[grid](a, c, scale, y, n, f, gate_beta, up_beta, BLOCK_N=block_n,
                                          BLOCK_F=block_f)
    return y


@_situ_glu_scaled_op.register_fake
def _(a, c, scale, gate_beta, up_beta):
    return torch.empty_like(a)


@torch.library.custom_op("k3infra::fused_situ_glu_scaled_backward", mutates_args=())
def _situ_glu_scaled_bwd_op(a: torch.Tensor, c: torch.Tensor, scale: torch.Tensor, dy: torch.Tensor,
                            gate_beta: float, up_beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    da, dc, ds = torch.empty_like(a), torch.empty_like(c), torch.empty_like(scale)
    n, f = a.shape
    if n and f:
        grid, block_n, block_f = _scaled_launch(n, f)
        _situ_glu_scaled_bwd_kernel[grid](a, c, scale, dy.contiguous(), da, dc, ds, n, f, gate_beta, up_beta,
                                          BLOCK_N=block_n, BLOCK_F=block_f)
    else:
        ds.zero_()
    return da, dc, ds


@_situ_glu_scaled_bwd_op.register_fake
def _(a, c, scale, dy, gate_beta, up_beta):
    return torch.empty_like(a), torch.empty_like(c), torch.empty_like(scale)


def _situ_glu_scaled_setup(ctx, inputs, output):
    a, c, scale, gate_beta, up_beta = inputs
    ctx.save_for_backward(a, c, scale)
    ctx.betas = (gate_beta, up_beta)


def _situ_glu_scaled_backward(ctx, dy):
    a, c, scale = ctx.saved_tensors
    da, dc, ds = _situ_glu_scaled_bwd_op(a, c, scale, dy, *ctx.betas)
    return da, dc, ds, None, None


_situ_glu_scaled_op.register_autograd(_situ_glu_scaled_backward, setup_context=_situ_glu_scaled_setup)


def situ_glu(a: torch.Tensor, c: torch.Tensor, gate_beta: float, up_beta: float,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `layers.situ_glu`: ``β1·tanh(a/β1)·σ(a) ⊙ β2·tanh(c/β2)`` element-wise over ``a, c`` (same shape and
    dtype, fp32/bf16/fp16), fp32 inside, returned in ``a``'s dtype; saves ``a`` and ``c`` for backward. The operator
    ``k3infra::fused_situ_glu`` (and its backward): compiled graphs call these kernels as well.

    ``scale`` (``a.shape[:-1]``, fp32 or ``a``'s dtype, or None) multiplies each row in fp32 before the rounding
    (operator ``k3infra::fused_situ_glu_scaled``): its gradient, ``Σ_f dy ⊙ SiTU-GLU(a, c)`` per row, is
    accumulated in fp32 by the same pass that writes ``da`` and ``dc``, and returned in ``scale``'s dtype."""
    if a.shape != c.shape or a.dtype != c.dtype:
        raise ValueError(f"situ_glu: a and c must match in shape and dtype, got {tuple(a.shape)} {a.dtype} and "
                         f"{tuple(c.shape)} {c.dtype}")
    if scale is None:
        return _situ_glu_op(a.contiguous(), c.contiguous(), float(gate_beta), float(up_beta))
    if scale.shape != a.shape[:-1] or not scale.is_floating_point():
        raise ValueError(f"situ_glu: scale must be a floating-point tensor of shape {tuple(a.shape[:-1])} (a's rows), "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    f = a.shape[-1]
    y = _situ_glu_scaled_op(a.reshape(-1, f).contiguous(), c.reshape(-1, f).contiguous(),
                            scale.reshape(-1).contiguous(), float(gate_beta), float(up_beta))
    return y.view(a.shape)


@triton.jit
def _source_rows(block, cols, sidx, N, D, S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row block ``block`` of the AttnRes kernels: its rows and row mask, the ``[BLOCK_N, BLOCK_D]`` element mask and
    offsets into a source, and the ``[BLOCK_N, S_PAD]`` offsets and mask into the ``[S, N]`` statistics."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    mask = rmask[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    stat_offs = sidx[None, :] * N + rows[:, None]
    stat_mask = rmask[:, None] & (sidx < S)[None, :]
    return rows, rmask, mask, offs, stat_offs, stat_mask


@triton.jit
def _attn_res_fwd_kernel(srcs, u_ptr, out_ptr, rstd_ptr, score_ptr, w_ptr, N, D, eps, BLOCKS_PER_PROG,
                         S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    sidx = tl.arange(0, S_PAD)
    u = tl.load(u_ptr + cols, mask=cols < D, other=0.0)
    for b in range(0, BLOCKS_PER_PROG):
        rows, rmask, mask, offs, stat_offs, stat_mask = _source_rows(pid * BLOCKS_PER_PROG + b, cols, sidx, N, D, S,
                                                                    BLOCK_N)
        # online softmax over the sources: each source is read once
        m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        logits = tl.full([BLOCK_N, S_PAD], float("-inf"), dtype=tl.float32)
        for i in tl.static_range(S):
            v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
            score = tl.sum(v * u[None, :], axis=1)
            tl.store(rstd_ptr + i * N + rows, rstd, mask=rmask)
            tl.store(score_ptr + i * N + rows, score, mask=rmask)
            logit = rstd * score
            logits = tl.where(sidx[None, :] == i, logit[:, None], logits)
            m_new = tl.maximum(m, logit)
            alpha = tl.exp(m - m_new)
            p = tl.exp(logit - m_new)
            denom = denom * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v
            m = m_new
        tl.store(w_ptr + stat_offs, tl.exp(logits - m[:, None]) / denom[:, None], mask=stat_mask)
        tl.store(out_ptr + offs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attn_res_bwd_kernel(srcs, grads, dh_ptr, u_ptr, rstd_ptr, score_ptr, w_ptr, p_part_ptr, N, D,
                         BLOCKS_PER_PROG, S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    sidx = tl.arange(0, S_PAD)
    u = tl.load(u_ptr + cols, mask=cols < D, other=0.0)
    p_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for b in range(0, BLOCKS_PER_PROG):
        rows, rmask, mask, offs, stat_offs, stat_mask = _source_rows(pid * BLOCKS_PER_PROG + b, cols, sidx, N, D, S,
                                                                    BLOCK_N)
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + stat_offs, mask=stat_mask, other=0.0)
        dw = tl.zeros([BLOCK_N, S_PAD], dtype=tl.float32)
        for i in tl.static_range(S):
            v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            dw = tl.where(sidx[None, :] == i, tl.sum(dh * v, axis=1)[:, None], dw)
        dlogit = w * (dw - tl.sum(w * dw, axis=1)[:, None])
        for i in tl.static_range(S):
            v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + i * N + rows, mask=rmask, other=0.0)
            score = tl.load(score_ptr + i * N + rows, mask=rmask, other=0.0)
            sel = sidx[None, :] == i
            c = rstd * tl.sum(tl.where(sel, dlogit, 0.0), axis=1)  # d logit / d (v·u), per row
            w_i = tl.sum(tl.where(sel, w, 0.0), axis=1)
            p_acc += c[:, None] * v
            r2 = score * rstd * rstd / D
            dv = w_i[:, None] * dh + c[:, None] * (u[None, :] - r2[:, None] * v)
            tl.store(grads[i] + offs, dv.to(grads[i].dtype.element_ty), mask=mask)
    tl.store(p_part_ptr + pid * D + cols, tl.sum(p_acc, axis=0), mask=cols < D)


class _FusedAttnResFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, norm_weight, eps, *sources):
        shape = sources[0].shape
        d, S = shape[-1], len(sources)
        srcs = tuple(v.reshape(-1, d).contiguous() for v in sources)
        n = srcs[0].shape[0]
        u = norm_weight.float() * query.float()
        out = torch.empty_like(srcs[0])
        stats = torch.empty(3, S, n, dtype=torch.float32, device=out.device)
        if n:
            programs, blocks, block_n, block_d = _rows_launch(n, d, out.device, "attn_res_mix")
            _attn_res_fwd_kernel[(programs,)](srcs, u, out, stats[0], stats[1], stats[2], n, d, eps, blocks, S=S,
                                              S_PAD=triton.next_power_of_2(S), BLOCK_N=block_n, BLOCK_D=block_d,
                                              num_warps=_warps(block_n * block_d))
        ctx.save_for_backward(query, norm_weight, stats, *srcs)
        ctx.shape = shape
        return out.view(shape)

    @staticmethod
    def backward(ctx, dh):
        query, norm_weight, stats, *srcs = ctx.saved_tensors
        srcs = tuple(srcs)  # the kernel takes a tuple of tensors, not a list
        n, d = srcs[0].shape
        S = len(srcs)
        dh2 = dh.reshape(-1, d).contiguous()
        u = norm_weight.float() * query.float()
        grads = tuple(torch.empty_like(v) for v in srcs)
        p = torch.zeros(d, dtype=torch.float32, device=dh.device)
        if n:
            programs, blocks, block_n, block_d = _rows_launch(n, d, dh.device, "attn_res_mix")
            part = torch.empty(programs, d, dtype=torch.float32, device=dh.device)
            _attn_res_bwd_kernel[(programs,)](srcs, grads, dh2, u, stats[0], stats[1], stats[2], part, n, d, blocks,
                                              S=S, S_PAD=triton.next_power_of_2(S), BLOCK_N=block_n,
                                              BLOCK_D=block_d, num_warps=_warps(block_n * block_d))
            p = part.sum(0)
        dq = (p * norm_weight.float()).to(query.dtype) if ctx.needs_input_grad[0] else None
        dnw = (p * query.float()).to(norm_weight.dtype) if ctx.needs_input_grad[1] else None
        dvs = [g.view(ctx.shape) if ctx.needs_input_grad[3 + i] else None for i, g in enumerate(grads)]
        return dq, dnw, None, *dvs


def attn_res_mix(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Fused `layers.attn_res_mix`: ``Σ_i softmax_i(qᵀ RMSNorm(V_i)) · V_i`` over ``sources`` (each ``[..., D]``,
    one shape; fp32, bf16 or fp16, mixed as autocast leaves them), each source read once (online softmax over the
    sources, fp32 inside), returned in the first source's dtype; each gradient comes in its source's dtype. Saves
    the sources and fp32 ``[3, S, N]`` rms, scores and weights; backward reads each source twice and reduces the
    query gradient from per-program fp32 partial sums."""
    if not sources or any(v.shape != sources[0].shape for v in sources):
        raise ValueError("attn_res_mix: sources must be a non-empty list of tensors of one shape, got shapes "
                         f"{[tuple(v.shape) for v in sources]}")
    if any(v.dtype not in (torch.float32, torch.bfloat16, torch.float16) for v in sources):
        raise ValueError(f"attn_res_mix: sources must be fp32, bf16 or fp16, got {[v.dtype for v in sources]}")
    if query.shape != (sources[0].shape[-1],) or norm_weight.shape != query.shape:
        raise ValueError(f"attn_res_mix: query and norm_weight must have shape ({sources[0].shape[-1]},), got "
                         f"{tuple(query.shape)} and {tuple(norm_weight.shape)}")
    return _FusedAttnResFunction.apply(query, norm_weight, eps, *sources)
