"""Pre-training and LoRA fine-tuning of the K3-style model on an offline corpus.

`train` / `Trainer` run single-process or under ``torchrun`` (FSDP2 data parallel, MoonEP expert parallel,
Muon + AdamW, DCP checkpoints with exact resume); `prepare_data` builds the corpus, BPE tokenizer and packed rows.
Names are imported on first use, so ``k3infra --help`` does not load torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "IGNORE_INDEX": "packing", "PackedBatch": "packing", "PackedDataset": "packing", "pack_rows": "packing",
    "TrainData": "data", "prepare_data": "data",
    "TrainerCallback": "callbacks", "ElasticMoE": "elastic",
    "TrainConfig": "trainer", "TrainResult": "trainer", "Trainer": "trainer", "train": "trainer",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'k3infra.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"k3infra.train.{_EXPORTS[name]}"), name)
