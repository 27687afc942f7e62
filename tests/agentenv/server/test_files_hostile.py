"""Reading what is not a regular file through the E2B SDK: a clear error at once, the agent stays up."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path", ["/dev/zero", "/tmp/fifo"], ids=["dev-zero", "fifo"])
def test_sdk_read_of_a_non_regular_file_is_a_clear_error(e2b_sandbox, path):
    from e2b.exceptions import SandboxException

    bg = e2b_sandbox.commands.run("sleep 600", background=True)
    e2b_sandbox.commands.run("mkfifo /tmp/fifo")
    with pytest.raises(SandboxException, match="not a regular file"):
        e2b_sandbox.files.read(path, format="bytes", request_timeout=20)
    assert e2b_sandbox.commands.run("echo alive").stdout == "alive\n"
    assert bg.pid in [p.pid for p in e2b_sandbox.commands.list()]
    bg.kill()
