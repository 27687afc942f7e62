"""Host copies of ``cu_seqlens``, kept per tensor so that repeated calls with the same batch never wait for the device.

Reading a CUDA ``cu_seqlens`` on the host (to validate it, or to size the training path's chunked layout) drains
the device queue; in a training step that costs the whole launch latency of the backward, since the host can no
longer run ahead of the device. fla caches what it derives from ``cu_seqlens`` by tensor identity for the same
reason. Here a copy is reused while the same tensor object comes back unmodified (its ``_version`` unchanged);
callers that build a new ``cu_seqlens`` every step pass ``cu_seqlens_cpu`` instead.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["IdentityCache", "host_cu_seqlens"]


class IdentityCache:
    """The last ``size`` values computed from tensors, looked up by the tensor object (not its contents) and its
    in-place modification counter, plus any extra hashable key parts. Inference tensors have no such counter, so
    values computed from them are never kept."""

    def __init__(self, size: int = 4):
        self.size = size
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, Any]] = OrderedDict()

    def get(self, tensor: torch.Tensor, *key) -> Any:
        if tensor.is_inference():  # no modification counter: never served from the cache
            return None
        full = (id(tensor), tensor._version, *key)
        entry = self._entries.get(full)
        if entry is None or entry[0] is not tensor:
            return None
        self._entries.move_to_end(full)
        return entry[1]

    def put(self, tensor: torch.Tensor, value: Any, *key) -> Any:
        if tensor.is_inference():
            return value
        # the entry holds the tensor itself, so its id cannot be reused by another tensor while cached
        self._entries[(id(tensor), tensor._version, *key)] = (tensor, value)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


_HOST = IdentityCache()


def host_cu_seqlens(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """``cu_seqlens`` on the host, int64: ``cu_seqlens_cpu`` when given, else a copy made once per tensor object.

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64 cumulative lengths, on any device.
        cu_seqlens_cpu: its CPU copy, if the caller has one (validated by ``flashkda.checks``).

    Returns:
        ``[N + 1]`` int64 CPU tensor (do not modify it: it may be shared with later calls).
    """
    if cu_seqlens_cpu is not None:
        return cu_seqlens_cpu.to(torch.int64)
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens.to(torch.int64)
    host = _HOST.get(cu_seqlens)
    if host is None:
        host = _HOST.put(cu_seqlens, cu_seqlens.to("cpu", torch.int64))
    return host
