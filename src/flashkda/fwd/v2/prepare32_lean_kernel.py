"""A leaner chunk-32 prepare kernel (K1 c32), `kda_fwd_v2_prepare32_lean_kernel`: the signature, launch and
workspace of ``prepare32_kernel.kda_fwd_v2_prepare32_wide_kernel``, with fewer issued instructions in the
elementwise part. Launched by ``prepare32.prepare32_fwd(..., kernel="lean")`` (or loaded by path by the offline
compile script).

What differs from the wide kernel (its products and inverse, `_products32`, are reused as they are):

- **8-byte global accesses.** A thread owns both halves of 2 tokens x 4 adjacent channels (``LEAN3``), so each
  token row of q, k, g, kd, qd, kr is one 8-byte access instead of two 4-byte ones, and the row offsets and
  masks are formed for 4 rows instead of 8. The L2 norms reduce 4 channels in registers and over 4 lanes (two
  shuffle levels instead of three; 4 rows a thread go through the cross-warp step instead of 8); the gate's cumsum
  runs over 8 lanes instead of 4.
- **The gate in five instructions per element.** ``gate_scale * sigmoid(exp(A_log) (g + dt_bias))`` as
  ``t = g a + dt_bias a`` (one FFMA, ``a = -exp(A_log) log2(e)`` per head, ``dt_bias a`` per channel),
  ``gate_scale * rcp(1 + 2^t)`` with ``ex2.approx.ftz`` and ``rcp.approx.ftz``: the wide kernel's ``/`` is
  ``div.full.f32``, whose range fix-ups cost four more instructions per element. The gate of a token past the
  chunk's end loads as ``-inf``, so its activation is exactly 0 (``2^t = inf``, ``rcp(inf) = 0``) without a select.
- **``2^-G = rcp(2^G)``**: one special function instead of a negation and an ``ex2`` (``2^G`` is within
  ``2^+-115``, a normal number either way, so the reciprocal is within 1 ulp of ``2^-G`` rounded).

The formulas are the wide kernel's up to fp32 rounding (``t`` differs from ``-(g + dt_bias) exp(A_log) log2(e)``
by the rounding of the two products; the approximate reciprocals by 1-2 ulp), far below the bf16 rounding of the
stored values (``tests/flashkda/test_fwd_v2_c32.py``: the lean cases of
``test_wide_kernel_factor_products_match_the_emulation``, ``test_lean_gate_is_exactly_zero_past_the_chunk_end``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from flashkda.fwd.v2 import prepare32_kernel as _wide
except ImportError:  # loaded by path by the offline compile script (no flashkda, no torch there)
    _spec = importlib.util.spec_from_file_location("flashkda_v2_prepare32_kernel",
                                                   Path(__file__).with_name("prepare32_kernel.py"))
    _wide = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_wide)

NUM_WARPS = _wide.NUM_WARPS
#: register cap per thread, the wide kernel's: 3 CTAs of 8 warps per SM
MAX_REGISTERS = _wide.MAX_REGISTERS
HALF = _wide.HALF
HEAD_DIM = _wide.HEAD_DIM
LOG2E = _wide.LOG2E
L2NORM_EPS = _wide.L2NORM_EPS
SMEM_TOK = _wide.SMEM_TOK
SMEM_KT = _wide.SMEM_KT
_add = _wide._add
_beta_rows = _wide._beta_rows
_products32 = _wide._products32
_chunk_ends = _wide._chunk_ends
_store_operands = _wide._store_operands

# [2 halves, 16 tokens, 128 channels]: a thread owns both halves of 2 tokens x 4 adjacent channels (8-byte loads
# and stores), 8 lanes along tokens, 4 lanes x 8 warps along channels
LEAN3 = gl.constexpr(gl.BlockedLayout([2, 2, 4], [1, 8, 4], [1, 1, 8], [2, 1, 0]))
L_H = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, LEAN3)))  # [2] halves
L_T = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(2, LEAN3)))  # [16] tokens
L_K = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(1, LEAN3)))  # [128] channels
L_HK = gl.constexpr(gl.SliceLayout(1, LEAN3))  # [2, 128]


@gluon.jit
def _rcp(x):
    """``1 / x`` by ``rcp.approx.ftz.f32`` (1 ulp; ``1 / inf = 0``), without ``div.full``'s range fix-ups."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _lean_offsets(first, n_valid, i_h, H):
    """``[2, 16, 128]`` mask of a chunk's valid tokens (half, token, channel), the 64-bit offset of its first
    token-head row and the 32-bit element offsets from there, for tensors with ``H`` heads."""
    hh = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=L_H), 1), 2)  # [2, 1, 1]
    tt = gl.expand_dims(gl.expand_dims(gl.arange(0, HALF, layout=L_T), 0), 2)  # [1, 16, 1]
    kk = gl.expand_dims(gl.expand_dims(gl.arange(0, HEAD_DIM, layout=L_K), 0), 1)  # [1, 1, 128]
    tok = hh * HALF + tt
    mask = (tok < n_valid) & (kk < HEAD_DIM)
    base = (first.to(gl.int64) * H + i_h) * HEAD_DIM
    return mask, base, tok * (H * HEAD_DIM) + kk


