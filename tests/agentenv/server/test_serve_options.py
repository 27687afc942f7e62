"""``agentenv serve`` options: default sandbox limits and the quota of the key it creates."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tests.agentenv.server.conftest import runtime_leftovers, start_server
from tests.agentenv.server.test_auth_errors import assert_e2b_error, call


def test_default_limits_and_created_key_quota_apply():
    home = Path(tempfile.mkdtemp(prefix="agentenv-serve-opts-", dir="/tmp"))
    server = start_server(home, home / "state",
                          extra=("--memory-mb", "300", "--pids", "100", "--key-max-sandboxes", "1"))
    try:
        headers = {"X-API-Key": server.api_key}
        status, first = call(server, "POST", "/v2/sandboxes", {"templateID": "base"}, headers)
        assert status == 201, first
        status, info = call(server, "GET", f"/sandboxes/{first['sandboxID']}", None, headers)
        assert status == 200 and info["memoryMB"] == 300, info
        assert_e2b_error(*call(server, "POST", "/v2/sandboxes", {"templateID": "base"}, headers), 429)
    finally:
        server.stop()
        leftovers = runtime_leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
    assert leftovers == []
