"""The per-head maximum of MLA's causal pre-softmax logits ``scale · q·kᵀ``, which QK-Clip (`qk_clip`) reads after
every training step.

Two paths with the same result: `causal_max_logit` runs a Triton kernel on CUDA tensors (`fused.use_fused`), flash
style: one program per (block of query rows of one sequence, head) walks the key blocks its causal window needs,
``q·kᵀ`` on tensor cores with fp32 accumulation, and keeps a running max; nothing of the ``[T, S]`` logits is
written. The eager path (the reference, and CPU) recomputes the logits in fp32 by query blocks of at most
`MAX_LOGIT_BLOCK_ELEMENTS`, masks and reduces them: about ten times the FLOPs of attention's own ``q·kᵀ`` at fp32
rates, and four passes over each block in memory.

Shape suffixes: B batch, H heads, T queries, S keys, E the q/k head width.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flashkda.rounding import INTERPRET
from k3infra.model.fused import use_fused

__all__ = ["MAX_LOGIT_BLOCK_ELEMENTS", "causal_max_logit"]

MAX_LOGIT_BLOCK_ELEMENTS = 1 << 26
"""fp32 logits per block of the eager path (256 MiB)."""


def causal_max_logit(q_BHTE: torch.Tensor, k_BHSE: torch.Tensor, bounds: list[int] | None,
                     scale: float) -> torch.Tensor:
    """Per-head max over every causal (query, key) pair of ``scale · q·k``, within each packed sequence.

    Args:
        q_BHTE: ``[B, H, T, E]`` queries (any strides), fp32 or bf16/fp16.
        k_BHSE: ``[B, H, S, E]`` keys, ``S >= T``: the queries are the last ``T`` of ``S`` positions (a cache holds
            the first ``S - T``).
        bounds: host cumulative sequence lengths ``[0, ..., T]`` of the packed sequences (``B == 1``, ``S == T``),
            or None (each batch row one causal sequence).
        scale: the softmax scale (> 0).

    Returns:
        ``[H]`` fp32; ``-inf`` for a head with no pair (no tokens).
    """
    B, H, T, E = q_BHTE.shape
    S = k_BHSE.shape[2]
    if tuple(k_BHSE.shape) != (B, H, S, E) or S < T:
        raise ValueError(f"k_BHSE must be [{B}, {H}, S >= {T}, {E}], got {tuple(k_BHSE.shape)}")
    if bounds is not None and (B != 1 or S != T or bounds[0] != 0 or bounds[-1] != T):
        raise ValueError(f"bounds must run from 0 to T = {T} over one row without a cache, got B = {B}, S = {S}, "
                         f"bounds ending at {bounds[-1]}")
    if use_fused(q_BHTE) and S == T and T > 0:
        return _kernel_path(q_BHTE, k_BHSE, bounds, scale)
    return _eager(q_BHTE, k_BHSE, bounds, scale)


def _eager(q_BHTE: torch.Tensor, k_BHSE: torch.Tensor, bounds: list[int] | None, scale: float) -> torch.Tensor:
    B, H, T, _ = q_BHTE.shape
    S = k_BHSE.shape[2]
    offset = S - T
    spans = [(0, T)] if bounds is None else [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    best = torch.full((H,), float("-inf"), device=q_BHTE.device)
    for b in range(B):
        for start, end in spans:
            k_start = 0 if bounds is None else start + offset
            rows = max(1, MAX_LOGIT_BLOCK_ELEMENTS // (H * (end + offset - k_start)))
            for r0 in range(start, end, rows):
                r1 = min(end, r0 + rows)
                k_HSE = k_BHSE[b, :, k_start : r1 + offset].float()
                logits = (q_BHTE[b, :, r0:r1].float() @ k_HSE.transpose(-1, -2)) * scale
                query = torch.arange(r0 + offset, r1 + offset, device=logits.device)
                key = torch.arange(k_start, r1 + offset, device=logits.device)
                logits = logits.masked_fill(key[None, :] > query[:, None], float("-inf"))
                best = torch.maximum(best, logits.amax(dim=(1, 2)))
    return best


@functools.lru_cache(maxsize=64)
def _query_blocks(bounds: tuple[int, ...], B: int, T: int, block_m: int, device: torch.device) -> torch.Tensor:
    """``[NB, 4]`` int32 rows (batch row, first query, end query, sequence start) of every query block."""
    spans = [(0, T)] if not bounds else [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    rows = [(b, r0, min(end, r0 + block_m), start) for b in range(B) for start, end in spans
            for r0 in range(start, end, block_m)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)


def _kernel_path(q_BHTE: torch.Tensor, k_BHSE: torch.Tensor, bounds: list[int] | None, scale: float) -> torch.Tensor:
    B, H, T, E = q_BHTE.shape
    on_gpu = q_BHTE.device.type == "cuda"
    block_m, block_n = (64, 64) if on_gpu else (16, 16)
    blocks = _query_blocks(tuple(bounds or ()), B, T, block_m, q_BHTE.device)
    part = torch.empty(blocks.shape[0], H, dtype=torch.float32, device=q_BHTE.device)
    ieee = q_BHTE.dtype == torch.float32 or k_BHSE.dtype == torch.float32
    _causal_max_logit_kernel[(blocks.shape[0], H)](
        q_BHTE, k_BHSE, blocks, part, H, E,
        *q_BHTE.stride(), *k_BHSE.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_E=triton.next_power_of_2(max(E, 16)), IEEE=ieee,
        num_warps=4 if on_gpu else 1, num_stages=2 if on_gpu else 1)
    return part.amax(0) * scale


@triton.jit
def _causal_max_logit_kernel(q, k, blocks, part, H, E, sqb, sqh, sqt, sqe, skb, skh, sks, ske,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                             IEEE: tl.constexpr):
    i_blk = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.load(blocks + i_blk * 4).to(tl.int64)
    q0 = tl.load(blocks + i_blk * 4 + 1)
    q1 = tl.load(blocks + i_blk * 4 + 2)
    s0 = tl.load(blocks + i_blk * 4 + 3)
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    rows = q0 + tl.arange(0, BLOCK_M)
    m_rows = rows < q1
    p_q = q + i_b * sqb + i_h * sqh + rows.to(tl.int64)[:, None] * sqt + o_e[None, :] * sqe
    b_q = tl.load(p_q, mask=m_rows[:, None] & m_e[None, :], other=0.0)  # [BLOCK_M, BLOCK_E]
    if IEEE or INTERPRET:  # the interpreter's bf16 products are not exact: fp32 operands there
        b_q = b_q.to(tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for n0 in range(s0, q1, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        p_k = k + i_b * skb + i_h * skh + cols.to(tl.int64)[None, :] * sks + o_e[:, None] * ske
        b_k = tl.load(p_k, mask=(cols < q1)[None, :] & m_e[:, None], other=0.0)  # [BLOCK_E, BLOCK_N]
        if IEEE or INTERPRET:
            b_s = tl.dot(b_q, b_k.to(tl.float32), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, b_k)
        causal = m_rows[:, None] & (cols[None, :] <= rows[:, None])
        best = tl.maximum(best, tl.max(tl.where(causal, b_s, float("-inf")), 1))
    tl.store(part + i_blk * H + i_h, tl.max(best, 0))
