"""torchtitan's entry points for the K3 model: ``--module k3infra.titan --config k3_debug`` (or ``k3_mini``).

torchtitan's ``ConfigManager`` imports ``k3infra.titan.config_registry`` and calls the named function, which
returns a complete ``Trainer.Config`` (``model_spec`` included); command-line options override its fields::

    torchrun --nproc-per-node 8 -m torchtitan.train --module k3infra.titan --config k3_mini \\
        --parallelism.expert_parallel_degree 8 --training.steps 300
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from k3infra.model import K3Config
from k3infra.titan.components import K3CorpusTokenizer, K3Optimizers, K3PackedDataLoader
from k3infra.titan.model import K3TitanModel
from k3infra.titan.parallelize import parallelize_k3, register_k3_hooks

__all__ = ["k3_debug", "k3_mini", "model_registry"]


def model_registry(flavor: str = "k3-debug", **overrides) -> ModelSpec:
    """The ``ModelSpec`` of preset ``flavor`` (``k3``, ``k3-mini``, ``k3-debug``), `K3Config` fields replaced by
    ``overrides``: FSDP2 + MoonEP + activation checkpointing (`parallelize_k3`), QK-Clip and Quantile Balancing
    after each optimizer step (`register_k3_hooks`); no pipelining function (PP is not provided)."""
    model = K3TitanModel.Config(preset=flavor, overrides=dict(overrides))
    model.k3_config()  # fail here on a bad preset or field
    return ModelSpec(name="k3", flavor=flavor, model=model, parallelize_fn=parallelize_k3, pipelining_fn=None,
                     post_optimizer_build_fn=register_k3_hooks, state_dict_adapter=None)


def _trainer_config(spec: ModelSpec, *, lr: float, seq_len: int, rows: int, steps: int, param_dtype: str,
                    ac, dump_folder: str) -> Trainer.Config:
    vocab = K3Config.from_preset(spec.flavor, **spec.model.overrides).vocab_size
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path="",
        dump_folder=dump_folder,
        tokenizer=K3CorpusTokenizer.Config(vocab_size=vocab),
        dataloader=K3PackedDataLoader.Config(),
        optimizer=K3Optimizers.Config(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=max(1, steps // 100), decay_type="cosine",
                                                  min_lr_factor=0.1),
        loss=CrossEntropyLoss.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        training=TrainingConfig(local_batch_size=rows, seq_len=seq_len, steps=steps, max_norm=1.0,
                                mixed_precision_param=param_dtype, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=ac,
    )


def k3_debug() -> Trainer.Config:
    """k3-debug: 8 rows × 64 tokens per rank, 60 steps, fp32, no activation checkpointing (a CPU run)."""
    return _trainer_config(model_registry("k3-debug"), lr=2e-2, seq_len=64, rows=8, steps=60,
                           param_dtype="float32", ac=None, dump_folder="./outputs/k3-debug")


def k3_mini() -> Trainer.Config:
    """k3-mini on GPUs: 4 rows × 4096 tokens per rank, 300 steps, bf16 parameters in compute, full activation
    checkpointing, FlashKDA."""
    return _trainer_config(model_registry("k3-mini", kda_backend="flashkda"), lr=3e-3, seq_len=4096, rows=4,
                           steps=300, param_dtype="bfloat16", ac=FullAC.Config(), dump_folder="./outputs/k3-mini")
