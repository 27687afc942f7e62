"""Soak fault: the HTTP server SIGKILLed at a random instant while a client forks a sandbox through it.

A fresh `agentenv serve` on its own data directory: create a sandbox, write a file, fork it over and over
from a client thread, SIGKILL the server 0-300 ms in, start it again on the same state. The restarted server
must adopt the sandbox (answering with its file), and every sandbox it lists must answer with that file
(a fork either whole or undone: the runtime's `gc` and the owner-tagged records at start); after a
``--kill-on-exit`` stop, nothing of that data directory may be left (processes, mounts, cgroups, layers).
"""

from __future__ import annotations

import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path


def _forker(url: str, key: str, sid: str, stop: threading.Event) -> None:
    from agentenv.client import Client

    client = Client(url, key, timeout=30)
    while not stop.is_set():
        try:
            client.fork(sid, 2)
        except Exception:  # noqa: BLE001 - the server was killed under us: that is the fault
            return


def kill_server_mid_fork(report) -> None:
    """Inject the fault once; count adoption, whole/broken forks and leftovers in `report` (a
    `benchmarks.env.soak.Report`: failures are listed with their detail)."""
    from agentenv.client import Client
    from agentenv.runtime.local import NamespaceBackend
    from tests.agentenv.conftest import leftovers
    from tests.agentenv.server.conftest import start_server

    home = Path(tempfile.mkdtemp(prefix="agentenv-soak-srv-", dir="/tmp"))
    first = second = None
    stop = threading.Event()
    try:
        first = start_server(home, home / "state", kill_on_exit=False)
        client = Client(first.url, first.api_key, timeout=30)
        sb = client.create(timeout=600)
        client.step(sb, {"type": "bash", "command": "echo hi > /root/f"})
        thread = threading.Thread(target=_forker, args=(first.url, first.api_key, sb.id, stop))
        thread.start()
        delay = random.uniform(0.0, 0.3)
        report.note(kill_after_s=round(delay, 4))
        time.sleep(delay)
        first.stop(signal.SIGKILL)
        stop.set()
        thread.join()
        report["kill_server_mid_fork:sent"] += 1
        report.at(phase="fault: restart the server")
        second = start_server(home, home / "state", create_key=False)
        report.at(phase="fault: check the restarted server")
        adopted = second.first_lines[-1].get("adopted", [])
        if sb.id in adopted:
            report["kill_server_mid_fork:sandbox_adopted"] += 1
        else:
            report.fail("kill_server_mid_fork:sandbox_lost", None, sandbox=sb.id, server_said=second.first_lines)
        client = Client(second.url, first.api_key, timeout=30)
        for model in client.list():
            sid = model.get("sandboxID") or model.get("sandbox_id")
            out = error = None
            try:
                out = client.step(sid, {"type": "bash", "command": "cat /root/f"}).observation.get("stdout")
            except Exception as e:  # noqa: BLE001 - counted: a sandbox the server lists but cannot reach
                error = e
            kind = "parent" if sid == sb.id else "child"
            if out == "hi\n":
                report[f"kill_server_mid_fork:{kind}_answers"] += 1
            else:
                report.fail(f"kill_server_mid_fork:{kind}_broken", error, sandbox=sid, stdout=out)
    finally:
        stop.set()
        for srv in (first, second):
            if srv is not None:
                srv.stop()
        NamespaceBackend(home).gc(everything=True)
        left = leftovers(home)
        if any(left.values()):
            report.fail("kill_server_mid_fork:leaked", None, leftovers=left)
        shutil.rmtree(home, ignore_errors=True)
