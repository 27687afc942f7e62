"""`k3infra plan`: parallelism and memory planner for training and serving fine-grained MoE models.

Example::

    >>> from k3infra.plan import load_model, load_cluster, plan_train, TrainWorkload
    >>> result = plan_train(load_model("k3-mini"), load_cluster("1xH200"), TrainWorkload(seq_len=4096))
    >>> result.best.layout.label()
    'TP1 EP1 PP1 CP1 DP1 Z0'
"""

from k3infra.plan.cluster import GPUS, ClusterSpec, load_cluster
from k3infra.plan.memory import cache_per_token, kda_state_bytes, serve_memory, train_memory
from k3infra.plan.model import ModelSpec, load_model, model_from_hf, model_from_k3
from k3infra.plan.search import Plan, PlanResult, SearchOptions, plan_serve, plan_train
from k3infra.plan.workload import Layout, ServeWorkload, TrainWorkload

__all__ = [
    "GPUS", "ClusterSpec", "Layout", "ModelSpec", "Plan", "PlanResult", "SearchOptions", "ServeWorkload",
    "TrainWorkload", "cache_per_token", "kda_state_bytes", "load_cluster", "load_model", "model_from_hf",
    "model_from_k3", "plan_serve", "plan_train", "serve_memory", "train_memory",
]  # fmt: skip
