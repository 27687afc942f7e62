"""Differentiable ``chunk_kda``: the training path behind ``flashkda.chunk_kda`` when gradients are needed.

Layers, outermost first:

1. `chunk_kda_autograd` (called by the public ``flashkda.chunk_kda`` after validation) applies the optional
   in-kernel pieces as differentiable elementwise ops (L2 norm of q/k, the KDA gate from raw ``g``, ``A_log``,
   ``dt_bias``, the beta sigmoid), expands q/k for GVA, and moves everything to the chunked layout
   ``[NC, HV, C, D]`` (`flashkda.chunk_bwd_layout`). torch autograd chains their gradients (into ``A_log``,
   ``dt_bias``, raw ``g``, beta logits, and the GVA group sum).
2. `ChunkKDAFunction` is the core recurrence on that layout; its forward and backward are
   `flashkda.chunk_bwd.chunk_kda_train_fwd` / `chunk_kda_train_bwd` (Triton state passes + batched chunk-local
   products).

Gradients flow to ``q, k, v, g, beta, A_log, dt_bias, initial_state``, including through the final state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashkda.chunk_bwd import chunk_kda_train_bwd, chunk_kda_train_fwd
from flashkda.chunk_bwd_layout import from_chunks, make_layout, to_chunks

__all__ = ["ChunkKDAFunction", "chunk_kda_autograd", "kda_gate_torch"]

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


class ChunkKDAFunction(torch.autograd.Function):
    """KDA recurrence on the chunked layout; see `flashkda.chunk_bwd` for the math and the stages."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None,
        chunk_offsets: torch.Tensor,
        scale: float,
        output_final_state: bool,
        disable_recompute: bool,
        dot_precision: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        o, ht, h, v_new = chunk_kda_train_fwd(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            chunk_offsets=chunk_offsets,
            output_final_state=output_final_state,
            keep_states=disable_recompute,
            dot_precision=dot_precision,
        )
        ctx.save_for_backward(q, k, v, g, beta, initial_state, chunk_offsets, h, v_new)
        ctx.scale = scale
        ctx.dot_precision = dot_precision
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do: torch.Tensor | None, dht: torch.Tensor | None):
        q, k, v, g, beta, initial_state, chunk_offsets, h, v_new = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_train_bwd(
            q,
            k,
            v,
            g,
            beta,
            scale=ctx.scale,
            initial_state=initial_state,
            chunk_offsets=chunk_offsets,
            do=do.contiguous(),
            dht=None if dht is None else dht.contiguous(),
            h=h,
            v_new=v_new,
            dot_precision=ctx.dot_precision,
        )
        grads = {"q": dq, "k": dk, "v": dv, "g": dg, "beta": dbeta, "initial_state": dh0}
        names = ("q", "k", "v", "g", "beta", "initial_state", "chunk_offsets", "scale", "output_final_state",
                 "disable_recompute", "dot_precision")
        return tuple(grads.get(name) for name in names)


def kda_gate_torch(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None
) -> torch.Tensor:
    """The in-kernel KDA gate as differentiable fp32 torch ops (fla's ``fused_kda_gate`` semantics).

    Args:
        g: ``[B, T, HV, K]`` raw gate input.
        A_log: ``[HV]`` or None (only with ``lower_bound``).
        dt_bias: ``[HV * K]`` or None.
        lower_bound: None for ``-exp(A_log) * softplus(g + dt_bias)``; else
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (without ``exp(A_log)`` when ``A_log`` is None).

    Returns:
        ``[B, T, HV, K]`` float32 log-space decay.
    """
    HV, K = g.shape[-2:]
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(HV, K)
    if lower_bound is None:
        return -A_log.to(dtype).reshape(HV, 1).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.to(dtype).reshape(HV, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def chunk_kda_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    disable_recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable chunked KDA with fla ``chunk_kda`` semantics (inputs already validated by the caller).

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; ``HV`` a multiple of ``H`` (GVA).
        g: ``[B, T, HV, K]`` log-space gate, or the raw gate input with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` write strengths, or logits with ``use_beta_sigmoid_in_kernel``.
        scale: query scale (the caller fills ``K ** -0.5``).
        initial_state: ``[N, HV, K, V]`` float32 (``[N, HV, V, K]`` with ``state_v_first``), or None.
        output_final_state: return the final state in the same layout.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        use_gate_in_kernel: compute the gate from raw ``g``, ``A_log``, ``dt_bias`` (see `kda_gate_torch`).
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)`` (times 2 with ``allow_neg_eigval``).
        allow_neg_eigval: see above.
        safe_gate: accepted for fla compatibility; it changes speed in fla, not the math.
        lower_bound: bounded gate floor, e.g. -5.0 (with ``use_gate_in_kernel``).
        state_v_first: states are ``[..., V, K]``.
        cu_seqlens: ``[N + 1]`` cumulative lengths for varlen (``B == 1``).
        A_log: ``[HV]`` gate rate, with ``use_gate_in_kernel``.
        dt_bias: ``[HV * K]`` gate bias, with ``use_gate_in_kernel``.
        disable_recompute: keep the per-chunk states from the forward (more memory, no recompute in backward).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in ``q``'s dtype; ``final_state`` float32 or None.
    """
    del safe_gate
    out_dtype = q.dtype
    B, T, H, K = q.shape
    HV = v.shape[2]
    cdt = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    # bf16/fp16 callers accept tf32 products; fp32/fp64 callers get IEEE products.
    dot_precision = "tf32" if q.dtype in (torch.bfloat16, torch.float16) and q.is_cuda else "ieee"
    q, k = q.to(cdt), k.to(cdt)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    g = kda_gate_torch(g, A_log, dt_bias, lower_bound).to(cdt) if use_gate_in_kernel else g.to(cdt)
    beta = beta.to(cdt)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    layout = make_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device)
    qc, kc, vc, gc = (to_chunks(x, layout) for x in (q, k, v.to(cdt), g))
    bc = to_chunks(beta.unsqueeze(-1), layout).squeeze(-1)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
        h0 = h0.to(cdt).contiguous()
    oc, ht = ChunkKDAFunction.apply(
        qc, kc, vc, gc, bc, h0, layout.chunk_offsets, scale, output_final_state, disable_recompute, dot_precision
    )
    o = from_chunks(oc, layout).to(out_dtype)
    if ht is not None:
        ht = ht.float() if cdt == torch.float32 else ht
        if state_v_first:
            ht = ht.transpose(-1, -2)
    return o, ht
