"""A Triton kernel for the router's selection: the ``k`` largest of each row of ``scores + bias``.

``torch.topk`` over a ``[tokens, experts]`` fp32 score matrix runs a radix select per row; with a few hundred experts
and ``k`` around ten, one program can hold a block of rows in registers and take the maximum ``k`` times instead,
reading the scores once. Same result as ``(scores + bias).topk(k, dim=1)`` (values in descending order, their
column indices), ties going to the lower index. `fused.MODE` decides where it runs (`fused.use_fused`), also inside
``torch.compile``'s graphs (it is the operator ``k3infra::biased_topk`` there); elsewhere it is ``torch.topk``.

With ``hist_EX`` the same pass also counts Quantile Balancing's margins: every score's distance to its row's k-th
value, binned per expert (`margin_bins`), added to ``hist_EX`` with atomics, so the ``[tokens, experts]`` margins,
their int64 bins and the scattered ``index_add_`` of the eager path never reach memory.

Shape suffixes: s tokens, E experts, K selected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3infra.model import fused

__all__ = ["biased_topk", "margin_bins"]

_MAX_EXPERTS = 4096
_TILE = 4096  # elements of scores one program holds: rows per program = _TILE // padded experts


@triton.jit
def _biased_topk_kernel(scores_ptr, bias_ptr, values_ptr, indices_ptr, hist_ptr, S, E, margin_range, bin_width,
                        K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BINS: tl.constexpr,
                        HIST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < S
    col_ok = cols < E
    scores = tl.load(scores_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    x = scores + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    x = tl.where(col_ok[None, :], x, float("-inf"))
    cutoff = tl.zeros([BLOCK_S], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(x, axis=1)
        # the lowest column holding the maximum (a NaN row would match nothing: it takes column 0)
        at = tl.min(tl.where(x == best[:, None], cols[None, :], BLOCK_E), axis=1)
        at = tl.where(at == BLOCK_E, 0, at)
        tl.store(values_ptr + rows * K + j, best, mask=row_ok)
        tl.store(indices_ptr + rows * K + j, at.to(tl.int64), mask=row_ok)
        x = tl.where(cols[None, :] == at[:, None], float("-inf"), x)
        cutoff = best
    if HIST:
        # margin_bins's arithmetic in its order, with IEEE division, so that every bin matches the torch path's
        pos = tl.math.div_rn((scores - cutoff[:, None]) + margin_range, bin_width) * BINS
        b = tl.minimum(tl.maximum(pos.to(tl.int32), 0), BINS - 1)
        tl.atomic_add(hist_ptr + cols[None, :] * BINS + b, tl.full([BLOCK_S, BLOCK_E], 1.0, tl.float32),
                      mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")


def margin_bins(margins_sE: torch.Tensor, bins: int, margin_range: float) -> torch.Tensor:
    """Quantile Balancing's bin of each margin: ``floor((m + R) / 2R * bins)`` clamped to ``[0, bins - 1]``, where
    ``R = margin_range``; ``[s, E]`` fp32 in, ``[s, E]`` int64 out (the kernel's reference)."""
    return ((margins_sE + margin_range) / (2 * margin_range) * bins).long().clamp(0, bins - 1)


def _add_margins(hist_EX: torch.Tensor, scores_sE: torch.Tensor, cutoff_s: torch.Tensor, margin_range: float) -> None:
    E, X = hist_EX.shape
    bin_sE = margin_bins(scores_sE - cutoff_s[:, None], X, margin_range)
    flat = (bin_sE + torch.arange(E, device=bin_sE.device) * X).flatten()
    hist_EX.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=hist_EX.dtype))


