"""torchtitan components that carry ``k3infra train``'s data and optimizers into torchtitan's trainer.

- `K3CorpusTokenizer`: the offline corpus and its cached byte-level BPE (the same files ``k3infra train`` uses);
- `K3PackedDataLoader`: packed rows with ``cu_seqlens`` (no token attends across a document), labels shifted to
  torchtitan's convention (``labels[t]`` is the token after ``input[t]``, ``-100`` where that crosses a document);
- `K3Optimizers`: Muon for matrices + AdamW for embeddings, head, router and vectors (`build_optimizers`), inside
  torchtitan's ``OptimizersContainer`` so its LR schedulers, hooks and metrics apply.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.tokenizer import BaseTokenizer

from k3infra.train.corpus import Corpus
from k3infra.train.optim import build_optimizers
from k3infra.train.packing import IGNORE_INDEX, PackedDataset
from k3infra.train.tokenizer import EOS_TOKEN, encode_corpus, load_or_train_tokenizer

__all__ = ["K3CorpusTokenizer", "K3Optimizers", "K3PackedDataLoader"]


def _rank_zero_first(fn):
    """Run ``fn`` on rank 0, then on the others (rank 0 fills the cache they read)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    out = fn() if dist.get_rank() == 0 else None
    dist.barrier()
    return out if out is not None else fn()


class K3CorpusTokenizer(BaseTokenizer):
    """The corpus (files, or this Python's standard library) and its byte-level BPE, trained once and cached."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 512
        """Must equal the model's ``vocab_size``."""
        corpus: list[str] = field(default_factory=list)
        """Files or folders of text (empty: the standard library source)."""
        max_bytes: int = 16 << 20
        cache_dir: str | None = None
        """Tokenizer and token cache (default ``$K3INFRA_CACHE`` or ``~/.cache/k3infra``)."""

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.corpus = Corpus.from_paths(config.corpus or None, max_bytes=config.max_bytes)
        self.cache_dir = config.cache_dir
        self.tokenizer = _rank_zero_first(
            lambda: load_or_train_tokenizer(self.corpus, config.vocab_size, config.cache_dir))
        self.eos_id = self.tokenizer.token_to_id(EOS_TOKEN)

    def encode(self, text: str, **kwargs) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int], **kwargs) -> str:
        return self.tokenizer.decode(ids)

    def get_vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


class K3PackedDataLoader(BaseDataLoader):
    """Per ``next``: this rank's ``local_batch_size`` rows of the next global batch, packed into one row.

    Yields ``({"input": int64 [1, R·T], "cu_seqlens": int32 [N + 1]}, labels int64 [1, R·T])``. The row order
    depends only on (seed, batch index), as in ``k3infra train``; `state_dict` holds the batch index.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                 seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
        if not isinstance(tokenizer, K3CorpusTokenizer):
            raise TypeError(f"K3PackedDataLoader needs the K3CorpusTokenizer (tokenizer config), got "
                            f"{type(tokenizer).__name__}")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
        tokens = _rank_zero_first(lambda: encode_corpus(tokenizer.corpus, tokenizer.tokenizer, tokenizer.cache_dir))
        self.dataset = PackedDataset(tokens, tokenizer.eos_id, seq_len, seed=config.seed)
        self.rank, self.world, self.rows = dp_rank, dp_world_size, local_batch_size
        self.index = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            batch = self.dataset.batch(self.index, self.rows * self.world, self.rank, self.world)
            self.index += 1
            labels = torch.full_like(batch.labels, IGNORE_INDEX)
            labels[:, :-1] = batch.labels[:, 1:]
            yield {"input": batch.input_ids, "cu_seqlens": batch.cu_seqlens}, labels

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.index = int(state_dict["index"])


class K3Optimizers(OptimizersContainer):
    """`build_optimizers` per model part (Muon + AdamW, or AdamW alone) in torchtitan's container."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 3e-3
        weight_decay: float = 0.1
        name: str = "muon"
        """``muon`` (Muon for matrices, AdamW for the rest) or ``adamw`` (AdamW for everything)."""
        per_head_muon: bool = True
        """Orthogonalise query/key/value projections one head at a time (K3's per-head Muon)."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        if config.name not in ("muon", "adamw"):
            raise ValueError(f"optimizer.name must be 'muon' or 'adamw', got {config.name!r}")
        self.model_parts = model_parts
        self.optimizers = []
        for part in model_parts:
            self.optimizers.extend(build_optimizers(part, lr=config.lr, weight_decay=config.weight_decay,
                                                    use_muon=config.name == "muon",
                                                    per_head_muon=config.per_head_muon))
        params = [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]
        self._validate_params(params)
        self._post_init(params)
