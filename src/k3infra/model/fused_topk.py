"""A Triton kernel for the router's selection: the ``k`` largest of each row of ``scores + bias``.

``torch.topk`` over a ``[tokens, experts]`` fp32 score matrix runs a radix select per row; with a few hundred experts
and ``k`` around ten, one program can hold a block of rows in registers and take the maximum ``k`` times instead,
reading the scores once. Same result as ``(scores + bias).topk(k, dim=1)`` (values in descending order, their
column indices), ties going to the lower index. `fused.MODE` decides where it runs (`fused.use_fused`); elsewhere,
and while ``torch.compile`` traces, it is ``torch.topk``.

Shape suffixes: s tokens, E experts, K selected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3infra.model import fused

__all__ = ["biased_topk"]

_MAX_EXPERTS = 4096
_TILE = 4096  # elements of scores one program holds: rows per program = _TILE // padded experts


@triton.jit
def _biased_topk_kernel(scores_ptr, bias_ptr, values_ptr, indices_ptr, S, E, K: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < S
    col_ok = cols < E
    x = tl.load(scores_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    x = x + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    x = tl.where(col_ok[None, :], x, float("-inf"))
    for j in tl.static_range(K):
        best = tl.max(x, axis=1)
        # the lowest column holding the maximum (a NaN row would match nothing: it takes column 0)
        at = tl.min(tl.where(x == best[:, None], cols[None, :], BLOCK_E), axis=1)
        at = tl.where(at == BLOCK_E, 0, at)
        tl.store(values_ptr + rows * K + j, best, mask=row_ok)
        tl.store(indices_ptr + rows * K + j, at.to(tl.int64), mask=row_ok)
        x = tl.where(cols[None, :] == at[:, None], float("-inf"), x)


def biased_topk(scores_sE: torch.Tensor, bias_E: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores_sE + bias_E).topk(k, dim=1)`` as ``(values_sK fp32, indices_sK int64)``, without autograd.

    Args:
        scores_sE: ``[s, E]`` fp32 scores (the router's sigmoid outputs).
        bias_E: ``[E]`` fp32 selection bias.
        k: how many per row, ``1 <= k <= E``.

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
    if not fused.use_fused(scores_sE) or E > _MAX_EXPERTS:
        top = (scores_sE + bias_E).topk(k, dim=1)
        return top.values, top.indices
    S = scores_sE.shape[0]
    values = torch.empty(S, k, dtype=torch.float32, device=scores_sE.device)
    indices = torch.empty(S, k, dtype=torch.int64, device=scores_sE.device)
    if S:
        block_e = triton.next_power_of_2(E)
        block_s = max(1, min(_TILE // block_e, triton.next_power_of_2(S)))
        _biased_topk_kernel[(triton.cdiv(S, block_s),)](scores_sE.contiguous(), bias_E.contiguous(), values, indices,
                                                        S, E, K=k, BLOCK_S=block_s, BLOCK_E=block_e)
    return values, indices
