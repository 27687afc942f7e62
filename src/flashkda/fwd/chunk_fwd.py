"""Forward orchestration of chunked KDA: chains the intra-chunk stage and the fused state/output stage.

No kernels live here; inputs are assumed validated (see ``flashkda.checks``) and contiguous.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashkda.fwd.intra import CHUNK_SIZE, chunk_kda_fwd_intra
from flashkda.fwd.state import chunk_kda_fwd_state_o
from flashkda.index import cached_chunk_index


class TrainingSaved(NamedTuple):
    """What the training forward keeps from the forward kernels for the backward (see `chunk_kda_fwd`)."""

    local: tuple
    """``(Aqk, Akk, Minv)`` in the backward's chunked layout, or empty."""
    states: tuple
    """``(h, v_new)`` of the split state path as stored, or empty."""
    operands: tuple = ()
    """``(w, qg, kg, gC)`` of the intra stage as stored (the reverse state pass's operands), or empty."""


def work_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the intermediates (w, u, qg, kg, Aqk): bf16 for bf16 input, fp32 otherwise (fp16 could overflow)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def dot_precision_for(dtype: torch.dtype) -> str:
    """fp32 input needs exact fp32 products (RMS error 1e-5); half input is fine with tf32 tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
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
    output_h: bool = False,
    block_v: int | None = None,
    out: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
    output_local: bool = False,
    local_heads: int | None = None,
    output_states: bool = False,
    output_operands: bool = False,
    fp32_u: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple:
    """Chunked KDA forward on validated, contiguous inputs (the stable internal entry for the backward pass).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]`` (raw or
            activated as the flags say); scale: query scale (already defaulted).
        initial_state: ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` if ``state_v_first``) or None.
        output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, A_log, dt_bias: as in
            ``flashkda.chunk_kda``.
        output_h: also return the state at the start of every chunk.
        block_v: V tile of the state stage (default: picked from the number of programs).
        out: optional preallocated ``[B, T, HV, V]`` output.
        final_state: optional preallocated final-state buffer (implies ``output_final_state``).
        output_local: also return ``(Aqk, Akk, Minv)``, the chunk-local matrices the training backward would
            otherwise recompute, in its chunked layout (see ``chunk_kda_fwd_intra``'s ``store_local``), in head
            slices of ``local_heads`` value heads (None: one slice).
        output_states: also return the split state path's ``(h, v_new)`` as stored (bf16 for bf16 input), empty
            when the fused path ran (it keeps no per-chunk states).
        output_operands: also return the intra stage's ``(w, qg, kg, gC)`` as stored (``[B, T, HV, K]`` each, bf16
            for bf16 input, and ``gC`` ``[NC, HV, K]`` fp32), for ``flashkda.bwd.state_tokens``.
        fp32_u: ``u`` and the state stage's ``v_new`` in fp32 (see ``chunk_kda_fwd_intra``).
        cu_seqlens_cpu: the CPU copy of ``cu_seqlens``, if the caller has one: it keys the cached chunk index of an
            inference-mode ``cu_seqlens`` (`flashkda.index.cached_chunk_index`).

    Returns:
        ``(o, final_state, h)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` fp32 in the requested
        layout or None; ``h`` ``[NC, HV, K, V]`` fp32 states at chunk starts (``NC`` = global chunk count, for
        varlen an upper bound whose surplus rows are unwritten) or None. With ``output_local`` or ``output_states``
        a fourth item, `TrainingSaved` (also with ``output_operands``): ``local`` = ``(Aqk, Akk, Minv)``, each
        ``[HV / local_heads, NC, local_heads, 64, 64]`` (bf16 for bf16 input, else fp32; for varlen ``NC`` is the
        index's upper bound and the surplus chunks are unwritten), ``states`` = ``(h, v_new)`` (``h``
        ``[NC, HV, K, V]``, ``v_new`` ``[B, T, HV, V]``), ``operands`` as above; each empty unless asked for.
    """
    B, T = q.shape[:2]
    index = cached_chunk_index(B, T, cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu)
    work_dtype = work_dtype_for(q.dtype)
    dot_prec = dot_precision_for(q.dtype)
    w, u, qg, kg, Aqk, gC, *local = chunk_kda_fwd_intra(
        q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, index, work_dtype, dot_prec, store_local=output_local,
        local_heads=local_heads, fp32_u=fp32_u,
    )
    states = [] if output_states else None
    result = chunk_kda_fwd_state_o(
        w, u, qg, kg, Aqk, gC, initial_state, output_final_state, state_v_first, index, q.dtype, dot_prec,
        output_h=output_h, block_v=block_v, out=out, final_state=final_state, states_out=states,
    )
    if not (output_local or output_states or output_operands):
        return result
    operands = (w, qg, kg, gC) if output_operands else ()
    return (*result, TrainingSaved(tuple(local), tuple(states or ()), operands))
