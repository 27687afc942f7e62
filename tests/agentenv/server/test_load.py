"""Load: 256 concurrent stock-SDK clients issue commands for 60 s with no errors."""

from __future__ import annotations

import pytest

from benchmarks.env.server import load

CLIENTS = 256
SECONDS = 60.0
SANDBOXES = 16


@pytest.mark.slow
def test_256_clients_for_60_seconds_without_errors(server):
    from e2b import Sandbox

    opts = {"api_url": server.url, "sandbox_url": server.url, "api_key": server.api_key}
    pool = [Sandbox.create(timeout=600, **opts) for _ in range(SANDBOXES)]
    try:
        result = load(opts, [sb.sandbox_id for sb in pool], CLIENTS, SECONDS)
    finally:
        for sb in pool:
            sb.kill()
    assert result.errors == 0, result.error_samples
    assert result.ok >= CLIENTS  # every client got through at least once on average
    print(f"\n{CLIENTS} clients, {SECONDS:.0f} s: {result.ok} commands, {result.rps:.0f}/s, "
          f"p50 {result.latency.median_ms:.1f} ms, p99 {result.latency.p99_ms:.1f} ms")
