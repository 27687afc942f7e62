"""Kimi Delta Attention in plain torch: a chunked (WY/UT) form for training on any device, and a token step
for decode. Same argument layout as ``fla.ops.kda.chunk_kda`` with the gate, L2 norm and beta sigmoid applied
by the caller (``g`` is the per-channel log decay, ``beta`` in (0, 1)); states are ``[N, H, K, V]`` fp32.

Per head, with ``S`` the ``[K, V]`` state::

    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)

Chunked (chunk ``C``, Γ the in-chunk cumulative sum of g): ``T = (I + L)⁻¹ Diag(β)`` with
``L_ij = β_i Σ_d k_id k_jd e^{Γ_id−Γ_jd}`` (i > j); ``w = T(k⊙e^Γ)``, ``u = T v``; per chunk
``v_new = u − w S``, ``o = (q⊙e^Γ) S + A_qk v_new``, ``S ← Diag(e^{Γ_C}) S + (k⊙e^{Γ_C−Γ})ᵀ v_new``.
The exponent differences are formed before ``exp`` (never ``e^{Γ}·e^{−Γ}``), so no chunk size overflows.

Shape suffixes: B batch, T tokens, H heads, K key dim, V value dim, n chunks, C chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_kda_torch", "recurrent_kda_torch"]


def _chunk_equal_length(q, k, v, g, beta, scale, S0, chunk_size):
    """q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, fp32, T a multiple of the chunk."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    n = T // C

    def chunks(x):  # [B, T, H, X] -> [B, H, n, C, X]
        return x.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    q_, k_, v_, g_ = chunks(q), chunks(k), chunks(v), chunks(g)
    b_ = beta.reshape(B, n, C, H).permute(0, 3, 1, 2)  # [B, H, n, C]
    G = g_.cumsum(-2)  # Γ [B, H, n, C, K]
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B, H, n, C(i), C(j), K]: Γ_i − Γ_j
    lower_eq = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = lower_eq.clone().fill_diagonal_(False)
    decay = torch.exp(torch.where(lower_eq[..., None], diff, torch.zeros((), device=q.device)))
    decay = decay * lower_eq[..., None]
    A_kk = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", k_, k_, decay) * strict
    A_qk = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", q_, k_, decay) * scale
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    # T = (I + Diag(β) A_kk)⁻¹ Diag(β): one unit-lower-triangular solve per chunk.
    Tm = torch.linalg.solve_triangular(eye + b_.unsqueeze(-1) * A_kk, torch.diag_embed(b_), upper=False)
    w = Tm @ (k_ * G.exp())  # [B, H, n, C, K]
    u = Tm @ v_  # [B, H, n, C, V]
    q_decayed = q_ * G.exp() * scale
    k_to_end = k_ * torch.exp(G[..., -1:, :] - G)  # k ⊙ e^{Γ_C − Γ}
    S = S0 if S0 is not None else q.new_zeros(B, H, K, V)
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ S  # [B, H, C, V]
        outs.append(q_decayed[:, :, i] @ S + A_qk[:, :, i] @ v_new)
        S = G[:, :, i, -1, :].exp().unsqueeze(-1) * S + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2)  # [B, H, n, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V), S


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for half inputs (the state must be fp32); fp64 stays fp64 so tests can check the math exactly.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pad_time(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[1]) % multiple
    if not pad:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable chunked KDA in fp32 (fp64 for fp64 inputs), any device.

    Args:
        q: ``[B, T, H, K]`` queries, already L2-normalised.
        k: ``[B, T, H, K]`` keys, already L2-normalised.
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` per-channel log decay (<= 0).
        beta: ``[B, T, H]`` write strengths in (0, 1).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None for zeros.
        output_final_state: also return the ``[N, H, K, V]`` fp32 final states.
        cu_seqlens: ``[N + 1]`` cumulative lengths of packed sequences (then ``B == 1``), or None.
        chunk_size: ``C``.

    Returns:
        ``(o [B, T, H, V]`` in ``q``'s dtype, ``final_state`` fp32 (fp64 for fp64 inputs) or None).

    Raises:
        ValueError: shapes disagree, or ``cu_seqlens`` with ``B != 1``.
    """
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(
            f"expected q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]; got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    scale = K**-0.5 if scale is None else scale
    dtype = q.dtype
    work = _work_dtype(dtype)
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    S0 = None if initial_state is None else initial_state.to(work)
    if cu_seqlens is None:
        padded = [_pad_time(t, chunk_size) for t in (q, k, v, g)] + [_pad_time(beta.unsqueeze(-1), chunk_size)]
        o, S = _chunk_equal_length(*padded[:4], padded[4].squeeze(-1), scale, S0, chunk_size)
        return o[:, :T].to(dtype), (S if output_final_state else None)
    if B != 1:
        raise ValueError(f"cu_seqlens needs packed input with B == 1, got B={B}")
    # Documents side by side as a padded batch: padding (k = 0, g = 0, beta = 0) leaves outputs and states as they are.
    bounds = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    longest = max(lens, default=0)
    longest += (-longest) % chunk_size
    longest = max(longest, chunk_size)
    starts = torch.tensor(bounds[:-1], device=q.device)
    pos = torch.arange(longest, device=q.device)
    lens_t = torch.tensor(lens, device=q.device)
    valid = pos[None, :] < lens_t[:, None]  # [N, longest]
    index = torch.where(valid, starts[:, None] + pos[None, :], torch.full_like(pos[None, :], T))

    def to_docs(x):  # [1, T, H, X] -> [N, longest, H, X] with a zero row for padding
        table = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])], 0)
        return table[index]

    o_docs, S = _chunk_equal_length(
        to_docs(q), to_docs(k), to_docs(v), to_docs(g), to_docs(beta.unsqueeze(-1)).squeeze(-1), scale, S0, chunk_size
    )
    o = o_docs[valid].unsqueeze(0)  # documents are contiguous and in order
    return o.to(dtype), (S if output_final_state else None)


def recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA (decode); same inputs as `chunk_kda_torch` without ``cu_seqlens``.

    Returns:
        ``(o [B, T, H, V]`` in ``q``'s dtype, final state ``[B, H, K, V]`` fp32, fp64 for fp64 inputs).
    """
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    work = _work_dtype(q.dtype)
    S = initial_state.to(work) if initial_state is not None else q.new_zeros(B, H, K, v.shape[-1], dtype=work)
    qf, kf, vf, gf, bf = (t.to(work) for t in (q, k, v, g, beta))
    outs = []
    for t in range(T):
        S = S * gf[:, t].exp().unsqueeze(-1)
        pred = (kf[:, t].unsqueeze(-1) * S).sum(-2)  # [B, H, V]
        S = S + (bf[:, t, :, None, None] * kf[:, t].unsqueeze(-1)) * (vf[:, t] - pred).unsqueeze(-2)
        outs.append((qf[:, t].unsqueeze(-1) * S).sum(-2) * scale)
    return torch.stack(outs, 1).to(q.dtype), S
