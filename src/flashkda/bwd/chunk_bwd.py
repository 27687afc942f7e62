"""Training forward and backward of the KDA core on the chunked layout: chains the stages, no kernel here.

Forward: chunk-local quantities (`chunk_local_prepare`) -> state pass (`chunk_kda_fwd_h`, which also writes ``o``).
Backward: rebuild the chunk-local quantities -> recompute ``h``, ``v_new`` unless they were kept -> reverse state
pass (`chunk_kda_bwd_dh`) -> explicit chain rule back to ``q, k, v, g, beta``: `chunk_kda_slice_bwd` with the
Triton passes (a head slice, grad mode off), `chunk_kda_train_bwd` with torch ops (`chunk_local_bwd`; fp64, a K that
is not a power of two, or ``create_graph``).
"""

from __future__ import annotations

import torch

from flashkda.bwd.gated_dots import chunk_kda_gated_dots, chunk_kda_gated_dots_gates_bwd, fused_gates
from flashkda.bwd.inverse import ut_inverse
from flashkda.bwd.local import (
    chunk_local_bwd,
    chunk_local_prepare,
    gated_dot_precision,
    gated_dots_and_gates_bwd,
)
from flashkda.bwd.saved import SavedLocal, saved_inverse_fp32
from flashkda.bwd.state import chunk_kda_bwd_dh, chunk_kda_fwd_h
from flashkda.bwd.wy import chunk_kda_bwd_ut, chunk_kda_bwd_wy, fused_wy

__all__ = ["chunk_kda_slice_bwd", "chunk_kda_train_bwd", "chunk_kda_train_fwd"]


def chunk_kda_train_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_offsets: torch.Tensor,
    output_final_state: bool,
    keep_states: bool,
    dot_precision: str,
    gate_factors: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Forward of the chunked KDA core.

    Args:
        q, k, g: ``[NC, HV, C, K]``; v: ``[NC, HV, C, V]``; beta: ``[NC, HV, C]`` (one float dtype); ``g`` is not
            read (may be None) when ``gate_factors`` are given.
        scale: query scale.
        initial_state: ``[N, HV, K, V]`` or None (zeros).
        chunk_offsets: ``[N + 1]`` int32 chunk range of every sequence.
        output_final_state: also return ``[N, HV, K, V]`` final states.
        keep_states: also return ``h`` ``[NC, HV, K, V]`` and ``v_new`` for the backward (no recompute).
        dot_precision: Triton ``tl.dot`` input precision (``"ieee"`` or ``"tf32"``).
        gate_factors: ``(G, qg, kg, kend, dec)`` if the caller already has them (see `chunk_local_prepare`).

    Returns:
        ``(o [NC, HV, C, V], final_state or None, h or None, v_new or None)``.
    """
    local = chunk_local_prepare(q, k, v, g, beta, scale, gate_factors, dot_precision)
    o, ht, h, v_new = chunk_kda_fwd_h(
        local.w,
        local.u,
        local.qg,
        local.aqk,
        local.kend,
        local.dec,
        initial_state,
        chunk_offsets,
        store_o=True,
        store_h=keep_states,
        store_final_state=output_final_state,
        dot_precision=dot_precision,
    )
    return o, ht, h, (v_new if keep_states else None)


def chunk_kda_train_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_offsets: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    h: torch.Tensor | None,
    v_new: torch.Tensor | None,
    dot_precision: str,
    gate_factors: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward of the chunked KDA core through torch ops (`chunk_local_bwd`; the Triton passes: `chunk_kda_slice_bwd`).

    Args:
        q, k, v, g, beta, scale, initial_state, chunk_offsets: as given to `chunk_kda_train_fwd`.
        do: ``[NC, HV, C, V]`` gradient of ``o``.
        dht: ``[N, HV, K, V]`` gradient of the final state, or None.
        h, v_new: kept by the forward (``keep_states=True``), or None to recompute them.
        dot_precision: Triton ``tl.dot`` input precision.
        gate_factors: ``(G, qg, kg, kend, dec)`` if the caller already has them (see `chunk_local_prepare`).

    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0)`` in the chunked layout; ``dh0`` is None without ``initial_state``.
    """
    local = chunk_local_prepare(q, k, v, g, beta, scale, gate_factors, dot_precision)
    if h is None or v_new is None:
        _, _, h, v_new = chunk_kda_fwd_h(
            local.w, local.u, local.qg, local.aqk, local.kend, local.dec, initial_state, chunk_offsets,
            store_o=False, store_h=True, store_final_state=False, dot_precision=dot_precision,
        )
    dv_new, dhe, dh0 = chunk_kda_bwd_dh(
        local.qg, local.aqk, local.kend, local.dec, local.w, do, dht, chunk_offsets,
        store_dh0=initial_state is not None, dot_precision=dot_precision,
    )
    grads = chunk_local_bwd(
        q, k, v, g, beta, scale, local, h=h, v_new=v_new, do=do, dhe=dhe, dv_new=dv_new, dot_precision=dot_precision
    )
    return (*grads, dh0)


