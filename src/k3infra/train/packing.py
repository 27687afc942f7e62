"""Documents packed into fixed-length rows with ``cu_seqlens`` for varlen attention.

The token stream (documents separated by end-of-text) is cut into rows of ``seq_len`` tokens. A step takes
``batch_size`` rows in a seeded order; a rank takes its contiguous share of them and concatenates it into one
``[1, rows·seq_len]`` sequence whose ``cu_seqlens`` mark every document start and every row start, so no token
attends across a document. Labels follow the `transformers` convention (the model shifts them): ``labels[t] =
input_ids[t]`` except ``-100`` at the first token of every segment, so the last token of one document is never
trained to predict the first token of the next.

The order depends only on (seed, step): resuming at step ``s`` reproduces the batches exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedBatch:
    """One rank's share of a step.

    Attributes:
        input_ids: ``int64 [1, R·T]`` token ids (R rows of T tokens, concatenated).
        labels: ``int64 [1, R·T]``, ``-100`` at the first token of every segment.
        cu_seqlens: ``int32 [N+1]`` segment boundaries, ``0 … R·T``, strictly increasing.
        num_targets: tokens that are predicted (labels after the shift that are not ``-100``).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    num_targets: int

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch on ``device``."""
        return PackedBatch(self.input_ids.to(device), self.labels.to(device), self.cu_seqlens.to(device),
                           self.num_targets)


def pack_rows(tokens: np.ndarray, doc_starts: np.ndarray) -> PackedBatch:
    """Concatenate rows into one packed varlen sequence.

    Args:
        tokens: ``int [R, T]`` token ids.
        doc_starts: ``bool [R, T]``, True where a document begins (position 0 of each row is a start anyway).

    Returns:
        A `PackedBatch` of ``R·T`` tokens.
    """
    if tokens.ndim != 2 or tokens.shape != doc_starts.shape:
        raise ValueError(f"tokens and doc_starts must both be [R, T], got {tokens.shape} and {doc_starts.shape}")
    rows, seq_len = tokens.shape
    starts = doc_starts.copy()
    starts[:, 0] = True
    flat_starts = starts.reshape(-1)
    boundaries = np.flatnonzero(flat_starts)
    cu = np.append(boundaries, rows * seq_len).astype(np.int32)
    ids = torch.from_numpy(tokens.reshape(1, -1).astype(np.int64))
    labels = ids.clone()
    labels[0, torch.from_numpy(flat_starts)] = IGNORE_INDEX
    num_targets = int((labels[0, 1:] != IGNORE_INDEX).sum())
    return PackedBatch(ids, labels, torch.from_numpy(cu), num_targets)


class PackedDataset:
    """Rows of ``seq_len`` tokens cut from a token stream, served per (step, rank).

    Args:
        tokens: ``int [N]`` the token stream.
        eos_id: the end-of-text id; the token after it starts a document.
        seq_len: tokens per row.
        seed: seed of the row order (a fresh permutation every epoch).

    Raises:
        ValueError: ``seq_len`` < 2 or the stream holds fewer than one row.
    """

    def __init__(self, tokens: np.ndarray, eos_id: int, seq_len: int, seed: int = 0) -> None:
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
        num_rows = len(tokens) // seq_len
        if num_rows < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than one row of seq_len={seq_len}")
        stream = np.asarray(tokens[: num_rows * seq_len], dtype=np.int64)
        starts = np.zeros(len(stream), dtype=bool)
        starts[1:] = stream[:-1] == eos_id
        self.rows = stream.reshape(num_rows, seq_len)
        self.starts = starts.reshape(num_rows, seq_len)
        self.seq_len = seq_len
        self.seed = seed

    def __len__(self) -> int:
        return self.rows.shape[0]

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self))

    def row_indices(self, step: int, batch_size: int) -> np.ndarray:
        """Row numbers of step ``step``'s global batch (``int64 [batch_size]``), epochs wrapping around."""
        first = step * batch_size
        out = np.empty(batch_size, dtype=np.int64)
        orders: dict[int, np.ndarray] = {}
        for i in range(batch_size):
            epoch, pos = divmod(first + i, len(self))
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            out[i] = orders[epoch][pos]
        return out

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> PackedBatch:
        """Rank ``rank``'s contiguous ``batch_size / world_size`` rows of step ``step``.

        Raises:
            ValueError: ``batch_size`` is not divisible by ``world_size`` or ``rank`` is out of range.
        """
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be a positive multiple of the world size ({world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        per_rank = batch_size // world_size
        rows = self.row_indices(step, batch_size)[rank * per_rank : (rank + 1) * per_rank]
        return pack_rows(self.rows[rows], self.starts[rows])

    def micro_batches(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1,
                      rows: int | None = None) -> list[PackedBatch]:
        """Rank ``rank``'s rows of step ``step`` (as `batch`) in consecutive groups of ``rows`` rows (None: one
        group), one packed batch per forward; together they hold exactly `batch`'s tokens and targets.

        Raises:
            ValueError: as `batch`, or ``rows`` is not a positive int.
        """
        whole = self.batch(step, batch_size, rank, world_size)  # validates the arguments
        if rows is None:
            return [whole]
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows (micro-batch size) must be a positive int, got {rows!r}")
        per_rank = batch_size // world_size
        picked = self.row_indices(step, batch_size)[rank * per_rank : (rank + 1) * per_rank]
        return [pack_rows(self.rows[picked[i : i + rows]], self.starts[picked[i : i + rows]])
                for i in range(0, per_rank, rows)]

    def num_targets(self, step: int, batch_size: int) -> int:
        """Predicted tokens in the whole global batch of ``step`` (the loss denominator on every rank)."""
        rows = self.row_indices(step, batch_size)
        starts = self.starts[rows].copy()
        starts[:, 0] = True
        return int((~starts).sum())
