"""What torchtitan 0.3.0 needs from torch that torch 2.13 or 2.11 spells differently or lacks.

- ``torch.distributed.set_timeout(timeout, group)``: torchtitan's trainer shortens every process group's timeout
  with it after the first step; torch 2.11 and 2.13 have it only as the private
  ``distributed_c10d._set_pg_timeout(timeout, group)`` (same arguments), which the public name is aliased to.
- ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.13; absent in 2.11): torchtitan 0.3.0 imports it at
  module level (``torchtitan/distributed/fsdp.py``, ``full_dtensor.py``, which ``torchtitan.trainer`` imports) and
  uses it in annotations and in the mesh resolution of ``spmd_backend`` ``full_dtensor`` / ``spmd_types`` and of
  its own models' FSDP (``fully_shard(dp_mesh_dims=...)``). The K3 spec runs ``partial_dtensor`` with its own
  FSDP call, which never builds one. On a torch without it, a stand-in class makes the imports and annotations
  work and raises ``NotImplementedError`` when constructed: torch 2.11's ``fully_shard`` has no ``dp_mesh_dims``,
  so a path that needs it fails there and then instead of running with other semantics.

`ensure_torch_compat` adds each name only where torch lacks it (a no-op on a torch that has both). It must run
before ``torchtitan.trainer`` or ``torchtitan.distributed.fsdp`` is imported: ``k3infra.titan`` calls it first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ensure_torch_compat"]


class _DataParallelMeshDimsUnavailable:
    """Stand-in for ``torch.distributed.fsdp.DataParallelMeshDims`` on a torch without it (torch 2.11).

    Importable and usable in annotations (``DataParallelMeshDims | None``); constructing it raises, because that
    torch's ``fully_shard`` cannot shard over named dimensions of a larger SPMD mesh.
    """

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(
            f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims (fully_shard(dp_mesh_dims="
            "...)), which torchtitan's full_dtensor/spmd_types backends and its own models' FSDP need; use "
            "parallelism.spmd_backend=partial_dtensor (the K3 spec's default) or a torch that has it (2.13)"
        )


def ensure_torch_compat() -> None:
    """Alias ``torch.distributed.set_timeout`` and stand in for ``torch.distributed.fsdp.DataParallelMeshDims``
    where torch lacks them (see the module docstring); idempotent."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = _DataParallelMeshDimsUnavailable