@gluon.jit
def _elementwise32_lean(q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale,
                        gate_scale, left_s, q_s, right_s, GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr,
                        HAS_DT_BIAS: gl.constexpr):
    """The elementwise part of a chunk, whole, in the ``LEAN3`` layout: stores ``kd, qd, kr, glast`` and writes the
    product operands into ``left_s, q_s, right_s`` (as `_elementwise32_wide`, module docstring for what differs)."""
    K: gl.constexpr = HEAD_DIM
    mask, base, offs = _lean_offsets(first, n_valid, i_h, H)
    if GROUP == 1:
        b_q = gl.load(q + base + offs, mask=mask, other=0.0)
        b_k = gl.load(k + base + offs, mask=mask, other=0.0)
    else:
        _, base_qk, offs_qk = _lean_offsets(first, n_valid, i_h // GROUP, H // GROUP)
        b_q = gl.load(q + base_qk + offs_qk, mask=mask, other=0.0)
        b_k = gl.load(k + base_qk + offs_qk, mask=mask, other=0.0)
    b_g = gl.load(g + base + offs, mask=mask, other=float("-inf"))  # past the end: an activation of exactly 0
    o_k = gl.arange(0, K, layout=L_K)
    # t = -log2(e) exp(A_log) (g + dt_bias) = g a + dt_bias a
    if HAS_A_LOG:
        a = -gl.exp2(gl.load(A_log + i_h).to(gl.float32) * LOG2E) * LOG2E
    else:
        a = -LOG2E
    b_q = b_q.to(gl.float32)
    b_k = b_k.to(gl.float32)
    b_g = b_g.to(gl.float32)
    b_q = b_q * gl.expand_dims(gl.rsqrt(gl.sum(b_q * b_q, axis=2) + L2NORM_EPS) * scale, 2)
    b_k = b_k * gl.expand_dims(gl.rsqrt(gl.sum(b_k * b_k, axis=2) + L2NORM_EPS), 2)
    if HAS_DT_BIAS:
        c = gl.expand_dims(gl.expand_dims(gl.load(dt_bias + i_h * K + o_k).to(gl.float32) * a, 0), 1)
        b_g = b_g * a + c
    else:
        b_g = b_g * a
    b_g = gate_scale * _rcp(1.0 + gl.exp2(b_g))
    G = gl.associative_scan(b_g, 1, _add)  # in-half cumsum: G_A, and G_B' = G_B - r
    r, b_end = _chunk_ends(G, glast, tile, o_k, n_valid, L_T, L_HK)
    e_r = gl.expand_dims(gl.expand_dims(gl.exp2(r), 0), 1)  # [1, 1, K]
    e_end = gl.expand_dims(gl.expand_dims(gl.exp2(b_end), 0), 1)
    hh = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=L_H), 1), 2)
    e_pos = gl.exp2(G)
    kd_op = b_k * e_pos  # k 2^G_A, k 2^G_B'
    qd_op = b_q * e_pos
    ki_op = b_k * _rcp(e_pos)  # k 2^-G_A, k 2^-G_B'
    kiar = ki_op * e_r  # half A: k 2^(r - G_A)
    # stored: kd = k 2^G (half B: k 2^(G_B' + r)), kr = k 2^(Glast - G) (half A: 2^(r - G_A) 2^G_B'[15])
    b_half = hh == 1
    gl.store(kd + base + offs, gl.where(b_half, kd_op * e_r, kd_op).to(gl.bfloat16), mask=mask)
    gl.store(qd + base + offs, gl.where(b_half, qd_op * e_r, qd_op).to(gl.bfloat16), mask=mask)
    gl.store(kr + base + offs, (gl.where(b_half, ki_op, kiar) * e_end).to(gl.bfloat16), mask=mask)
    _store_operands(kd_op, qd_op, ki_op, kiar, left_s, q_s, right_s)


@gluon.jit
def kda_fwd_v2_prepare32_lean_kernel(
    q, k, g, beta_in, A_log, dt_bias, chunk_index, kd, qd, kr, inv, mqk, glast, beta, scale, gate_scale, NT, H,
    GROUP: gl.constexpr, HAS_A_LOG: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
):
    """K1 c32 with the lean elementwise part (`_elementwise32_lean`) and the wide kernel's products
    (`_products32`); arguments, grid (``NT * H``, the head fastest) and workspace as the wide kernel's."""
    K: gl.constexpr = HEAD_DIM
    i_c = gl.program_id(0) // H
    i_h = gl.program_id(0) % H
    first = gl.load(chunk_index + i_c * 3 + 1)
    n_valid = gl.load(chunk_index + i_c * 3 + 2)
    tile = i_c.to(gl.int64) * H + i_h
    o_b, o_i, ok, rows, b_beta = _beta_rows(beta_in, first, n_valid, i_h, H)
    left_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [4, HALF, K], SMEM_TOK)
    right_s = gl.allocate_shared_memory(gl.bfloat16, [4, K, HALF], SMEM_KT)
    _elementwise32_lean(q, k, g, A_log, dt_bias, kd, qd, kr, glast, first, n_valid, i_h, H, tile, scale,
                        gate_scale, left_s, q_s, right_s, GROUP, HAS_A_LOG, HAS_DT_BIAS)
    _products32(left_s, q_s, right_s, b_beta, rows, ok, o_b, o_i, beta, inv, mqk, tile, n_valid)

