"""MoonEP: balanced expert-parallel dispatch/combine with online redundant experts.

Public API: `Buffer` (layout → dispatch → combine, `Buffer.plan` ahead → `PlannedDispatch`, prefetch_weight /
reduce_grad), `Plan` and `compute_plan` (the on-device planner), `DispatchHandle`/`DispatchOutput`,
`EventOverlap`, `CommError`, and the reference layer `MoELayer` with its `Router`. Importing moonep imports
torch, never triton.
"""

from moonep.buffer import Buffer, DispatchHandle, DispatchOutput, PlannedDispatch
from moonep.errors import CommError
from moonep.event import EventOverlap
from moonep.layer import MoELayer, MoEOutput, Router
from moonep.plan import Plan, compute_plan, route_tokens

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "CommError",
    "DispatchHandle",
    "DispatchOutput",
    "EventOverlap",
    "MoELayer",
    "MoEOutput",
    "Plan",
    "PlannedDispatch",
    "Router",
    "compute_plan",
    "route_tokens",
]
