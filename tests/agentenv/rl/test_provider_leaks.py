"""`LocalProvider` as a context manager destroys every sandbox and snapshot it made, and its own seeds."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def test_local_provider_exit_destroys_what_it_made(leak_report):
    from agentenv.rl import LocalProvider

    home = Path(tempfile.mkdtemp(prefix="agentenv-prov-", dir="/tmp"))
    try:
        with LocalProvider(home=str(home)) as provider:
            handle = provider.create("host")
            handle.write("/root/x", b"1")
            kids = handle.fork(2)
            snap = handle.snapshot()
            restored = provider.restore(snap)
            assert restored.read("/root/x") == b"1"
            kids[0].destroy()  # one destroyed by hand: the provider must not trip over it
        left = leak_report(home)
        assert not any(left.values()), f"LocalProvider left behind: {left}"
    finally:
        from agentenv.runtime.local import NamespaceBackend

        NamespaceBackend(home).gc(everything=True)
        shutil.rmtree(home, ignore_errors=True)
