"""fp64 torch oracles for Kimi Delta Attention (KDA).

These are the ground truth for every FlashKDA kernel test and for the benchmark's correctness gate. They follow
fla-core 0.6.0 (``fla.ops.kda.naive``, ``fla.ops.kda.gate``) exactly, but compute in float64, never modify a
tensor in place (so torch autograd differentiates through them), and accept ``cu_seqlens`` and the V-first state
layout.

Recurrence per value head (``S`` is ``[K, V]``, ``q`` scaled by ``scale``)::

    S_t = Diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T q_t

Example::

    >>> import torch
    >>> from flashkda import reference
    >>> q, k = torch.randn(2, 1, 20, 2, 8).unbind(0)
    >>> v, g = torch.randn(1, 20, 2, 8), -torch.rand(1, 20, 2, 8)
    >>> beta = torch.rand(1, 20, 2)
    >>> o, s = reference.naive_recurrent_kda(reference.l2norm(q), reference.l2norm(k), v, g, beta,
    ...                                      output_final_state=True)
    >>> o.shape, s.shape, o.dtype
    (torch.Size([1, 20, 2, 8]), torch.Size([1, 2, 8, 8]), torch.float64)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "beta_sigmoid",
    "chunk_kda_reference",
    "kda_gate",
    "l2norm",
    "naive_chunk_kda",
    "naive_recurrent_kda",
]

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """L2-normalise the last dimension as fla's ``l2norm_fwd`` does: ``x / sqrt(sum(x**2) + eps)``.

    Args:
        x: ``[..., D]`` tensor of any float dtype.
        eps: added under the square root (fla's default, 1e-6).

    Returns:
        ``[..., D]`` float64 tensor.
    """
    x = x.double()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def beta_sigmoid(beta: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """Map beta logits to ``sigmoid(beta)`` (or ``2 * sigmoid(beta)`` with ``allow_neg_eigval``), in float64.

    Args:
        beta: ``[B, T, HV]`` logits.
        allow_neg_eigval: scale to ``[0, 2)`` so ``I - beta k k^T`` may have negative eigenvalues.

    Returns:
        ``[B, T, HV]`` float64 tensor.
    """
    out = torch.sigmoid(beta.double())
    return out * 2.0 if allow_neg_eigval else out


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """The in-kernel KDA gate (``use_gate_in_kernel=True``) in float64, log space, per channel.

    Without ``lower_bound``: ``-exp(A_log) * softplus(g + dt_bias)`` (``A_log`` required).
    With ``lower_bound``: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, or
    ``lower_bound * sigmoid(g + dt_bias)`` when ``A_log`` is None.

    Args:
        g: ``[B, T, HV, K]`` raw gate input.
        A_log: ``[HV]`` per-head log decay rate, or None (only with ``lower_bound``).
        dt_bias: ``[HV * K]`` bias added before the activation, or None.
        lower_bound: the bounded-gate floor (e.g. -5.0), or None for the softplus gate.

    Returns:
        ``[B, T, HV, K]`` float64 log-decay, ``<= 0`` for the softplus gate and in ``[lower_bound, 0]`` otherwise.

    Raises:
        ValueError: ``A_log`` is None while ``lower_bound`` is None.
    """
    HV, K = g.shape[-2:]
    x = g.double()
    if dt_bias is not None:
        x = x + dt_bias.double().reshape(HV, K)
    if lower_bound is None:
        if A_log is None:
            raise ValueError("A_log is required by the softplus gate (lower_bound=None)")
        return -A_log.double().reshape(HV, 1).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.double().reshape(HV, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


def _segments(T: int, B: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _over_sequences(segment_fn, q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                    cu_seqlens):
    """Casts to fp64, expands GVA heads, runs ``segment_fn(q, k, v, g, beta, S) -> (o, S)`` per sequence."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K**-0.5
    G = HV // H
    q = q.double().repeat_interleave(G, dim=2) * scale
    k = k.double().repeat_interleave(G, dim=2)
    v, g, beta = v.double(), g.double(), beta.double()
    outs, finals = [], []
    for n, (b, bos, eos) in enumerate(_segments(T, B, cu_seqlens)):
        if initial_state is None:
            S = q.new_zeros(HV, K, V)
        else:
            S = initial_state[n].double()
            S = S.transpose(-1, -2) if state_v_first else S
        sl = slice(bos, eos)
        o, S = segment_fn(q[b, sl], k[b, sl], v[b, sl], g[b, sl], beta[b, sl], S)
        outs.append(o)
        finals.append(S.transpose(-1, -2) if state_v_first else S)
    o = torch.cat(outs, 0).reshape(B, T, HV, V) if cu_seqlens is not None else torch.stack(outs, 0)
    return o, (torch.stack(finals, 0) if output_final_state else None)


def _recurrent_segment(q, k, v, g, beta, S):
    """Token loop over one sequence: q/k/v/g ``[L, HV, *]`` float64, S ``[HV, K, V]``."""
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        kv = (k[t][..., None] * S).sum(-2)  # [HV, V]
        S = S + (beta[t][:, None] * k[t])[..., None] * (v[t] - kv)[:, None, :]
        outs.append((q[t][..., None] * S).sum(-2))
    o = torch.stack(outs, 0) if outs else v.new_zeros(v.shape)
    return o, S


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA in float64; the oracle for ``chunk_kda`` and ``fused_recurrent_kda``.

    Inputs are taken as given: no L2 norm, gate activation or beta sigmoid is applied here (see ``l2norm``,
    ``kda_gate``, ``beta_sigmoid`` and ``chunk_kda_reference`` for that).

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; ``HV`` a multiple of ``H`` (GVA).
        g: ``[B, T, HV, K]`` per-channel log decay.
        beta: ``[B, T, HV]`` write strengths.
        scale: query scale; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``) or None for zeros.
        output_final_state: return the final state (else None).
        state_v_first: states are ``[V, K]`` per head instead of ``[K, V]``.
        cu_seqlens: ``[N + 1]`` int cumulative lengths for varlen input (then ``B == 1``), or None.

    Returns:
        ``(o, final_state)``: ``o`` float64 ``[B, T, HV, V]``; ``final_state`` float64 ``[N, HV, K, V]`` (or
        V-first) when ``output_final_state`` else None.
    """
    return _over_sequences(_recurrent_segment, q, k, v, g, beta, scale, initial_state, output_final_state,
                           state_v_first, cu_seqlens)


def _chunk_segment(q, k, v, g, beta, S, chunk_size):
    """Chunked (WY/UT) form over one sequence; shapes as ``_recurrent_segment``; length padded to the chunk."""
    L = q.shape[0]
    if L == 0:
        return v.new_zeros(v.shape), S
    C = chunk_size
    pad = (-L) % C
    if pad:
        # Padding with k = 0, g = 0, beta = 0 leaves the state untouched and the real outputs unchanged.
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    NT = q.shape[0] // C
    HV = q.shape[1]
    # [HV, NT, C, *]
    q, k, v, g = (x.reshape(NT, C, HV, -1).permute(2, 0, 1, 3) for x in (q, k, v, g))
    beta = beta.reshape(NT, C, HV).permute(2, 0, 1)
    gc = g.cumsum(-2)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), diagonal=-1)
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    # decay[i, j, d] = exp(gc_i - gc_j), only where j <= i (never overflows there since g <= 0 is not assumed:
    # the masked entries are replaced before exp).
    diff = gc[..., :, None, :] - gc[..., None, :, :]
    diff = torch.where(causal[..., None], diff, torch.zeros_like(diff))
    decay = diff.exp()
    Akk = torch.einsum("hnid,hnjd,hnijd->hnij", k, k, decay) * beta[..., None]
    Akk = torch.where(strict, Akk, torch.zeros_like(Akk))
    Aqk = torch.einsum("hnid,hnjd,hnijd->hnij", q, k, decay)
    Aqk = torch.where(causal, Aqk, torch.zeros_like(Aqk))
    # T = (I + L)^-1 Diag(beta)
    Tm = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False) * beta[..., None, :]
    w = Tm @ (k * gc.exp())
    u = Tm @ v
    outs = []
    for i in range(NT):
        v_new = u[:, i] - w[:, i] @ S
        outs.append((q[:, i] * gc[:, i].exp()) @ S + Aqk[:, i] @ v_new)
        g_last = gc[:, i, -1]  # [HV, K]
        S = S * g_last.exp()[..., None] + ((g_last[:, None] - gc[:, i]).exp() * k[:, i]).transpose(-1, -2) @ v_new
    o = torch.stack(outs, 1).permute(1, 2, 0, 3).reshape(NT * C, HV, -1)[:L]
    return o, S


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (UT/WY transform per chunk, state passed between chunks) in float64.

    Same arguments and returns as ``naive_recurrent_kda`` plus ``chunk_size``; any length works (each sequence is
    zero-padded to a multiple of the chunk internally). Cross-checks the recurrent oracle and documents the math
    the Triton kernels implement.

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens: as in
            ``naive_recurrent_kda``.
        chunk_size: tokens per chunk.

    Returns:
        ``(o, final_state)`` as in ``naive_recurrent_kda``.
    """
    return _over_sequences(lambda *a: _chunk_segment(*a, chunk_size), q, k, v, g, beta, scale, initial_state,
                           output_final_state, state_v_first, cu_seqlens)


def chunk_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
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
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    **_ignored,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole ``chunk_kda`` function (optional L2 norm, gate, beta sigmoid, then the recurrence) in float64.

    Takes ``chunk_kda``'s arguments (extra ones such as ``safe_gate`` are ignored: they change speed, not math).

    Returns:
        ``(o, final_state)`` as in ``naive_recurrent_kda``, float64.
    """
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = beta_sigmoid(beta, allow_neg_eigval)
    return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens)
