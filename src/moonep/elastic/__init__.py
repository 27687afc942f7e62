"""Elastic expert parallelism: shrink on a rank's death, grow when a rank joins (`ElasticEP`)."""

from moonep.elastic.checkpoint import load_shards, save_shard
from moonep.elastic.elastic_ep import ElasticEP
from moonep.elastic.membership import Membership

__all__ = ["ElasticEP", "Membership", "load_shards", "save_shard"]
