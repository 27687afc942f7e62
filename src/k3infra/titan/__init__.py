"""The K3 model registered with torchtitan: ``--module k3infra.titan --config k3_debug|k3_mini``.

`model_registry` gives the ``ModelSpec`` (model config `K3TitanModel.Config`, ``parallelize_fn`` `parallelize_k3`:
FSDP2/HSDP + MoonEP + activation checkpointing; ``post_optimizer_build_fn`` `register_k3_hooks`: QK-Clip and
Quantile Balancing); `config_registry` the ready ``Trainer.Config`` functions. `use_cpu` runs torchtitan's
trainer on the CPU. Importing this package first fills in the torch names torchtitan 0.3.0 imports or calls that
this torch lacks (`compat.ensure_torch_compat`); on torch 2.11 it must be imported before ``torchtitan.trainer``
(the entry points ``python -m k3infra.titan.train`` and ``k3infra.titan.train_cpu`` do; ``python -m torchtitan.train``
imports the trainer first). Needs ``torchtitan`` (the ``titan`` extra); importing this package imports it.
"""

from k3infra.titan.compat import ensure_torch_compat

ensure_torch_compat()  # before any torchtitan import: torchtitan.trainer imports names torch 2.11 lacks

from k3infra.titan.components import K3CorpusTokenizer, K3Optimizers, K3PackedDataLoader  # noqa: E402
from k3infra.titan.config_registry import k3_debug, k3_mini, model_registry  # noqa: E402
from k3infra.titan.cpu import use_cpu  # noqa: E402
from k3infra.titan.model import K3TitanModel  # noqa: E402
from k3infra.titan.parallelize import parallelize_k3, register_k3_hooks  # noqa: E402

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
