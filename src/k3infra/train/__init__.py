"""Pre-training and LoRA fine-tuning of the K3-style model on an offline corpus.

`train` / `Trainer` run single-process or under ``torchrun`` (FSDP2 data parallel, MoonEP expert parallel,
Muon + AdamW, DCP checkpoints with exact resume); `prepare_data` builds the corpus, BPE tokenizer and packed rows.
"""

from k3infra.train.data import TrainData, prepare_data
from k3infra.train.packing import IGNORE_INDEX, PackedBatch, PackedDataset, pack_rows
from k3infra.train.trainer import TrainConfig, Trainer, TrainResult, train

__all__ = [
    "IGNORE_INDEX",
    "PackedBatch",
    "PackedDataset",
    "TrainConfig",
    "TrainData",
    "TrainResult",
    "Trainer",
    "pack_rows",
    "prepare_data",
    "train",
]