def chunk_kda_slice_bwd(
    work: list,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_offsets: torch.Tensor,
    dht: torch.Tensor | None,
    dot_precision: str,
    saved_local: SavedLocal | None = None,
) -> tuple[torch.Tensor, ...]:
    """The fused backward of one head slice (Triton passes, grad mode off), releasing each chunked tensor as soon as
    nothing later reads it: the peak of a slice is then the state passes', not the chain rule's with every earlier
    tensor still alive.

    Args:
        work: ``[q, k, v, beta, do, G, qg, kg, kend, dec, h, v_new, dv_new, dhe]`` in the chunked layout (fp32;
            ``do`` fp32 or its own half dtype when the fused UT pass runs), as the Triton prologue writes them;
            ``h``, ``v_new`` fp32 ``[NC, HS, K, V]`` / ``[NC, HS, C, V]`` kept from the forward, or None to recompute
            them; ``dv_new``, ``dhe`` (same shapes) from a reverse state pass already run over all heads
            (``flashkda.bwd.state_tokens``), or None to run it here. The list is emptied on entry: this pass then
            holds the only references, so the caller must keep none.
        scale, initial_state, chunk_offsets, dht, dot_precision: as in `chunk_kda_train_bwd`.
        saved_local: the forward kernels' ``Aqk``, ``Akk`` and inverse (`SavedLocal`), or None to recompute them.

    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0)`` in the chunked layout; ``dh0`` is None without ``initial_state`` or when
        ``dv_new`` and ``dhe`` were given (their pass computed it).
    """
    q, k, v, beta, do, gam, qg, kg, kend, dec, h, v_new, dv_new, dhe = work
    work.clear()
    K, V = k.shape[-1], v.shape[-1]
    recompute_states = h is None or v_new is None
    need_w = recompute_states or dv_new is None  # w = M Diag(beta) kg feeds only the two state passes
    minv = minv_b = w = None
    if saved_local is not None:
        akk, aqk = saved_local.akk, saved_local.aqk
        if need_w:
            minv_b = saved_inverse_fp32(saved_local.minv, beta)
    else:
        akk, aqk = chunk_kda_gated_dots(q, k, gam, scale, dot_precision=gated_dot_precision(dot_precision))
        minv, minv_b = ut_inverse(akk, beta.contiguous())
    if need_w:
        w = minv_b @ kg
    if recompute_states:
        u = minv_b @ v
        _, _, h, v_new = chunk_kda_fwd_h(
            w, u, qg, aqk, kend, dec, initial_state, chunk_offsets,
            store_o=False, store_h=True, store_final_state=False, dot_precision=dot_precision,
        )
        del u
    del minv_b
    dh0 = None
    if dv_new is None:
        dv_new, dhe, dh0 = chunk_kda_bwd_dh(
            qg, aqk, kend, dec, w, do, dht, chunk_offsets, store_dh0=initial_state is not None,
            dot_precision=dot_precision,
        )
    del w, aqk
    gates = fused_gates(dot_precision, K)
    if gates:
        del qg, kend, dec  # the fused gate chain rebuilds them from q, k and G
    if minv is None:
        minv = saved_inverse_fp32(saved_local.minv)
    if fused_wy(dot_precision, K, V):
        # one Triton pass: y_u, y_wn, P and the gate-chain products stay on chip (flashkda.bwd.wy)
        dv, dkg, dbeta, ddec, p, daqk, dqg, dkend = chunk_kda_bwd_wy(
            minv, dv_new, h, v_new, do, dhe, kg, v, akk, beta, dot_precision=dot_precision
        )
        del minv, dv_new, h, v_new, do, dhe, kg, v, akk
    else:
        # y_u = M^T dv_new; y_wn = -M^T dw and P = -dl (before the strict-lower mask): see flashkda.bwd.wy
        dqg = do @ h.transpose(-1, -2)
        dkend = v_new @ dhe.transpose(-1, -2)
        y_u = minv.transpose(-1, -2) @ dv_new
        del minv, dv_new
        y_wn = y_u @ h.transpose(-1, -2)
        p = y_u @ v_new.transpose(-1, -2)
        dv, dkg, dbeta, ddec = chunk_kda_bwd_ut(y_u, y_wn, p, kg, v, akk, beta, h, dhe)
        del y_u, y_wn, h, dhe, kg, v, akk
        daqk = do @ v_new.transpose(-1, -2)
        del do, v_new
    if gates:
        # gated-product backward and gate chain in one pass (dq, dk, dG stay on chip)
        dq, dk, dg = chunk_kda_gated_dots_gates_bwd(
            q, k, gam, p, daqk, dqg, dkg, dkend, ddec, scale=scale,
            dot_precision=gated_dot_precision(dot_precision), dakk_row_scale=(-beta).contiguous(),
        )
        return dq, dk, dv, dg, dbeta, dh0
    dq, dk, dg = gated_dots_and_gates_bwd(q, k, gam, qg, kend, dec, p, daqk, dqg, dkg, dkend, ddec, beta, scale,
                                          dot_precision)
    return dq, dk, dv, dg, dbeta, dh0
