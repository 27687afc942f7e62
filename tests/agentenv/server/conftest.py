"""Fixtures for the HTTP server: a real `agentenv serve` subprocess on a free loopback port, the stock SDKs
pointed at it through the three environment variables, sandboxes killed in finalizers, and a leak check.

The server subprocess gets its own runtime data directory and state directory; at the end of the session it
is stopped with SIGTERM (``--kill-on-exit``), and the runtime must hold no sandbox or snapshot afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class ServerProc:
    url: str
    api_key: str
    key_id: str
    home: Path
    state_dir: Path
    proc: subprocess.Popen
    first_lines: list[dict]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(home: Path, state_dir: Path, *, kill_on_exit: bool = True, create_key: bool = True,
                 extra: tuple[str, ...] = ()) -> ServerProc:
    """Start ``python -m agentenv.server`` on a free port (`extra`: more ``serve`` options); wait until ready."""
    from tests.agentenv.conftest import SESSION_HOMES

    SESSION_HOMES.add(os.path.realpath(home))
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "agentenv.server", "--home", str(home), "serve", "--port", "0",
           "--exit-with-parent", "--state-dir", str(state_dir)]
    if kill_on_exit:
        cmd.append("--kill-on-exit")
    if create_key:
        cmd += ["--create-key", "tests"]
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited early: {proc.stderr.read()[-3000:]}")
        lines.append(json.loads(line))
        if "url" in lines[-1]:
            break
    key = next((x for x in lines if "api_key" in x), {"api_key": "", "key_id": ""})
    return ServerProc(lines[-1]["url"], key["api_key"], key["key_id"], home, state_dir, proc, lines)


def runtime_leftovers(home: Path) -> list[str]:
    """Sandboxes and snapshots the runtime in `home` still holds (seeds are the runtime's own zygotes)."""
    from agentenv.runtime.local import NamespaceBackend

    return [f"{i.kind}:{i.id}" for i in NamespaceBackend(home).list() if i.kind in ("sandbox", "snapshot")]


@pytest.fixture(scope="session")
def server_home():
    path = Path(tempfile.mkdtemp(prefix="agentenv-srv-", dir="/tmp"))
    yield path
    from agentenv.runtime.local import NamespaceBackend

    try:
        NamespaceBackend(path).gc(everything=True)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def server(server_home):
    """The session's server; stopping it must leave no sandbox behind."""
    srv = start_server(server_home, server_home / "server-state")
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, srv.proc.stderr.read()[-3000:]
    assert runtime_leftovers(server_home) == []
    assert "Traceback" not in srv.proc.stderr.read()


@pytest.fixture(scope="session", autouse=False)
def e2b_env(server):
    """E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set for the stock SDKs (restored afterwards)."""
    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")
    saved = {n: os.environ.get(n) for n in names}
    os.environ.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY=server.api_key)
    os.environ.pop("E2B_DOMAIN", None)
    yield server
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def e2b_sandbox(e2b_env):
    """A stock `e2b.Sandbox` on our server, killed when the test ends."""
    from e2b import Sandbox

    sb = Sandbox.create(timeout=120)
    yield sb
    sb.kill()


@pytest.fixture
def kill_later(e2b_env):
    """Register sandbox ids (or SDK sandboxes) to kill at the end of the test."""
    from e2b import Sandbox

    ids: list[str] = []

    def add(sb) -> None:
        ids.append(getattr(sb, "sandbox_id", sb))

    yield add
    for sid in ids:
        Sandbox.kill(sid)


@pytest.fixture(scope="session")
def second_server():
    """Another server with its own runtime directory (for spreading sandboxes over servers)."""
    from agentenv.runtime.local import NamespaceBackend

    home = Path(tempfile.mkdtemp(prefix="agentenv-srv2-", dir="/tmp"))
    srv = start_server(home, home / "server-state")
    yield srv
    srv.stop()
    try:
        assert runtime_leftovers(home) == []
    finally:
        NamespaceBackend(home).gc(everything=True)
        shutil.rmtree(home, ignore_errors=True)
