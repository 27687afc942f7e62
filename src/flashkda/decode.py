"""Token-by-token KDA for decode (a few tokens per sequence, state in and out): ``flashkda.fused_recurrent_kda``.

One program per (V block, sequence, value head) keeps its ``[K, BV]`` slice of the fp32 state in registers for
all the sequence's tokens. Decode is bound by moving the state: ``2 x N x HV x K x V x 4`` bytes (read + write).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from flashkda import checks
from flashkda.ops import beta_map, kda_gate, l2norm_rows


@triton.jit(do_not_specialize=["T", "scale", "lower_bound"])
def fused_recurrent_kda_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens,
    scale, lower_bound, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, USE_L2NORM: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    if STATE_V_FIRST:
        o_s = o_v[None, :] * K + o_k[:, None]
    else:
        o_s = o_k[:, None] * V + o_v[None, :]
    i_s = (i_n.to(tl.int64) * HV + i_hv) * K * V

    if HAS_BIAS:
        b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    else:
        b_bias = tl.zeros([BK], dtype=tl.float32)
    if HAS_A:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
    else:
        b_A = 0.0

    # [BK, BV]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + i_s + o_s, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(bos, eos):
        # [1, BK] rows so the row-wise helpers apply
        b_q = tl.load(q + (i_t * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
        b_k = tl.load(k + (i_t * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
        if USE_L2NORM:
            b_q = l2norm_rows(b_q)
            b_k = l2norm_rows(b_k)
        b_q = tl.reshape(b_q, [BK]) * scale
        b_k = tl.reshape(b_k, [BK])
        b_g = tl.load(g + (i_t * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if USE_GATE:
            b_g = kda_gate(b_g, b_bias, b_A, lower_bound, HAS_A, USE_LOWER_BOUND)
        b_g = tl.where(m_k, b_g, 0.0)
        b_b = beta_map(tl.load(beta + i_t * HV + i_hv).to(tl.float32), BETA_SIGMOID, ALLOW_NEG_EIGVAL)
        b_v = tl.load(v + (i_t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)

        b_S = b_S * tl.exp(b_g)[:, None]
        # [BV] delta rule: write beta * (v - Sᵀk) along k
        b_d = (b_v - tl.sum(b_S * b_k[:, None], 0)) * b_b
        b_S = b_S + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_S * b_q[:, None], 0)
        tl.store(o + (i_t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    if STORE_FINAL_STATE:
        tl.store(ht + i_s + o_s, b_S, mask=m_kv)


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                            allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, N, block_v=None):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    ht = None
    if output_final_state:
        ht = torch.empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32, device=q.device)
    if N == 0:
        return o, ht
    BK = max(16, triton.next_power_of_2(K))
    BV = block_v or min(32, max(16, triton.next_power_of_2(V)))
    fused_recurrent_kda_fwd_kernel[(triton.cdiv(V, BV), N, HV)](
        q, k, v, g, beta, A_log, dt_bias, o, initial_state, ht, cu_seqlens,
        scale, 0.0 if lower_bound is None else float(lower_bound), T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=ht is not None,
        USE_L2NORM=use_qk_l2norm_in_kernel, USE_GATE=use_gate_in_kernel, HAS_A=A_log is not None,
        HAS_BIAS=dt_bias is not None, USE_LOWER_BOUND=lower_bound is not None,
        BETA_SIGMOID=use_beta_sigmoid_in_kernel, ALLOW_NEG_EIGVAL=allow_neg_eigval, STATE_V_FIRST=state_v_first,
        IS_VARLEN=cu_seqlens is not None, num_warps=4,
    )
    return o, ht


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA token by token, for decode; same arguments and returns as fla-core 0.6.0's ``fused_recurrent_kda``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` log-space decay (raw with
            ``use_gate_in_kernel``); beta: ``[B, T, HV]``.
        A_log: ``[HV]`` for the in-kernel gate (may be None with ``lower_bound``).
        dt_bias: ``[HV * K]`` gate bias or None.
        scale: query scale, default ``K ** -0.5``.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) or None (zeros).
        output_final_state: return the final state (else None).
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
            state_v_first, cu_seqlens: as in ``flashkda.chunk_kda``.
        **kwargs: ``transpose_state_layout`` (deprecated alias of ``state_v_first``); others are ignored.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` fp32 or None.

    Raises:
        ValueError: bad shapes, dtypes, devices, flags or ``cu_seqlens`` (the message names the argument).

    Example::

        >>> import torch, flashkda
        >>> N, H, K = 256, 32, 128
        >>> q, k, v = (torch.randn(N, 1, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        >>> g = -torch.rand(N, 1, H, K, device="cuda")
        >>> beta = torch.rand(N, 1, H, device="cuda")
        >>> state = torch.zeros(N, H, K, K, device="cuda")
        >>> o, state = flashkda.fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
        ...                                         use_qk_l2norm_in_kernel=True)
    """
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`", DeprecationWarning,
                      stacklevel=2)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    s = checks.check_qkvgb(q, k, v, g, beta)
    s = checks.check_cu_seqlens(s, cu_seqlens, kwargs.get("cu_seqlens_cpu"), q.device)
    checks.check_state("initial_state", initial_state, s, state_v_first, q.device)
    checks.check_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    A_log, dt_bias = checks.check_gate_params(s, use_gate_in_kernel, A_log, dt_bias, lower_bound, False, q.device)
    scale = checks.default_scale(scale, s.K)
    return fused_recurrent_kda_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), A_log, dt_bias, scale,
        None if initial_state is None else initial_state.contiguous(), output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
        state_v_first, cu_seqlens, s.N,
    )
