"""What torchtitan 0.3.0 needs from torch that torch 2.13 spells differently.

torchtitan's trainer, after the first step, shortens every process group's timeout with
``torch.distributed.set_timeout(timeout, group)``; torch 2.13 has that function only as the private
``distributed_c10d._set_pg_timeout(timeout, group)`` (same arguments). `ensure_torch_compat` adds the public name
when it is missing and changes nothing otherwise.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["ensure_torch_compat"]


def ensure_torch_compat() -> None:
    """Alias ``torch.distributed.set_timeout`` to ``distributed_c10d._set_pg_timeout`` if torch lacks it."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
