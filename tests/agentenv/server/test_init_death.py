"""A sandbox whose init dies: state ``error`` with the reason within a second, resources reclaimed, and the
SDK gets that reason at once, not a timeout."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.agentenv.server.test_auth_errors import call, key_headers


def _wait_state(server, sid, state, within_s):
    deadline = time.monotonic() + within_s
    while True:
        status, body = call(server, "GET", f"/sandboxes/{sid}", None, key_headers(server))
        if body.get("state") == state or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_killed_init_is_reported_and_reclaimed(server, e2b_sandbox):
    from agentenv.runtime import cgroups
    from agentenv.runtime.local import NamespaceBackend

    sid = e2b_sandbox.sandbox_id
    backend = NamespaceBackend(server.home)
    pid = backend.store.read_record(sid).pid
    os.kill(pid, signal.SIGKILL)
    gone_at = time.monotonic()
    body = _wait_state(server, sid, "error", 1.5)
    assert body["state"] == "error", body
    assert time.monotonic() - gone_at < 1.5
    assert "killed" in body["error"] and "OOM" not in body["error"], body
    assert backend.store.read_record(sid) is None
    assert sid not in cgroups.leftover_groups(backend.cgroup_group).get("pids", [])
    start = time.monotonic()
    with pytest.raises(Exception, match="not running") as err:
        e2b_sandbox.commands.run("echo hi", request_timeout=30)
    assert time.monotonic() - start < 5, err.value
