"""Backward of chunked KDA: chains the backward stages, no kernel here.

The stages work on the chunked layout of `flashkda.bwd.layout` (``[NC, HV, C, D]``: chunk, value head, position in
chunk, feature). `chunk_kda_bwd` is the path of every bf16/fp16/fp32 call, one head slice after the other
(`backward_head_slices`):

1. for bf16 input, the state passes once over all value heads on token-layout operands (`flashkda.bwd.recompute`
   rebuilds them from the raw inputs and the forward's saved inverse, or the forward kept them with
   ``disable_recompute``): `flashkda.fwd.state.state_pass`, then `flashkda.bwd.state_tokens`;
2. per head slice: the Triton prologue (`flashkda.bwd.prologue`) writes the chunked inputs and gate factors, the
   state passes run on them unless step 1 did (`flashkda.bwd.state`), the chain rule runs through the UT transform
   (`flashkda.bwd.wy`) and the gated products (`flashkda.bwd.gated_dots`, or `flashkda.bwd.local` for fp32 callers),
   and the prologue's backward maps the chunked gradients to the raw inputs.

`chunk_kda_bwd_torch` runs the chain rule as torch ops (`flashkda.bwd.local.chunk_local_bwd`): fp64 inputs (tests) and
a backward with ``create_graph``. `chunk_kda_fwd_fp64` is the forward of fp64 inputs, which the forward kernels do
not take.
"""

from __future__ import annotations

import torch

from flashkda.bwd.gated_dots import chunk_kda_gated_dots_gates_bwd, fused_gates
from flashkda.bwd.layout import ChunkLayout, from_chunks, to_chunks
from flashkda.bwd.local import chunk_local_bwd, chunk_local_prepare, gated_dots_and_gates_bwd
from flashkda.bwd.prologue import (
    RawGrads,
    chunk_kda_prologue_bwd,
    chunk_kda_prologue_fwd,
    chunk_kda_prologue_torch,
    slot_tokens,
)
from flashkda.bwd.recompute import chunk_kda_recompute_operands
from flashkda.bwd.saved import SavedLocal, head_slice_to_chunks, saved_inverse_fp32, widen_head_slice
from flashkda.bwd.state import chunk_kda_bwd_dh, chunk_kda_recompute_h
from flashkda.bwd.state_tokens import chunk_kda_bwd_dh_tokens
from flashkda.bwd.wy import chunk_kda_bwd_ut
from flashkda.fwd.state import state_pass
from flashkda.index import cached_chunk_index
from flashkda.options import KDAOptions

__all__ = ["backward_head_slices", "chunk_kda_bwd", "chunk_kda_bwd_torch", "chunk_kda_fwd_fp64"]

CHUNK_SIZE = 64
# fp32 [NC, HV, C, K] / [NC, HV, C, V] tensors alive at the backward's peak: q, k, G, qg, kg, kend / v, v_new,
# dv_new, do; plus h and dhe ([K, V] per chunk) and ~6 [C, max(K, V)] chain-rule temporaries (see backward_head_slices)
_BWD_CK_TENSORS, _BWD_CV_TENSORS = 6, 4
#: Bytes of chunked intermediates a head slice may keep alive.
BWD_SLICE_BYTES = 3 * 2**30
#: Fewest (sequence, head) pairs a slice's state passes should have.
BWD_MIN_STATE_PROGRAMS = 16


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (tests), fp32 otherwise: the dtype of the chunked intermediates."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def default_dot_precision(q: torch.Tensor) -> str:
    """``"tf32"`` for bf16/fp16 inputs on a GPU (their products accept tensor-core rounding), else ``"ieee"``."""
    return "tf32" if q.dtype in (torch.bfloat16, torch.float16) and q.is_cuda else "ieee"


def state_in(initial_state: torch.Tensor | None, opts: KDAOptions, cdt: torch.dtype) -> torch.Tensor | None:
    """The initial state as ``[N, HV, K, V]`` in ``cdt`` (transposed from V-first), contiguous; None stays None."""
    if initial_state is None:
        return None
    h0 = initial_state.transpose(-1, -2) if opts.state_v_first else initial_state
    return h0.to(cdt).contiguous()


