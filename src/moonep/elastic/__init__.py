"""Elastic expert parallelism: shrink on a rank's death, grow when a rank joins (`ElasticEP`); history-aware
placement applied in training (`PlacedMoELayer`)."""

from moonep.elastic.checkpoint import load_shards, save_shard
from moonep.elastic.elastic_ep import ElasticEP
from moonep.elastic.membership import Membership
from moonep.elastic.placed import PlacedMoELayer

__all__ = ["ElasticEP", "Membership", "PlacedMoELayer", "load_shards", "save_shard"]
