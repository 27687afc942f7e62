"""`k3infra plan`: parallelism and memory planner for training and serving fine-grained MoE models.

Example::

    >>> from k3infra.plan import load_model, load_cluster, plan_train, TrainWorkload
    >>> result = plan_train(load_model("k3-mini"), load_cluster("1xH200"), TrainWorkload(seq_len=4096))
    >>> result.best.layout.label()
    'TP1 EP1 PP1 CP1 DP1 Z0'
"""

import importlib

_WHERE = {
    "GPUS": "cluster", "ClusterSpec": "cluster", "load_cluster": "cluster",
    "cache_per_token": "memory", "kda_state_bytes": "memory", "serve_memory": "memory", "train_memory": "memory",
    "ModelSpec": "model", "load_model": "model", "model_from_hf": "model", "model_from_k3": "model",
    "Plan": "search", "PlanResult": "search", "SearchOptions": "search", "plan_serve": "search",
    "plan_train": "search", "Layout": "workload", "ServeWorkload": "workload", "TrainWorkload": "workload",
}  # fmt: skip
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    # Lazy: `k3infra --help` must not import transformers (the model configs need it) to build its parser.
    if name not in _WHERE:
        raise AttributeError(f"module 'k3infra.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(f"k3infra.plan.{_WHERE[name]}"), name)
