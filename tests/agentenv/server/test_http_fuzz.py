"""A CI-sized HTTP fuzz of the control plane from its OpenAPI description (the benchmark sends >= 10,000)."""

from __future__ import annotations

import pytest

pytest.importorskip("schemathesis")


def test_generated_requests_never_get_a_5xx(server):
    from benchmarks.env.http_fuzz import fuzz

    report = fuzz(server.url, server.api_key, 300, seed=1)
    assert report.requests == 300
    assert report.server_errors == []
    assert report.server_alive and report.witness_alive
    assert len(report.statuses) > 3  # the generator reached past the auth check
