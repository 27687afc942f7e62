"""The K3 model registered with torchtitan: ``--module k3infra.titan --config k3_debug|k3_mini``.

`model_registry` gives the ``ModelSpec`` (model config `K3TitanModel.Config`, ``parallelize_fn`` `parallelize_k3`:
FSDP2/HSDP + MoonEP + activation checkpointing; ``post_optimizer_build_fn`` `register_k3_hooks`: QK-Clip and
Quantile Balancing); `config_registry` the ready ``Trainer.Config`` functions. `use_cpu` runs torchtitan's
trainer on the CPU. Importing `config_registry` aliases ``torch.distributed.set_timeout`` on a torch without
it (`compat.ensure_torch_compat`). Needs ``torchtitan`` (the ``titan`` extra); importing this package imports it.
"""

from k3infra.titan.components import K3CorpusTokenizer, K3Optimizers, K3PackedDataLoader
from k3infra.titan.config_registry import k3_debug, k3_mini, model_registry
from k3infra.titan.cpu import use_cpu
from k3infra.titan.model import K3TitanModel
from k3infra.titan.parallelize import parallelize_k3, register_k3_hooks

__all__ = [
    "K3CorpusTokenizer",
    "K3Optimizers",
    "K3PackedDataLoader",
    "K3TitanModel",
    "k3_debug",
    "k3_mini",
    "model_registry",
    "parallelize_k3",
    "register_k3_hooks",
    "use_cpu",
]
