"""Training forward and backward of the KDA core on the chunked layout: chains the stages, no kernel here.

Forward: chunk-local quantities (`chunk_local_prepare`) -> state pass (`chunk_kda_fwd_h`, which also writes ``o``).
Backward: rebuild the chunk-local quantities -> recompute ``h``, ``v_new`` unless they were kept -> reverse state
pass (`chunk_kda_bwd_dh`) -> explicit chain rule back to ``q, k, v, g, beta`` (`chunk_local_bwd`).
"""

from __future__ import annotations

import dataclasses

import torch

from flashkda.chunk_bwd_h import chunk_kda_bwd_dh, chunk_kda_fwd_h
from flashkda.chunk_bwd_local import SavedLocal, chunk_local_bwd, chunk_local_prepare

__all__ = ["chunk_kda_train_bwd", "chunk_kda_train_fwd"]


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
    saved_local: SavedLocal | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward of the chunked KDA core.

    Args:
        q, k, v, g, beta, scale, initial_state, chunk_offsets: as given to `chunk_kda_train_fwd`.
        do: ``[NC, HV, C, V]`` gradient of ``o``.
        dht: ``[N, HV, K, V]`` gradient of the final state, or None.
        h, v_new: kept by the forward (``keep_states=True``), or None to recompute them.
        dot_precision: Triton ``tl.dot`` input precision.
        gate_factors: ``(G, qg, kg, kend, dec)`` if the caller already has them (see `chunk_local_prepare`).
        saved_local: the forward kernels' ``Aqk``, ``Akk`` and inverse (see `chunk_local_prepare`), or None.

    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0)`` in the chunked layout; ``dh0`` is None without ``initial_state``.
    """
    local = chunk_local_prepare(q, k, v, g, beta, scale, gate_factors, dot_precision, saved_local)
    if h is None or v_new is None:
        _, _, h, v_new = chunk_kda_fwd_h(
            local.w, local.u, local.qg, local.aqk, local.kend, local.dec, initial_state, chunk_offsets,
            store_o=False, store_h=True, store_final_state=False, dot_precision=dot_precision,
        )
    dv_new, dhe, dh0 = chunk_kda_bwd_dh(
        local.qg, local.aqk, local.kend, local.dec, local.w, do, dht, chunk_offsets,
        store_dh0=initial_state is not None, dot_precision=dot_precision,
    )
    if local.explicit_inverse:
        # The fused chain rule reads neither w, u nor Aqk: release them (0.7 GB at B1-T8192-H64) before it allocates.
        local = dataclasses.replace(local, w=None, u=None, aqk=None)
    grads = chunk_local_bwd(
        q, k, v, g, beta, scale, local, h=h, v_new=v_new, do=do, dhe=dhe, dv_new=dv_new, dot_precision=dot_precision
    )
    return (*grads, dh0)
