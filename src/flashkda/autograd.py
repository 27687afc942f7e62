"""Differentiable ``chunk_kda``: the training path behind ``flashkda.chunk_kda`` when gradients are needed.

`chunk_kda_autograd` (called by the public ``flashkda.chunk_kda`` after validation) applies `ChunkKDAFunction`:

* forward: the forward kernels (``flashkda.fwd.chunk_fwd.chunk_kda_fwd``: fused gate, L2 norm, beta sigmoid, chunked
  recurrence); saved: the inputs and the intra kernel's ``Aqk``, ``Akk`` and inverse. ``disable_recompute=True``
  trades memory for speed as fla's option does: for bf16 input the forward also keeps its per-chunk states ``h``
  (bf16), ``v_new`` (fp32) and the intra stage's ``w``, ``qg``, ``kg`` (~+900 MiB at B1-T8192-H64), so the backward runs no
  state recompute and one reverse state pass over all heads; other dtypes run the training forward of
  `flashkda.bwd.chunk_bwd` and keep its fp32 states. fp64 inputs (tests) always run the training forward.
* backward: rebuilds the prologue (L2 norm of q/k, the KDA gate from raw ``g``, ``A_log``, ``dt_bias``, the beta
  sigmoid, GVA expansion, the chunked fp32 layout ``[NC, HV, C, D]`` of `flashkda.bwd.layout`) with one
  Triton pass (`flashkda.bwd.prologue`), runs `flashkda.bwd.chunk_bwd.chunk_kda_train_bwd` (Triton state passes
  + chunk-local chain rule), and maps the chunked gradients back to the raw inputs with the prologue's backward
  pass. fp64 inputs (or a K that is not a power of two) rebuild the prologue as recorded torch ops instead and
  pull back with one ``autograd.grad`` call.

Gradients flow to ``q, k, v, g, beta, A_log, dt_bias, initial_state``, including through the final state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashkda.bwd.chunk_bwd import chunk_kda_slice_bwd, chunk_kda_train_bwd, chunk_kda_train_fwd
from flashkda.bwd.gated_dots import fused_gates
from flashkda.bwd.layout import ChunkLayout, from_chunks, make_layout, to_chunks
from flashkda.bwd.prologue import RawGrads, chunk_kda_prologue_bwd, chunk_kda_prologue_fwd, slot_tokens
from flashkda.bwd.recompute import chunk_kda_recompute_operands
from flashkda.bwd.saved import SavedLocal, head_slice_to_chunks, widen_head_slice
from flashkda.bwd.state_tokens import chunk_kda_bwd_dh_tokens
from flashkda.bwd.wy import fused_wy
from flashkda.env import env_flag
from flashkda.fwd.state import state_pass
from flashkda.index import build_chunk_index

__all__ = ["ChunkKDAFunction", "KDAOptions", "chunk_kda_autograd", "kda_gate_torch"]

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class KDAOptions:
    """The non-tensor arguments of one ``chunk_kda`` call."""

    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    safe_gate: bool
    lower_bound: float | None
    state_v_first: bool
    disable_recompute: bool
    forward_impl: str = "kernels"
    cu_seqlens_cpu: torch.Tensor | None = None
    """Host copy of ``cu_seqlens`` (sizes the chunked layout without reading the device)."""


def kda_gate_torch(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None
) -> torch.Tensor:
    """The in-kernel KDA gate as differentiable torch ops (fla's ``fused_kda_gate`` semantics), fp32 (fp64 in).

    Args:
        g: ``[B, T, HV, K]`` raw gate input.
        A_log: ``[HV]`` or None (only with ``lower_bound``).
        dt_bias: ``[HV * K]`` or None.
        lower_bound: None for ``-exp(A_log) * softplus(g + dt_bias)``; else
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (without ``exp(A_log)`` when ``A_log`` is None).

    Returns:
        ``[B, T, HV, K]`` log-space decay, float32 (float64 for float64 ``g``).
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


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _dot_precision(q: torch.Tensor) -> str:
    # bf16/fp16 callers accept tf32 products; fp32/fp64 callers get IEEE products.
    return "tf32" if q.dtype in (torch.bfloat16, torch.float16) and q.is_cuda else "ieee"


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    """Let torch's fp32 matmuls use TF32 tensor cores for the duration (bf16/fp16 callers only), then restore.

    The chunk-local products of a bf16 call are bf16-accurate anyway; IEEE fp32 GEMMs would run on CUDA cores at a
    fraction of the tensor-core rate. The flag is process-wide, so it is set and restored around our own work only.
    """
    matmul = torch.backends.cuda.matmul
    if precision != "tf32":
        yield
        return
    if hasattr(matmul, "fp32_precision"):
        old = matmul.fp32_precision
        matmul.fp32_precision = "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision = old
    else:
        old = matmul.allow_tf32
        matmul.allow_tf32 = True
        try:
            yield
        finally:
            matmul.allow_tf32 = old


def _chunked_inputs(q, k, v, g, beta, A_log, dt_bias, opts: KDAOptions, layout: ChunkLayout):
    """The differentiable prologue: activations and GVA expansion, then the chunked layout ``[NC, HV, C, D]``."""
    cdt = _compute_dtype(q)
    HV = v.shape[2]
    q, k = q.to(cdt), k.to(cdt)
    if opts.use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    g = kda_gate_torch(g, A_log, dt_bias, opts.lower_bound).to(cdt) if opts.use_gate_in_kernel else g.to(cdt)
    beta = beta.to(cdt)
    if opts.use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if opts.allow_neg_eigval else 1.0)
    if HV != q.shape[2]:
        q, k = q.repeat_interleave(HV // q.shape[2], dim=2), k.repeat_interleave(HV // k.shape[2], dim=2)
    qc, kc, vc, gc = (to_chunks(x, layout) for x in (q, k, v.to(cdt), g))
    bc = to_chunks(beta.unsqueeze(-1), layout).squeeze(-1)
    return qc, kc, vc, gc, bc


#: Environment switch: the training forward keeps ``Aqk``, ``Akk`` and the solved inverse (``[slices, NC, HS, 64, 64]``
#: each, bf16 for bf16 input) so the backward skips their recompute; ``0`` recomputes them (64 MiB less peak at
#: B1-T8192-H64, 1.0 ms slower on the H200).
SAVE_LOCAL_ENV = "FLASHKDA_BWD_SAVE_LOCAL"


def save_local_enabled() -> bool:
    """Whether the training forward saves the chunk-local matrices for the backward (read at each forward call)."""
    return env_flag(SAVE_LOCAL_ENV, True)


#: Environment switch, opt-in (``disable_recompute=True`` sets it for bf16): the training forward also keeps the split
#: state path's ``h`` (bf16) and ``v_new`` (fp32: see ``fp32_u``), ``[NC, HV, K, V]`` + ``[B, T, HV, V]``, ~520 MiB at
#: B1-T8192-H64, so the backward skips its state recompute (-0.3 ms there on the H200, 2026-12-02, with ``v_new`` in
#: bf16); ``1`` turns it on.
SAVE_STATES_ENV = "FLASHKDA_BWD_SAVE_STATES"


def save_states_enabled() -> bool:
    """Whether the training forward keeps its per-chunk states for the backward (read at each forward call)."""
    return env_flag(SAVE_STATES_ENV, False)


#: Environment switch, opt-in (``disable_recompute=True`` sets it for bf16): for bf16 input the training forward also
#: keeps the intra stage's ``w``, ``qg``, ``kg`` (``[B, T, HV, K]`` bf16 each, 384 MiB at B1-T8192-H64, freed once
#: read) and the backward runs its reverse state pass once over all heads on them (``flashkda.bwd.state_tokens``)
#: instead of once per head slice on fp32 chunked copies (-0.5 ms there on the H200, 2026-12-02); ``1`` turns it on.
#: Needs the saved chunk-local matrices (``FLASHKDA_BWD_SAVE_LOCAL``).
DH_ALL_HEADS_ENV = "FLASHKDA_BWD_DH_ALL_HEADS"


def dh_all_heads_enabled() -> bool:
    """Whether the backward's reverse state pass runs over all heads at once (read at each forward call)."""
    return env_flag(DH_ALL_HEADS_ENV, False)


#: Environment switch, on by default (``0`` turns it off): without ``disable_recompute`` (bf16), the backward rebuilds
#: the state passes' operands of all heads in bf16 from the raw inputs and the saved inverse
#: (``flashkda.bwd.recompute``, as fla's ``recompute_w_u``), recomputes the states of all heads in one launch and
#: runs the reverse pass once over all heads, instead of both passes once per head slice; nothing more is kept between
#: forward and backward. First timed 2026-12-03 (benchmarks/kda/NOTES.md).
RECOMPUTE_ALL_HEADS_ENV = "FLASHKDA_BWD_RECOMPUTE_ALL_HEADS"


def recompute_all_heads_enabled() -> bool:
    """Whether the default backward runs its state passes over all heads at once (read at each backward call)."""
    return env_flag(RECOMPUTE_ALL_HEADS_ENV, True)


def _fused_prologue(q: torch.Tensor) -> bool:
    # The Triton prologue handles fp32/bf16/fp16 inputs with power-of-two K (the state passes need that too).
    K = q.shape[-1]
    return q.dtype != torch.float64 and K >= 16 and K & (K - 1) == 0


def _state_in(initial_state: torch.Tensor | None, opts: KDAOptions, cdt: torch.dtype) -> torch.Tensor | None:
    if initial_state is None:
        return None
    h0 = initial_state.transpose(-1, -2) if opts.state_v_first else initial_state
    return h0.to(cdt).contiguous()


def _forward_kernels():
    """The forward teammate's fused forward, or None when it is not importable."""
    try:
        from flashkda.fwd.chunk_fwd import chunk_kda_fwd
    except ImportError:
        return None
    return chunk_kda_fwd


class ChunkKDAFunction(torch.autograd.Function):
    """``(q, k, v, g, beta, A_log, dt_bias, initial_state) -> (o, final_state)`` with fla ``chunk_kda`` math."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions):
        # The chunk-local products must stay fp32 (fp64) even under autocast: they feed a triangular solve.
        with torch.autocast(q.device.type, enabled=False), _matmul_precision(_dot_precision(q)):
            return ChunkKDAFunction._forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)

    @staticmethod
    def _forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions):
        B, T = q.shape[:2]
        layout = make_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device, opts.cu_seqlens_cpu)
        fused_fwd = _forward_kernels()
        h = v_new = None
        # disable_recompute for bf16 keeps the forward kernels' own states and operands (below)
        keep_all = opts.disable_recompute and q.dtype == torch.bfloat16
        use_kernels = opts.forward_impl == "kernels" and (keep_all or not opts.disable_recompute)
        local = states = operands = ()
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        # the backward's head slices, fixed here: the saved chunk-local matrices are laid out slice by slice
        ctx.head_slices = backward_head_slices(layout.chunk_offsets.numel() - 1, layout.num_chunks, HV,
                                               HV // q.shape[2], layout.C, K, V)
        if fused_fwd is not None and q.dtype != torch.float64 and use_kernels:
            save_local = _fused_prologue(q) and (keep_all or save_local_enabled())
            save_states = _fused_prologue(q) and (keep_all or save_states_enabled())
            # the all-heads reverse pass reads the forward's bf16 operands and its saved Aqk
            save_operands = (save_local and q.dtype == torch.bfloat16 and K <= 256
                             and (keep_all or dh_all_heads_enabled()))
            result = fused_fwd(
                q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), opts.scale,
                initial_state=None if initial_state is None else initial_state.contiguous(),
                output_final_state=opts.output_final_state, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
                use_gate_in_kernel=opts.use_gate_in_kernel, use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel,
                allow_neg_eigval=opts.allow_neg_eigval, safe_gate=opts.safe_gate, lower_bound=opts.lower_bound,
                state_v_first=opts.state_v_first, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
                output_local=save_local, local_heads=ctx.head_slices[0][1] - ctx.head_slices[0][0],
                # kept states take u (hence v_new) in fp32 for accuracy (see chunk_kda_fwd_intra's fp32_u)
                output_states=save_states, output_operands=save_operands, fp32_u=save_states,
            )
            o, ht = result[:2]
            if save_local or save_states or save_operands:
                local, states, operands = result[3]
        else:
            cdt = _compute_dtype(q)
            gate_factors = None
            if _fused_prologue(q):
                raw = tuple(x.contiguous() for x in (q, k, v, g, beta))
                tok = slot_tokens(layout, q.device)
                chunks, gate_factors = chunk_kda_prologue_fwd(*raw, A_log, dt_bias, opts, layout, tok)
            else:
                chunks = _chunked_inputs(q, k, v, g, beta, A_log, dt_bias, opts, layout)
            oc, ht, h, v_new = chunk_kda_train_fwd(
                *chunks, scale=opts.scale, initial_state=_state_in(initial_state, opts, cdt),
                chunk_offsets=layout.chunk_offsets, output_final_state=opts.output_final_state,
                keep_states=opts.disable_recompute, dot_precision=_dot_precision(q), gate_factors=gate_factors,
            )
            o = from_chunks(oc, layout).to(q.dtype)
            if ht is not None:
                ht = ht.float() if cdt == torch.float32 else ht
                ht = ht.transpose(-1, -2).contiguous() if opts.state_v_first else ht
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, h, v_new, *local, *states)
        ctx.num_local = len(local)
        # Not saved with save_for_backward: the backward drops them as soon as its all-heads pass has read them
        # (a saved tensor lives until the backward returns). They are intermediates, never inputs or outputs.
        ctx.operands = list(operands)
        ctx.layout, ctx.opts = layout, opts
        ctx.cu_seqlens = cu_seqlens
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q = ctx.saved_tensors[0]
        with torch.autocast(q.device.type, enabled=False), _matmul_precision(_dot_precision(q)):
            return ChunkKDAFunction._backward(ctx, do, dht)

    @staticmethod
    def _backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state, h, v_new, *kept = ctx.saved_tensors
        local, states = tuple(kept[: ctx.num_local]), tuple(kept[ctx.num_local :])
        layout, opts = ctx.layout, ctx.opts
        cdt = _compute_dtype(q)
        names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
        inputs = dict(zip(names, (q, k, v, g, beta, A_log, dt_bias)))
        h0 = _state_in(initial_state, opts, cdt)
        dhtc = None
        if dht is not None:
            dhtc = (dht.transpose(-1, -2) if opts.state_v_first else dht).to(cdt).contiguous()
        if _fused_prologue(q):
            grads, dh0 = _backward_in_head_slices(ctx, inputs, opts, layout, h0, do, dhtc, h, v_new, local, states)
        else:
            grads, dh0 = _backward_through_torch_prologue(ctx, inputs, opts, layout, h0, do, dhtc, h, v_new)
        if dh0 is not None and ctx.needs_input_grad[7]:
            grads["initial_state"] = (dh0.transpose(-1, -2) if opts.state_v_first else dh0).to(initial_state.dtype)
        return (*(grads.get(n) for n in names), grads.get("initial_state"), None, None)


def backward_head_slices(N: int, NC: int, HV: int, G: int, C: int, K: int, V: int) -> list[tuple[int, int]]:
    """Value-head ranges the fused backward runs one after the other (whole GVA groups of ``G`` heads).

    Every chunked intermediate of the backward is per (chunk, head), so a slice of ``HV / n`` heads keeps ``1 / n``
    of them alive. The slices halve while the intermediates exceed `BWD_SLICE_BYTES` and each slice still gives the
    state passes (one program per sequence, head and V block, each walking its whole sequence) at least
    `BWD_MIN_STATE_PROGRAMS` (sequence, head) pairs: below that they leave SMs idle and run ``n`` times as long.
    Measured on an H200 (benchmarks/kda/NOTES.md, 2026-12-01 01:41 UTC), forward + backward ms / peak MiB for 1, 2
    and 4 slices: B1-T8192-H64 14.6 / 6559, 15.7 / 3608, 18.0 / 2131; B8-T4096-H32 28.9 / 13142, 29.1 / 7256,
    28.9 / 4289; B1-T32768-H32 31.4 / 13100, 35.4 / 7198, 43.9 / 4246 (fla: 3866, 7748, 7720 MiB). The constants
    pick 2, 4 and 2 slices there: the fewest that keep the peak under fla's.

    Args:
        N: sequences; NC: chunks of ``C`` tokens over all sequences; HV: value heads; G: value heads per q/k head;
            K, V: head dims.

    Returns:
        ``[(hv0, hv1), ...]`` covering ``0 .. HV``, equal widths; `BWD_HEAD_SLICES` (if set, and a divisor of the
        GVA group count) fixes the count instead.
    """
    groups = HV // G
    if BWD_HEAD_SLICES is not None and groups % BWD_HEAD_SLICES == 0:
        width = HV // BWD_HEAD_SLICES
        return [(hv, hv + width) for hv in range(0, HV, width)]
    per_head = NC * 4 * C * (_BWD_CK_TENSORS * K + _BWD_CV_TENSORS * V + 2 * K * V // C + 6 * max(K, V))
    n = 1
    while (groups % (2 * n) == 0 and per_head * HV > n * BWD_SLICE_BYTES
           and N * HV >= 2 * n * BWD_MIN_STATE_PROGRAMS):
        n *= 2
    width = HV // n
    return [(hv, hv + width) for hv in range(0, HV, width)]


# fp32 [NC, HV, C, K] / [NC, HV, C, V] tensors alive at the backward's peak: q, k, G, qg, kg, kend / v, v_new,
# dv_new, do; plus h and dhe ([K, V] per chunk) and ~6 [C, max(K, V)] chain-rule temporaries (see backward_head_slices)
_BWD_CK_TENSORS, _BWD_CV_TENSORS = 6, 4
BWD_SLICE_BYTES = 3 * 2**30
BWD_MIN_STATE_PROGRAMS = 16
BWD_HEAD_SLICES: int | None = None  # a fixed slice count (benchmarks compare counts with it); None: the rule above


def _backward_in_head_slices(ctx, inputs, opts: KDAOptions, layout: ChunkLayout, h0, do, dhtc, h, v_new, local=(),
                             states=()):
    """Fused backward (Triton prologue, state passes, chain rule, prologue backward), slice by slice of heads.

    ``local``: ``(Aqk, Akk, Minv)`` ``[slices, NC, HS, 64, 64]`` saved by the forward kernels for the slices of
    ``ctx.head_slices`` (see `save_local_enabled`), or empty to recompute them. ``states``: the forward's
    ``(h [NC, HV, K, V], v_new [B, T, HV, V])`` (see `save_states_enabled`), or empty to recompute them.
    ``ctx.operands``: the forward's ``(w, qg, kg, gC)`` (see `dh_all_heads_enabled`): the reverse state pass then
    runs once over all heads before the slices (and drops them: a second backward through a retained graph runs it
    per slice); empty: once per slice.

    Returns:
        ``(grads by input name, dh0 in [N, HV, K, V] or None)``.
    """
    q, k, v, g, beta = (inputs[n].contiguous() for n in ("q", "k", "v", "g", "beta"))
    A_log, dt_bias = inputs["A_log"], inputs["dt_bias"]
    cdt, dot_precision = _compute_dtype(q), _dot_precision(q)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    tok = slot_tokens(layout, q.device)
    raw = (q, k, v, g, beta)
    out = None  # the raw-input gradients, allocated after the first slice's chain rule (not at its peak)
    dh0 = None if h0 is None else torch.empty_like(h0)
    slices = ctx.head_slices
    # The fused chain rule and the reverse state pass read do into fp32 registers (the latter then rounds it to
    # bf16 for bf16/fp16 callers): keeping do's own dtype in the chunked copy is exact and halves its bytes for half
    # callers. The torch GEMMs of the fallback need fp32.
    # (Only without grad mode: with create_graph the chain rule takes the torch path, which needs fp32 operands.)
    fused = not torch.is_grad_enabled()
    do_dtype = do.dtype if do is not None and fused and fused_wy(dot_precision, K, V) else cdt
    dv_new_all = dhe_all = None
    all_heads = local and fused and do is not None
    kept = all_heads and bool(ctx.operands)
    rebuilt = (all_heads and not kept and q.dtype == torch.bfloat16 and K <= 256 and h is None
               and recompute_all_heads_enabled())
    if kept or rebuilt:
        index = build_chunk_index(layout.B, layout.T, ctx.cu_seqlens, CHUNK_SIZE)
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
        dv_new_all, dhe_all, dh0 = chunk_kda_bwd_dh_tokens(qg_t, kg_t, w_t, gC, local[0], do.contiguous(), dhtc,
                                                           index, store_dh0=h0 is not None)
        del w_t, qg_t, kg_t, gC
    # with both state passes done (or kept) for all heads, only the unfused gate chain would read qg, kend, dec
    factors = not (dv_new_all is not None and (states or h is not None) and fused_gates(dot_precision, K))
    for hv0, hv1 in slices:
        def part(x: torch.Tensor | None, hv0: int = hv0, hv1: int = hv1) -> torch.Tensor | None:
            return x if x is None or (hv0, hv1) == (0, HV) else x[:, hv0:hv1].contiguous()

        def block(x: torch.Tensor, hv0: int = hv0, hv1: int = hv1) -> torch.Tensor:
            # this slice's [NC, HS, ...] block of a tensor laid out slice by slice, [slices, NC', HS, ...] (varlen:
            # the forward's chunk count NC' is an upper bound); contiguous, no copy
            return x[hv0 // (hv1 - hv0), : layout.num_chunks]

        chunks, gate_factors = chunk_kda_prologue_fwd(*raw, A_log, dt_bias, opts, layout, tok, heads=(hv0, hv1),
                                                      store_factors=factors)
        if do is not None:
            doc = head_slice_to_chunks(do, layout, tok, hv0, hv1, do_dtype)
        else:
            doc = torch.zeros_like(chunks[2])
        common = dict(scale=opts.scale, initial_state=part(h0), chunk_offsets=layout.chunk_offsets, dht=part(dhtc),
                      dot_precision=dot_precision)
        if fused:
            saved = None
            if local:
                saved = SavedLocal(*(block(x) for x in local))
            h_s, v_new_s = part(h), part(v_new)
            if states and h_s is None:
                h_s = widen_head_slice(states[0], hv0, hv1, layout.num_chunks)
                v_new_s = head_slice_to_chunks(states[1], layout, tok, hv0, hv1, cdt)
            dv_new_s = dhe_s = None
            if dv_new_all is not None:
                dv_new_s = head_slice_to_chunks(dv_new_all, layout, tok, hv0, hv1, cdt)
                dhe_s = block(dhe_all)  # fp32 already: a view of the slice's block
                if hv1 == HV:
                    if hv0 > 0:
                        # the last of several slices copies its block, so the blocks the earlier slices read are
                        # freed now rather than at the end (a view keeps the whole buffer: +133 MiB at the peak
                        # of varlen1024x8-H64 on the H200, 2026-12-03 09:00, over fla's)
                        dhe_s = dhe_s.clone()
                    dv_new_all = dhe_all = None
            q_c, k_c, v_c, _, beta_c = chunks
            # the slice's pass owns its tensors (and frees each once read for the last time): keep no reference here
            work = [q_c, k_c, v_c, beta_c, doc, *gate_factors, h_s, v_new_s, dv_new_s, dhe_s]
            del chunks, gate_factors, doc, q_c, k_c, v_c, beta_c, h_s, v_new_s, dv_new_s, dhe_s
            *dchunks, dh0_s = chunk_kda_slice_bwd(work, **common, saved_local=saved)
            del saved
        else:
            *dchunks, dh0_s = chunk_kda_train_bwd(*chunks, **common, do=doc, h=part(h), v_new=part(v_new),
                                                  gate_factors=gate_factors)
            del chunks, gate_factors, doc
        out = out or RawGrads.empty_like_inputs(*raw, layout.num_chunks)
        chunk_kda_prologue_bwd(*raw, A_log, dt_bias, opts, layout, tok, *dchunks, out=out, heads=(hv0, hv1))
        del dchunks
        if dh0_s is not None:
            dh0[:, hv0:hv1] = dh0_s
    all_grads = out.finish(A_log, dt_bias, opts)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    return {n: gx for n, gx in zip(names, all_grads) if _needs(ctx, n) and gx is not None}, dh0


def _backward_through_torch_prologue(ctx, inputs, opts, layout, h0, do, dhtc, h, v_new):
    """Backward with the prologue rebuilt as recorded torch ops (fp64 inputs, or K not a power of two).

    Returns:
        ``(grads by input name, dh0 in [N, HV, K, V] or None)``.
    """
    q = inputs["q"]
    cdt, dot_precision = _compute_dtype(q), _dot_precision(q)
    leaves = {n: x.detach().requires_grad_() for n, x in inputs.items() if x is not None and _needs(ctx, n)}
    args = {n: leaves.get(n, x) for n, x in inputs.items()}
    with torch.enable_grad():
        chunks = _chunked_inputs(*args.values(), opts, layout)
    doc = to_chunks(do, layout, cdt) if do is not None else torch.zeros_like(chunks[2])
    *dchunks, dh0 = chunk_kda_train_bwd(
        *(c.detach() for c in chunks), scale=opts.scale, initial_state=h0, chunk_offsets=layout.chunk_offsets,
        do=doc, dht=dhtc, h=h, v_new=v_new, dot_precision=dot_precision,
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
    forward_impl: str = "kernels",
    cu_seqlens_cpu: torch.Tensor | None = None,
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
        safe_gate: fla's bounded-gate flag (gates in ``[-5, 0)``); passed to the forward kernels.
        lower_bound: bounded gate floor, e.g. -5.0 (with ``use_gate_in_kernel``).
        state_v_first: states are ``[..., V, K]``.
        cu_seqlens: ``[N + 1]`` cumulative lengths for varlen (``B == 1``); read on the host once per tensor object
            (a loop that reuses it, or passes ``cu_seqlens_cpu``, never waits for the device).
        A_log: ``[HV]`` gate rate, with ``use_gate_in_kernel``.
        dt_bias: ``[HV * K]`` gate bias, with ``use_gate_in_kernel``.
        disable_recompute: keep the per-chunk states (and, for bf16, the reverse state pass's operands) from the
            forward: more memory between forward and backward, no state recompute (see the module docstring).
        forward_impl: ``"kernels"`` runs the forward kernels (``flashkda.fwd.chunk_fwd``); ``"training"`` runs the
            backward's own pipeline forward (`flashkda.bwd.chunk_bwd.chunk_kda_train_fwd`), for comparing the two.
        cu_seqlens_cpu: the host copy of ``cu_seqlens`` (validated by the caller), or None.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in ``q``'s dtype; ``final_state`` float32 (float64 for
        float64 inputs) or None.

    Raises:
        ValueError: ``K`` is not a power of two in 16..256 (the training kernels tile K whole).

    Example::

        >>> import torch
        >>> from flashkda.autograd import chunk_kda_autograd
        >>> q, k = (torch.nn.functional.normalize(torch.randn(1, 70, 2, 32), dim=-1) for _ in range(2))
        >>> v, beta = torch.randn(1, 70, 2, 32, requires_grad=True), torch.rand(1, 70, 2)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(1, 70, 2, 32))
        >>> o, _ = chunk_kda_autograd(q, k, v, g, beta, scale=32 ** -0.5)
        >>> o.sum().backward(); v.grad.shape
        torch.Size([1, 70, 2, 32])
    """
    if forward_impl not in ("kernels", "training"):
        raise ValueError(f"forward_impl must be 'kernels' or 'training', got {forward_impl!r}")
    K = q.shape[-1]
    if K < 16 or K > 256 or K & (K - 1):
        raise ValueError(f"training (inputs requiring grad) needs a head dim K in 16, 32, 64, 128, 256; got K={K}")
    opts = KDAOptions(
        scale=scale,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        state_v_first=state_v_first,
        disable_recompute=disable_recompute,
        forward_impl=forward_impl,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