def biased_topk(scores_sE: torch.Tensor, bias_E: torch.Tensor, k: int, hist_EX: torch.Tensor | None = None,
                margin_range: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores_sE + bias_E).topk(k, dim=1)`` as ``(values_sK fp32, indices_sK int64)``, without autograd.

    Args:
        scores_sE: ``[s, E]`` fp32 scores (the router's sigmoid outputs).
        bias_E: ``[E]`` fp32 selection bias.
        k: how many per row, ``1 <= k <= E``.
        hist_EX: optional ``[E, X]`` margin histogram (contiguous, fp32 for the kernel): each score's margin
            ``scores_sE - values_sK[:, -1]`` (to its row's k-th biased value) is counted into bin
            ``margin_bins(margin, X, margin_range)`` of its expert, in place.
        margin_range: ``R > 0``: the histogram covers margins in ``[-R, R)``; outside, the first or last bin.

    Raises:
        ValueError: a shape, dtype or ``k`` that does not fit (the message names the argument).
    """
    if scores_sE.dim() != 2 or scores_sE.dtype != torch.float32:
        raise ValueError(f"scores_sE must be fp32 [s, E], got {scores_sE.dtype} {tuple(scores_sE.shape)}")
    E = scores_sE.shape[1]
    if bias_E.shape != (E,) or bias_E.dtype != torch.float32:
        raise ValueError(f"bias_E must be fp32 [{E}], got {bias_E.dtype} {tuple(bias_E.shape)}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= E:
        raise ValueError(f"k must be an int in [1, {E}], got {k!r}")
    if hist_EX is not None:
        if (hist_EX.dim() != 2 or hist_EX.shape[0] != E or hist_EX.shape[1] < 1 or not hist_EX.is_floating_point()
                or not hist_EX.is_contiguous() or hist_EX.device != scores_sE.device):
            raise ValueError(f"hist_EX must be a contiguous float [{E}, bins] tensor on {scores_sE.device}, got "
                             f"{hist_EX.dtype} {tuple(hist_EX.shape)} on {hist_EX.device}")
        if not margin_range > 0:
            raise ValueError(f"margin_range must be > 0, got {margin_range!r}")
    kernel_hist = hist_EX is None or hist_EX.dtype == torch.float32  # the kernel adds with fp32 atomics
    if not fused.use_fused(scores_sE, while_compiling=True) or E > _MAX_EXPERTS or not kernel_hist:
        top = (scores_sE + bias_E).topk(k, dim=1)
        if hist_EX is not None:
            _add_margins(hist_EX, scores_sE, top.values[:, -1], margin_range)
        return top.values, top.indices
    return _biased_topk_op(scores_sE.contiguous(), bias_E.contiguous(), k, hist_EX, float(margin_range))


@torch.library.custom_op("k3infra::biased_topk", mutates_args=("hist_EX",))
def _biased_topk_op(scores_sE: torch.Tensor, bias_E: torch.Tensor, k: int, hist_EX: torch.Tensor | None,
                    margin_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    # an operator, so that torch.compile's graphs call the kernel instead of tracing torch.topk
    S, E = scores_sE.shape
    values = torch.empty(S, k, dtype=torch.float32, device=scores_sE.device)
    indices = torch.empty(S, k, dtype=torch.int64, device=scores_sE.device)
    if S:
        block_e = triton.next_power_of_2(E)
        block_s = max(1, min(_TILE // block_e, triton.next_power_of_2(S)))
        hist = hist_EX if hist_EX is not None else values  # never written without HIST
        _biased_topk_kernel[(triton.cdiv(S, block_s),)](
            scores_sE, bias_E, values, indices, hist, S, E, margin_range, 2.0 * margin_range, K=k, BLOCK_S=block_s,
            BLOCK_E=block_e, BINS=hist_EX.shape[1] if hist_EX is not None else 1, HIST=hist_EX is not None)
    return values, indices


@_biased_topk_op.register_fake
def _(scores_sE, bias_E, k, hist_EX, margin_range):
    S = scores_sE.shape[0]
    return scores_sE.new_empty(S, k), scores_sE.new_empty(S, k, dtype=torch.int64)
