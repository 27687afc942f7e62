"""A server restart re-adopts live sandboxes, reports the gone ones, and leaks nothing."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

from tests.agentenv.server.conftest import runtime_leftovers, start_server


def _sdk_env(url: str, key: str) -> dict:
    return {"api_url": url, "sandbox_url": url, "api_key": key}


def test_crashed_server_restarts_and_adopts(monkeypatch):
    from e2b import Sandbox
    from e2b.sandbox.commands.command_handle import PtySize

    from agentenv.runtime.local import NamespaceBackend

    for name in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN"):
        monkeypatch.delenv(name, raising=False)
    home = Path(tempfile.mkdtemp(prefix="agentenv-restart-", dir="/tmp"))
    first = second = None
    try:
        first = start_server(home, home / "state", kill_on_exit=False)
        opts = _sdk_env(first.url, first.api_key)
        keep = Sandbox.create(timeout=120, **opts)
        keep.files.write("/tmp/survives.txt", "yes")
        ticker = keep.commands.run("for i in $(seq 600); do echo tick$i; sleep 0.1; done", background=True)
        term = keep.pty.create(PtySize(rows=24, cols=80))
        lost = Sandbox.create(timeout=120, **opts)
        first.stop(signal.SIGKILL)  # a crash: no clean-up at all
        NamespaceBackend(home).destroy(lost.sandbox_id)  # dies while no server runs

        second = start_server(home, home / "state", create_key=False)
        ready = second.first_lines[-1]
        assert ready["adopted"] == [keep.sandbox_id]
        assert ready["gone"] == [lost.sandbox_id]
        opts = _sdk_env(second.url, first.api_key)  # keys persist across restarts
        again = Sandbox.connect(keep.sandbox_id, **opts)
        assert again.files.read("/tmp/survives.txt") == "yes"
        assert again.commands.run("echo alive").stdout == "alive\n"
        # processes started before the crash live on in the sandbox's agent: re-attach to both
        assert {ticker.pid, term.pid} <= {p.pid for p in again.commands.list()}
        ticks = ""
        for out, _, _ in again.commands.connect(ticker.pid):
            ticks += out or ""
            if "tick" in ticks:
                break
        assert "tick" in ticks
        again.commands.kill(ticker.pid)
        seen = b""
        shell = again.pty.connect(term.pid)
        again.pty.send_stdin(term.pid, b"echo after-$((40 + 2))\n")
        for _, _, chunk in shell:
            seen += chunk or b""
            if b"after-42" in seen:
                break
        assert b"after-42" in seen
        assert again.pty.kill(term.pid)
        assert [s.sandbox_id for s in Sandbox.list(**opts).next_items()] == [keep.sandbox_id]
        assert Sandbox.kill(lost.sandbox_id, **opts) is False
    finally:
        for srv in (first, second):
            if srv is not None:
                srv.stop()
        left = runtime_leftovers(home)
        NamespaceBackend(home).gc(everything=True)
        shutil.rmtree(home, ignore_errors=True)
    assert second.proc.returncode == 0
    assert left == [], left


def test_sdk_works_from_a_process_that_imports_only_the_sdk(server):
    """The same SDK calls in a fresh interpreter configured only through the three environment variables."""
    import subprocess
    import sys

    script = r'''
import sys
from e2b import Sandbox
from e2b_code_interpreter import Sandbox as CodeSandbox
assert not any(m.startswith("agentenv") for m in sys.modules), "only the SDK may be imported"
sb = Sandbox.create()
lines = []
r = sb.commands.run("echo hi; echo there", on_stdout=lines.append)
assert r.stdout == "hi\nthere\n" and "".join(lines) == r.stdout
h = sb.commands.run("cat", background=True, stdin=True)
sb.commands.send_stdin(h.pid, "in\n"); sb.commands.close_stdin(h.pid)
assert h.wait().stdout == "in\n"
sb.files.write("/tmp/p.txt", "payload")
assert sb.files.read("/tmp/p.txt") == "payload"
assert [e.name for e in sb.files.list("/tmp")] == ["p.txt"]
sb.pause(); sb = Sandbox.connect(sb.sandbox_id)
snap = sb.create_snapshot()
kid = Sandbox.create(snap.snapshot_id)
assert kid.files.read("/tmp/p.txt") == "payload"
kid.kill(); Sandbox.delete_snapshot(snap.snapshot_id); sb.kill()
ci = CodeSandbox.create()
ci.run_code("v = 6 * 7")
assert ci.run_code("v").text == "42"
ci.kill()
print("SDK-OK")
'''
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_") and k != "PYTHONPATH"}
    env.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY=server.api_key)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "SDK-OK"


def test_server_started_with_exit_with_parent_cleans_up_when_orphaned():
    import json
    import subprocess
    import sys
    import time

    from e2b import Sandbox

    from agentenv.runtime.local import NamespaceBackend

    home = Path(tempfile.mkdtemp(prefix="agentenv-orphan-", dir="/tmp"))
    src = str(Path(__file__).resolve().parents[3] / "src")
    launcher = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'agentenv.server', '--home', {str(home)!r}, 'serve', "
        f"'--port', '0', '--exit-with-parent', '--kill-on-exit', '--create-key', 'k', '--state-dir', "
        f"{str(home / 'state')!r}], stdout=subprocess.PIPE, text=True, env={{'PYTHONPATH': {src!r}}})\n"
        "print(p.pid, flush=True); print(p.stdout.readline(), end='', flush=True)\n"
        "print(p.stdout.readline(), end='', flush=True); time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        key = json.loads(parent.stdout.readline())["api_key"]
        url = json.loads(parent.stdout.readline())["url"]
        sb = Sandbox.create(timeout=120, **_sdk_env(url, key))
        assert sb.commands.run("echo up").stdout == "up\n"
        parent.kill()  # the launcher dies without a word to the server
        parent.wait()
        deadline = time.monotonic() + 30
        while Path(f"/proc/{server_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{server_pid}").exists(), "the orphaned server kept running"
        assert runtime_leftovers(home) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        NamespaceBackend(home).gc(everything=True)
        shutil.rmtree(home, ignore_errors=True)


def test_restart_destroys_what_the_dead_server_made_but_never_recorded():
    """A server killed between the runtime's answer and its state save: the runtime's sandbox carries the
    server's tag, nobody got its id, and the next server destroys it."""
    from agentenv import Limits
    from agentenv.runtime.local import NamespaceBackend

    home = Path(tempfile.mkdtemp(prefix="agentenv-unrec-", dir="/tmp"))
    first = second = None
    try:
        first = start_server(home, home / "state", kill_on_exit=False)
        first.stop(signal.SIGKILL)
        backend = NamespaceBackend(home)
        backend.owner = str((home / "state").resolve())  # as the dead server's runtime tagged it
        made = backend.create("host", Limits())
        snap = backend.snapshot(made)
        backend.owner = None
        foreign = backend.create("host", Limits())  # another user of the data directory: not ours to drop

        second = start_server(home, home / "state", create_key=False)
        ready = second.first_lines[-1]
        assert sorted(ready["unrecorded"]) == sorted([made, snap])
        assert runtime_leftovers(home) == [f"sandbox:{foreign}"]
        backend.destroy(foreign)
    finally:
        for srv in (first, second):
            if srv is not None:
                srv.stop()
        NamespaceBackend(home).gc(everything=True)
        shutil.rmtree(home, ignore_errors=True)
