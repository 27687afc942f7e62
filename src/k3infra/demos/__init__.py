"""One module per component, each with `run(device: str) -> list[DemoRow]`.

A component without a module here has not been built yet; `k3infra demo` says so rather than faking output.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoRow:
    """One line of the demo's summary table."""

    component: str
    check: str
    """What was run, e.g. ``chunk_kda T=512 H=4 vs fp64 reference``."""
    result: str
    """What came out, e.g. ``rel. RMS err 2.1e-03`` or ``3.2 ms``."""
    ok: bool
