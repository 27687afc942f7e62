"""Ray integration on a real local cluster: two nodes started with `ray start`, an env actor on each."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'k3-infra[rl]')")

from agentenv.rl import ScriptedPolicy, load_suite  # noqa: E402
from agentenv.rl.policy import tool_call  # noqa: E402
from agentenv.rl.raypool import RayEnvFleet  # noqa: E402

pytestmark = pytest.mark.multiproc
SRC = str(Path(__file__).resolve().parents[3] / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(*args: str) -> subprocess.Popen:
    exe = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": SRC}
    return subprocess.Popen([exe, "start", "--block", "--num-cpus=1", "--disable-usage-stats", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def _session(sid: int) -> list[int]:
    """Pids in session `sid`: a `ray start` and all it started (its workers run in process groups of their own)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.getsid(int(name)) == sid:
                pids.append(int(name))
        except OSError:  # gone meanwhile
            continue
    return pids


def _stop(procs: list[subprocess.Popen], grace_s: float = 2.0) -> None:
    """SIGTERM every process of the nodes' sessions, SIGKILL what is left after `grace_s` (`ray start --block`
    does not act on SIGTERM within 15 s here), until the sessions are empty."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            for pid in _session(proc.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 30.0)
        while time.monotonic() < deadline:
            for proc in procs:
                proc.poll()
            if not any(_session(proc.pid) for proc in procs):
                return
            time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster():
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray-rl-", dir="/tmp")
    procs = [_ray_start("--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}")]
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    pytest.fail("ray head did not come up")
                time.sleep(0.5)
        procs.append(_ray_start(f"--address=127.0.0.1:{port}"))
        ray.init(address=f"127.0.0.1:{port}", runtime_env={"env_vars": {"PYTHONPATH": SRC}},
                 logging_level="WARNING", log_to_driver=False)
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if time.monotonic() > deadline:
                pytest.fail("the second ray node did not join")
            time.sleep(0.5)
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _stop(procs)
        shutil.rmtree(temp, ignore_errors=True)


def test_fleet_needs_ray_initialised():
    assert not ray.is_initialized()
    with pytest.raises(RuntimeError, match="ray.init"):
        RayEnvFleet()


def test_fleet_runs_a_pool_on_both_nodes(cluster):
    fleet = RayEnvFleet(max_envs_per_node=16, max_inflight=8)
    try:
        nodes = fleet.nodes()
        assert len({n["node_id"] for n in nodes}) == 2
        tasks = load_suite() * 2
        results = fleet.run(tasks, ScriptedPolicy)
        assert [r["task_id"] for r in results] == [t.id for t in tasks]
        assert all(r["reward"] == 1.0 for r in results)
        assert {r["node_id"] for r in results} == {n["node_id"] for n in nodes}

        env = fleet.make_env()
        (task,) = load_suite(["prime-sum"])
        obs, info = env.reset(task=task)
        assert obs["content"] == task.instruction
        env.step(task.solution[0])
        env.step(task.solution[1])
        _, reward, terminated, _, _ = env.step(tool_call("submit", answer="5736396"))
        assert terminated and reward == 1.0
        env.close()
        assert sum(m["episodes"] for m in fleet.metrics()) == len(tasks)
    finally:
        fleet.shutdown()
    for node in nodes:  # both "nodes" run on this machine, so their runtime homes can be checked here
        layers = Path(node["home"]) / "layers"
        assert [p.name for p in layers.iterdir() if not p.name.startswith("i")] == []
        shutil.rmtree(node["home"], ignore_errors=True)


