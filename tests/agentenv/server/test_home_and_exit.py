"""``--home`` decides where keys and server state live; ``serve --kill-on-exit`` leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.agentenv.conftest import leftovers
from tests.agentenv.server.conftest import ROOT, start_server
from tests.agentenv.server.test_auth_errors import call


def test_keys_and_server_state_follow_home(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTENV_HOME", "AGENTENV_SERVER_STATE")}
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run([sys.executable, "-m", "agentenv.server", "--home", str(tmp_path), "keys", "create", "k"],
                         capture_output=True, text=True, check=True, env=env)
    key_id = json.loads(out.stdout)["key_id"]
    assert key_id in (tmp_path / "server").joinpath("keys.json").read_text()
    listed = subprocess.run([sys.executable, "-m", "agentenv.server", "--home", str(tmp_path), "keys", "list"],
                            capture_output=True, text=True, check=True, env=env)
    assert key_id in listed.stdout

    from agentenv.server.app import Server

    server = Server(port=0, home=tmp_path)
    try:
        assert server.state_dir == tmp_path / "server"
    finally:
        server.stop()


def test_serve_kill_on_exit_removes_sandboxes_and_seeds():
    home = Path(tempfile.mkdtemp(prefix="agentenv-exit-", dir="/tmp"))
    try:
        server = start_server(home, home / "state")
        status, body = call(server, "POST", "/sandboxes", {"templateID": "base"}, {"X-API-Key": server.api_key})
        assert status == 201, body
        server.stop()
        assert server.proc.returncode == 0
        left = leftovers(home)
        assert not any(left.values()), f"serve --kill-on-exit left: {left}"
    finally:
        from agentenv.runtime.local import NamespaceBackend

        NamespaceBackend(home).gc(everything=True)
        shutil.rmtree(home, ignore_errors=True)