def backward_head_slices(N: int, NC: int, HV: int, G: int, C: int, K: int, V: int,
                         count: int | None = None) -> list[tuple[int, int]]:
    """Value-head ranges the backward runs one after the other (whole GVA groups of ``G`` heads).

    Every chunked intermediate of the backward is per (chunk, head), so a slice of ``HV / n`` heads keeps ``1 / n``
    of them alive. The slices halve while the intermediates exceed `BWD_SLICE_BYTES` and each slice still gives the
    state passes (one program per sequence, head and V block, each walking its whole sequence) at least
    `BWD_MIN_STATE_PROGRAMS` (sequence, head) pairs: below that they leave SMs idle and run ``n`` times as long.
    (The constants and their measurements: docs/flashkda-performance.md.)

    Args:
        N: sequences; NC: chunks of ``C`` tokens over all sequences; HV: value heads; G: value heads per q/k head;
            K, V: head dims.
        count: a fixed number of slices (a divisor of ``HV / G``; tests and benchmarks), or None for the rule above.

    Returns:
        ``[(hv0, hv1), ...]`` covering ``0 .. HV``, equal widths.

    Raises:
        ValueError: ``count`` does not divide the number of GVA groups.
    """
    groups = HV // G
    if count is not None:
        if count < 1 or groups % count:
            raise ValueError(f"head_slices must divide the {groups} GVA groups, got {count}")
        n = count
    else:
        per_head = NC * 4 * C * (_BWD_CK_TENSORS * K + _BWD_CV_TENSORS * V + 2 * K * V // C + 6 * max(K, V))
        n = 1
        while (groups % (2 * n) == 0 and per_head * HV > n * BWD_SLICE_BYTES
               and N * HV >= 2 * n * BWD_MIN_STATE_PROGRAMS):
            n *= 2
    width = HV // n
    return [(hv, hv + width) for hv in range(0, HV, width)]


def chunk_kda_fwd_fp64(q, k, v, g, beta, A_log, dt_bias, initial_state, opts: KDAOptions, layout: ChunkLayout):
    """Forward of fp64 inputs (which the forward kernels do not take): the torch prologue and chunk-local solve of
    `flashkda.bwd.local`, the state pass of `flashkda.bwd.state`, then ``o = qg h + Aqk v_new`` per chunk.

    Returns:
        ``(o [B, T, HV, V], final_state [N, HV, K, V] (V-first with ``state_v_first``) or None)``, fp64.
    """
    chunks = chunk_kda_prologue_torch(q, k, v, g, beta, A_log, dt_bias, opts, layout)
    local = chunk_local_prepare(*chunks, opts.scale)
    ht, h, v_new = chunk_kda_recompute_h(
        local.w, local.u, local.kend, local.dec, state_in(initial_state, opts, q.dtype),
        layout.chunk_offsets, store_h=True, store_final_state=opts.output_final_state, dot_precision="ieee",
    )
    o = from_chunks(local.qg @ h + local.aqk @ v_new, layout)
    if ht is not None and opts.state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht


def chunk_kda_bwd(ctx, inputs: dict, opts: KDAOptions, layout: ChunkLayout, h0, do, dht, local: tuple,
                  states: tuple) -> tuple[dict, torch.Tensor | None]:
    """Backward of a bf16/fp16/fp32 call (Triton prologue, state passes, chain rule, prologue backward), head slice
    by head slice.

    Args:
        ctx: the autograd context: ``head_slices``, ``cu_seqlens``, ``needs_input_grad`` and ``operands``, the
            forward's ``(w, qg, kg, gC)`` with ``disable_recompute`` for bf16 (emptied once read: a second backward
            through a retained graph rebuilds them), else empty.
        inputs: the raw inputs by name (``q k v g beta A_log dt_bias``).
        opts: the call's options. layout: its chunked layout.
        h0: ``[N, HV, K, V]`` fp32 initial state or None. do: ``[B, T, HV, V]`` gradient of ``o`` or None.
        dht: ``[N, HV, K, V]`` fp32 gradient of the final state or None.
        local: ``(Aqk, Akk, Minv)`` ``[slices, NC, HS, 64, 64]`` saved by the forward kernels for ``ctx.head_slices``.
        states: the forward's ``(h [NC, HV, K, V], v_new [B, T, HV, V])`` with ``disable_recompute``, or empty.

    Returns:
        ``(grads by input name, dh0 [N, HV, K, V] or None)``.
    """
    q, k, v, g, beta = (inputs[n].contiguous() for n in ("q", "k", "v", "g", "beta"))
    A_log, dt_bias = inputs["A_log"], inputs["dt_bias"]
    cdt, dot_precision = compute_dtype(q), opts.dot_precision
    HV, K = v.shape[2], q.shape[3]
    tok = slot_tokens(layout, q.device)
    raw = (q, k, v, g, beta)
    out = None  # the raw-input gradients, allocated after the first slice's chain rule (not at its peak)
    dh0 = None if h0 is None else torch.empty_like(h0)
    # with create_graph the chain rule takes the torch path (recorded ops)
    fused = not torch.is_grad_enabled()
    dv_new_all = dhe_all = None
    all_heads = fused and do is not None
    kept = all_heads and bool(ctx.operands)
    rebuilt = all_heads and not kept and q.dtype == torch.bfloat16
    if kept or rebuilt:
        index = cached_chunk_index(layout.B, layout.T, ctx.cu_seqlens, CHUNK_SIZE)
        if kept:
            w_t, qg_t, kg_t, gC = ctx.operands
        else:
            # the operands and (unless kept) the states of all heads rebuilt here, then both passes once
            w_t, u_t, qg_t, kg_t, gC = chunk_kda_recompute_operands(*raw, A_log, dt_bias, opts, layout, tok,
                                                                    local[2])
            if not states:
                states = state_pass(w_t, u_t, kg_t, gC, h0, None, False, index, "tf32")
            del u_t
        ctx.operands = []
        dv_new_all, dhe_all, dh0 = chunk_kda_bwd_dh_tokens(qg_t, kg_t, w_t, gC, local[0], do.contiguous(), dht,
                                                           index, store_dh0=h0 is not None)
        del w_t, qg_t, kg_t, gC
    # with both state passes done (or kept) for all heads, only the unfused gate chain would read qg, kend, dec
    factors = not (dv_new_all is not None and states and fused_gates(dot_precision, K))
    for hv0, hv1 in ctx.head_slices:
        def part(x: torch.Tensor | None, hv0: int = hv0, hv1: int = hv1) -> torch.Tensor | None:
            return x if x is None or (hv0, hv1) == (0, HV) else x[:, hv0:hv1].contiguous()

        def block(x: torch.Tensor, hv0: int = hv0, hv1: int = hv1) -> torch.Tensor:
            # this slice's [NC, HS, ...] block of a tensor laid out slice by slice, [slices, NC', HS, ...] (varlen:
            # the forward's chunk count NC' is an upper bound); contiguous, no copy
            return x[hv0 // (hv1 - hv0), : layout.num_chunks]

        chunks, gate_factors = chunk_kda_prologue_fwd(*raw, A_log, dt_bias, opts, layout, tok, heads=(hv0, hv1),
                                                      store_factors=factors)
        doc = head_slice_to_chunks(do, layout, tok, hv0, hv1, cdt) if do is not None else torch.zeros_like(chunks[2])
        common = dict(scale=opts.scale, initial_state=part(h0), chunk_offsets=layout.chunk_offsets, dht=part(dht),
                      dot_precision=dot_precision)
        if fused:
            saved = SavedLocal(*(block(x) for x in local))
            h_s = v_new_s = dv_new_s = dhe_s = None
            if states:
                h_s = widen_head_slice(states[0], hv0, hv1, layout.num_chunks)
                v_new_s = head_slice_to_chunks(states[1], layout, tok, hv0, hv1, cdt)
            if dv_new_all is not None:
                dv_new_s = head_slice_to_chunks(dv_new_all, layout, tok, hv0, hv1, cdt)
                dhe_s = block(dhe_all)  # fp32 already: a view of the slice's block
                if hv1 == HV:
                    if hv0 > 0:
                        # the last of several slices copies its block, so that the blocks the earlier slices read
                        # are freed now rather than at the end (a view keeps the whole buffer alive)
                        dhe_s = dhe_s.clone()
                    dv_new_all = dhe_all = None
            q_c, k_c, v_c, _, beta_c = chunks
            # the slice's pass owns its tensors (and frees each once read for the last time): keep no reference here
            work = [q_c, k_c, v_c, beta_c, doc, *gate_factors, h_s, v_new_s, dv_new_s, dhe_s]
            del chunks, gate_factors, doc, q_c, k_c, v_c, beta_c, h_s, v_new_s, dv_new_s, dhe_s
            *dchunks, dh0_s = _chunk_bwd_slice(work, **common, saved_local=saved)
            del saved
        else:
            *dchunks, dh0_s = chunk_kda_bwd_chunked(*chunks, **common, do=doc, gate_factors=gate_factors)
            del chunks, gate_factors, doc
        out = out or RawGrads.empty_like_inputs(*raw, layout.num_chunks)
        chunk_kda_prologue_bwd(*raw, A_log, dt_bias, opts, layout, tok, *dchunks, out=out, heads=(hv0, hv1))
        del dchunks
        if dh0_s is not None:
            dh0[:, hv0:hv1] = dh0_s
    all_grads = out.finish(A_log, dt_bias, opts)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    return {n: gx for n, gx in zip(names, all_grads) if _needs(ctx, n) and gx is not None}, dh0


def chunk_kda_bwd_torch(ctx, inputs: dict, opts: KDAOptions, layout: ChunkLayout, h0, do,
                        dht) -> tuple[dict, torch.Tensor | None]:
    """Backward of fp64 inputs: the prologue rebuilt as recorded torch ops, pulled back with one
    ``autograd.grad`` call; arguments as `chunk_kda_bwd` (``h0``, ``dht`` fp64).

    Returns:
        ``(grads by input name, dh0 [N, HV, K, V] or None)``.
    """
    cdt = compute_dtype(inputs["q"])
    leaves = {n: x.detach().requires_grad_() for n, x in inputs.items() if x is not None and _needs(ctx, n)}
    args = {n: leaves.get(n, x) for n, x in inputs.items()}
    with torch.enable_grad():
        chunks = chunk_kda_prologue_torch(*args.values(), opts, layout)
    doc = to_chunks(do, layout, cdt) if do is not None else torch.zeros_like(chunks[2])
    *dchunks, dh0 = chunk_kda_bwd_chunked(
        *(c.detach() for c in chunks), scale=opts.scale, initial_state=h0, chunk_offsets=layout.chunk_offsets,
        do=doc, dht=dht, dot_precision=opts.dot_precision,
    )
    pairs = [(c, dc) for c, dc in zip(chunks, dchunks) if c.requires_grad]
    leaf_grads = ()
    if leaves and pairs:
        outs, cots = zip(*pairs)
        leaf_grads = torch.autograd.grad(outs, tuple(leaves.values()), cots, allow_unused=True)
    grads = dict(zip(leaves, leaf_grads))
    grads = {n: (torch.zeros_like(leaves[n]) if gx is None else gx.to(leaves[n].dtype)) for n, gx in grads.items()}
    return grads, dh0


_INPUT_INDEX = {"q": 0, "k": 1, "v": 2, "g": 3, "beta": 4, "A_log": 5, "dt_bias": 6}


def _needs(ctx, name: str) -> bool:
    return bool(ctx.needs_input_grad[_INPUT_INDEX[name]])


def chunk_kda_bwd_chunked(
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
    dot_precision: str,
    gate_factors: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward of the chunked KDA core with the chain rule as torch ops (`chunk_local_bwd`).

    Args:
        q, k, g: ``[NC, HV, C, K]``; v: ``[NC, HV, C, V]``; beta: ``[NC, HV, C]`` (one float dtype); ``g`` is not
            read (may be None) when ``gate_factors`` are given.
        scale: query scale. initial_state: ``[N, HV, K, V]`` or None.
        chunk_offsets: ``[N + 1]`` int32 chunk range of every sequence.
        do: ``[NC, HV, C, V]`` gradient of ``o``. dht: ``[N, HV, K, V]`` gradient of the final state, or None.
        dot_precision: Triton ``tl.dot`` input precision of the state passes.
        gate_factors: ``(G, qg, kg, kend, dec)`` if the caller already has them (see `chunk_local_prepare`).

    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0)`` in the chunked layout; ``dh0`` is None without ``initial_state``.
    """
    local = chunk_local_prepare(q, k, v, g, beta, scale, gate_factors)
    _, h, v_new = chunk_kda_recompute_h(
        local.w, local.u, local.kend, local.dec, initial_state, chunk_offsets,
        store_h=True, store_final_state=False, dot_precision=dot_precision,
    )
    dv_new, dhe, dh0 = chunk_kda_bwd_dh(
        local.qg, local.aqk, local.kend, local.dec, local.w, do, dht, chunk_offsets,
        store_dh0=initial_state is not None, dot_precision=dot_precision,
    )
    grads = chunk_local_bwd(
        q, k, v, g, beta, scale, local, h=h, v_new=v_new, do=do, dhe=dhe, dv_new=dv_new, dot_precision=dot_precision
    )
    return (*grads, dh0)


def _chunk_bwd_slice(
    work: list,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_offsets: torch.Tensor,
    dht: torch.Tensor | None,
    dot_precision: str,
    saved_local: SavedLocal,
) -> tuple[torch.Tensor, ...]:
    """The backward of one head slice (Triton passes, grad mode off), releasing each chunked tensor as soon as
    nothing later reads it: the peak of a slice is then the state passes', not the chain rule's with every earlier
    tensor still alive.

    Args:
        work: ``[q, k, v, beta, do, G, qg, kg, kend, dec, h, v_new, dv_new, dhe]`` in the chunked layout (fp32), as
            the Triton prologue writes them; ``h``, ``v_new`` ``[NC, HS, K, V]`` / ``[NC, HS, C, V]`` kept from the
            forward, or None to recompute them; ``dv_new``, ``dhe`` (same shapes) from a reverse state pass already
            run over all heads (`flashkda.bwd.state_tokens`), or None to run it here. The list is emptied on entry:
            this pass then holds the only references, so the caller must keep none.
        scale, initial_state, chunk_offsets, dht, dot_precision: as in `chunk_kda_bwd_chunked`.
        saved_local: the forward kernels' ``Aqk``, ``Akk`` and inverse of this slice.

    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0)`` in the chunked layout; ``dh0`` is None without ``initial_state`` or when
        ``dv_new`` and ``dhe`` were given (their pass computed it).
    """
    q, k, v, beta, do, gam, qg, kg, kend, dec, h, v_new, dv_new, dhe = work
    work.clear()
    K = k.shape[-1]
    recompute_states = h is None or v_new is None
    akk, aqk = saved_local.akk, saved_local.aqk
    w = None
    if recompute_states or dv_new is None:  # w = M Diag(beta) kg feeds only the two state passes
        minv_b = saved_inverse_fp32(saved_local.minv, beta)
        w = minv_b @ kg
        if recompute_states:
            u = minv_b @ v
            _, h, v_new = chunk_kda_recompute_h(
                w, u, kend, dec, initial_state, chunk_offsets,
                store_h=True, store_final_state=False, dot_precision=dot_precision,
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
    minv = saved_inverse_fp32(saved_local.minv)
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
            q, k, gam, p, daqk, dqg, dkg, dkend, ddec, scale=scale, dot_precision=dot_precision,
            dakk_row_scale=(-beta).contiguous(),
        )
        return dq, dk, dv, dg, dbeta, dh0
    dq, dk, dg = gated_dots_and_gates_bwd(q, k, gam, qg, kend, dec, p, daqk, dqg, dkg, dkend, ddec, beta, scale,
                                          dot_precision)
    return dq, dk, dv, dg, dbeta, dh0
