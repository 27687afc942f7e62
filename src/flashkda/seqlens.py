"""Host copies of ``cu_seqlens``, kept per tensor so that repeated calls with the same batch never wait for the device.

Reading a CUDA ``cu_seqlens`` on the host (to validate it, or to size the training path's chunked layout) drains
the device queue; in a training step that costs the whole launch latency of the backward, since the host can no
longer run ahead of the device. fla caches what it derives from ``cu_seqlens`` by tensor identity for the same
reason. Here a copy is reused while the same tensor object comes back unmodified (its ``_version`` unchanged);
callers that build a new ``cu_seqlens`` every step pass ``cu_seqlens_cpu`` instead.

Tensors made under ``torch.inference_mode`` (a serving engine's batch metadata) have no modification counter. They
are cached only together with their CPU copy (``witness``): per tensor object, storage and the copy's values, so
the model's layers that share one ``cu_seqlens`` read it once and build its layout once. Without the copy nothing is
kept: a serving engine may update one persistent ``cu_seqlens`` buffer in place every step (CUDA graphs need fixed
addresses), and no key would notice. The price: an inference tensor changed in place while its CPU copy stays the
same (breaking the copy's contract) is not noticed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["IdentityCache", "host_cu_seqlens"]


class IdentityCache:
    """The last ``size`` values computed from tensors, looked up by the tensor object (not its contents) and its
    in-place modification counter, plus any extra hashable key parts. Inference tensors have no such counter:
    values computed from one are kept only when the call names its CPU copy (``witness``), and are looked up by the
    tensor object, its storage address and the copy's values."""

    def __init__(self, size: int = 4):
        self.size = size
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, Any]] = OrderedDict()

    @staticmethod
    def _key(tensor: torch.Tensor, key: tuple, witness: torch.Tensor | None) -> tuple | None:
        if not tensor.is_inference():
            return (id(tensor), tensor._version, *key)
        if witness is None:  # no modification counter and nothing to check the contents by: never cached
            return None
        return (id(tensor), tensor.data_ptr(), str(witness.dtype), witness.numpy().tobytes(), *key)

    def get(self, tensor: torch.Tensor, *key, witness: torch.Tensor | None = None) -> Any:
        return self._get(tensor, self._key(tensor, key, witness))

    def put(self, tensor: torch.Tensor, value: Any, *key, witness: torch.Tensor | None = None) -> Any:
        return self._put(tensor, self._key(tensor, key, witness), value)

    def get_or_make(self, tensor: torch.Tensor, make: Callable[[], Any], *key,
                    witness: torch.Tensor | None = None) -> Any:
        """The kept value for ``tensor`` (and ``key``, ``witness``), else ``make()``, kept."""
        full = self._key(tensor, key, witness)
        value = self._get(tensor, full)
        return self._put(tensor, full, make()) if value is None else value

    def _get(self, tensor: torch.Tensor, full: tuple | None) -> Any:
        entry = None if full is None else self._entries.get(full)
        if entry is None or entry[0] is not tensor:
            return None
        self._entries.move_to_end(full)
        return entry[1]

    def _put(self, tensor: torch.Tensor, full: tuple | None, value: Any) -> Any:
        if full is None:
            return value
        # the entry holds the tensor itself, so its id cannot be reused by another tensor while cached
        self._entries[full] = (tensor, value)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


_HOST = IdentityCache()


def host_cu_seqlens(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None, *,
                    witness: torch.Tensor | None = None) -> torch.Tensor:
    """``cu_seqlens`` on the host, int64: ``cu_seqlens_cpu`` when given, else a copy made once per tensor object.

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64 cumulative lengths, on any device.
        cu_seqlens_cpu: its CPU copy, if the caller has one (validated by ``flashkda.checks``): returned as is.
        witness: a CPU copy the caller has not validated yet (``flashkda.checks`` compares the two): the device is
            still read, but an inference tensor's read is then kept per (tensor, witness values).

    Returns:
        ``[N + 1]`` int64 CPU tensor (do not modify it: it may be shared with later calls).
    """
    if cu_seqlens_cpu is not None:
        return cu_seqlens_cpu.to(torch.int64)
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens.to(torch.int64)
    return _HOST.get_or_make(cu_seqlens, lambda: cu_seqlens.to("cpu", torch.int64), witness=witness)
