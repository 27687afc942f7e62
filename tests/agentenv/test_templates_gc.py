"""A template outlives `gc(everything=True)` (and so `agentenv gc --all`): it is rebuilt from its setup."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def test_template_survives_gc_everything(leak_report):
    from agentenv import Sandbox
    from agentenv.runtime.local import NamespaceBackend

    home = Path(tempfile.mkdtemp(prefix="agentenv-tpl-", dir="/tmp"))
    backend = NamespaceBackend(home)
    try:
        backend.template("tpl", setup=["echo ready > /root/t"])
        backend.gc(everything=True)
        with Sandbox.create("tpl", backend=backend) as sb:
            assert sb.files.read("/root/t") == "ready\n"
        with Sandbox.create("tpl", backend=backend) as sb:  # the rebuilt snapshot serves the next one too
            assert sb.files.read("/root/t") == "ready\n"
        assert sum(i.kind == "snapshot" for i in backend.list()) == 1
    finally:
        backend.gc(everything=True)
        left = leak_report(home)
        shutil.rmtree(home, ignore_errors=True)
    assert not any(left.values()), left
