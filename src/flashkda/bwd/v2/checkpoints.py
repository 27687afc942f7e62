"""State checkpoints that the v2 training forward saves for the backward, and their index.

The forward's recurrence (K2) keeps the state in fp32 accumulators; in training it also stores the state at the
start of every ``every``-th chunk of each sequence (chunk ``j`` of a sequence with ``j % every == 0``, the first one
being the initial state). The backward recomputes the states of the chunks in between from these checkpoints, in
parallel over checkpoint segments. Layout (compact, sequence after sequence)::

    checkpoints   [NCK, H, K, V]   bf16 or fp32   state at the start of chunk ``seq_chunks[n] + i * every``
    ck_offsets    [N + 1]          int64          first checkpoint of each sequence; sequence n has
                                                  ``ceil(chunks_n / every)`` of them (none when it is empty)

``emulate_recurrence_train`` is ``fwd.v2.emulate.emulate_recurrence`` plus the checkpoint stores.
"""

from __future__ import annotations

import torch

from flashkda.fwd.v2.emulate import emulate_recurrence
from flashkda.fwd.v2.workspace import ChunkLayout, Workspace

__all__ = ["checkpoint_bound", "checkpoint_offsets", "emulate_recurrence_train"]


def _check_every(every: int) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be a positive int (chunks between state checkpoints), got {every!r}")


def checkpoint_offsets(layout: ChunkLayout, every: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N + 1]`` int64 first checkpoint of each sequence for one checkpoint every ``every`` chunks, on ``device``
    (computed there: no host synchronisation when it is the layout's device).

    Raises:
        ValueError: ``every`` is not a positive int.
    """
    _check_every(every)
    seq_chunks = layout.seq_chunks.to(device).long()
    counts = seq_chunks[1:] - seq_chunks[:-1]
    per_seq = (counts + every - 1) // every
    return torch.cat([per_seq.new_zeros(1), per_seq.cumsum(0)])


def checkpoint_bound(layout: ChunkLayout, every: int) -> int:
    """A host-side upper bound of the checkpoint count, exact for fixed length: sequence ``n`` has
    ``ceil(c_n / every)`` checkpoints, ``c_n <= max_chunks_per_seq`` and ``sum(c_n) <= num_chunks``."""
    _check_every(every)
    N = layout.num_seqs
    return min(N * -(-layout.max_chunks_per_seq // every), (layout.num_chunks + N * (every - 1)) // every)


def emulate_recurrence_train(ws: Workspace, v: torch.Tensor, initial_state: torch.Tensor | None, every: int,
                             checkpoint_dtype: torch.dtype = torch.bfloat16,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K2 in torch with the training checkpoint stores.

    Args:
        ws: workspace of ``emulate_prepare`` (chunks of ``ws.inv.shape[-1]`` tokens).
        v: ``[B, T, H, V]`` values.
        initial_state: ``[N, H, K, V]`` fp32 (K-first) or None.
        every: chunks between checkpoints (see `checkpoint_offsets`).
        checkpoint_dtype: ``torch.bfloat16`` or ``torch.float32``.

    Returns:
        ``(o [B, T, H, V] bf16, final_state [N, H, K, V] fp32, checkpoints [NCK, H, K, V] checkpoint_dtype)``.
    """
    if checkpoint_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"checkpoint_dtype must be torch.bfloat16 or torch.float32, got {checkpoint_dtype}")
    H, V = v.shape[2:]
    K = ws.kd.shape[-1]
    ck = checkpoint_offsets(ws.layout, every)
    ckpts = torch.zeros(int(ck[-1]), H, K, V, dtype=checkpoint_dtype, device=v.device)

    def store(j: int, seqs: torch.Tensor, S: torch.Tensor) -> None:
        if j % every == 0:
            ckpts[(ck[seqs] + j // every).to(v.device)] = S.to(checkpoint_dtype)

    o, final = emulate_recurrence(ws, v, initial_state, True, state_hook=store)
    return o, final, ckpts
