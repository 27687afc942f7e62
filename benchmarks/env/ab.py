"""Old vs new code of the server and RL paths, interleaved in one window of the shared machine.

The dev machine's load moves run to run by more than most changes, so a before/after claim needs both trees
measured in the same minutes. This script exports two git revisions (``git archive`` of ``src/`` into a
temporary directory, the working tree untouched), then alternates them ``--rounds`` times:

- ``server-<C>clients``: `agentenv serve` from the tree, 32 sandboxes, C stock-SDK clients looping
  ``commands.run("true")`` for ``--seconds`` (the load generator and CPU accounting of
  `benchmarks.env.server.load`, the same for both trees): calls/s, p50/p99 and CPU per call by process.
- ``rl-<N>envs``: a server from the tree in its own process and the tree's `agentenv.rl` client in another,
  N environments stepping back to back (``--rl-steps`` each), then paced at ``--rl-rate`` calls/s for
  ``--seconds`` (`benchmarks.env.rl`'s cases): calls/s, p99, client and server CPU per call, paced p50/p99.

Run: ``python -m benchmarks.env.ab --old fac1ff4 [--new HEAD]`` (root, ~4 minutes with the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks.harness import Row, write_results

ROOT = Path(__file__).resolve().parents[2]

_RL_CHILD = r"""
import asyncio, json, os, shutil, subprocess, sys, tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
sys.path.insert(0, sys.argv[1])  # the current tree's benchmark helpers; agentenv comes from PYTHONPATH
import benchmarks.env.rl as rl
from agentenv.rl import RemoteProvider
from agentenv.rl.pool import percentile
from agentenv.runtime.local import NamespaceBackend
n, steps, rate, seconds = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
serve = '''
import json, signal, sys
from agentenv.limits import Limits
from agentenv.server import Server
from agentenv.server.auth import Quota
s = Server(port=0, state_dir=sys.argv[1] + "/state", home=sys.argv[1] + "/rt", limits=Limits(memory_mb=8192, pids=4096))
print(json.dumps({"key": s.keys.create("ab", Quota(max_sandboxes=0))[0], "url": s.url}), flush=True)
def stop(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, stop)
try:
    s.serve_forever()
except KeyboardInterrupt:
    pass
finally:
    s.registry.stop(kill_all=True)
'''
home = Path(tempfile.mkdtemp(prefix="agentenv-ab-rl-", dir="/tmp"))
proc = subprocess.Popen([sys.executable, "-c", serve, str(home)], stdout=subprocess.PIPE, text=True)
info = json.loads(proc.stdout.readline())
executor = ThreadPoolExecutor(64)
provider = RemoteProvider(info["url"], info["key"], connections=64, request_timeout_s=300)
try:
    asyncio.run(rl._env_case(provider, 16, 3, executor))
    wall, lat, errors, cpu = asyncio.run(rl._env_case(provider, n, steps, executor, proc.pid))
    pwall, plat, perrors = asyncio.run(rl._paced_case(provider, n, rate, seconds, executor))
    print(json.dumps({"calls_per_s": len(lat) / wall, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                      "client_cpu_ms_per_call": cpu[0] * 1e3 / len(lat),
                      "server_cpu_ms_per_call": cpu[1] * 1e3 / len(lat),
                      "paced_calls_per_s": len(plat) / pwall, "paced_p50_ms": percentile(plat, 50),
                      "paced_p99_ms": percentile(plat, 99), "errors": errors + perrors}))
finally:
    provider.close()
    executor.shutdown()
    proc.terminate()
    proc.wait()
    NamespaceBackend(home / "rt").gc(everything=True)
    shutil.rmtree(home, ignore_errors=True)
"""


def export(rev: str, into: Path) -> Path:
    """``src/`` of git revision `rev` unpacked under `into`; returns that ``src`` directory."""
    tar = into / "src.tar"
    with tar.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], stdout=f, check=True)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def server_case(src: Path, clients: int, seconds: float) -> dict:
    """Throughput and CPU per call of `commands.run("true")` against the server of tree `src`."""
    from e2b import Sandbox

    from benchmarks.env.server import load, start_server

    home = Path(tempfile.mkdtemp(prefix="agentenv-ab-srv-", dir="/tmp"))
    server = start_server(home, src, "ab")
    try:
        pool = [Sandbox.create(timeout=3600, **server.sdk_opts()) for _ in range(32)]
        for sb in pool:
            sb.commands.run("true")
        result = load(server.sdk_opts(), [sb.sandbox_id for sb in pool], clients, seconds, server_pid=server.proc.pid)
        for sb in pool:
            sb.kill()
    finally:
        server.stop()
        from agentenv.runtime.local import NamespaceBackend

        NamespaceBackend(home).gc(everything=True)  # the server's runtime seed outlives the server otherwise
        shutil.rmtree(home, ignore_errors=True)
    out = {"calls_per_s": result.rps, "errors": result.errors, "p50_ms": result.latency.median_ms,
           "p99_ms": result.latency.p99_ms}
    out.update({f"cpu_ms_{k}": v * 1e3 / max(1, result.ok) for k, v in result.cpu_s.items()})
    return out


def rl_case(src: Path, envs: int, steps: int, rate: float, seconds: float) -> dict:
    """RL steps through the server, both sides from tree `src` (a child process imports that tree)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", _RL_CHILD, str(ROOT), str(envs), str(steps), str(rate),
                          str(seconds)], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"RL case failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="git revision of the baseline")
    parser.add_argument("--new", default="HEAD", help="git revision measured against it (default HEAD)")
    parser.add_argument("--rounds", type=int, default=2, help="old/new alternations")
    parser.add_argument("--clients", type=int, default=64, help="stock-SDK clients of the server case")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds of load per server and paced case")
    parser.add_argument("--rl-envs", type=int, default=256)
    parser.add_argument("--rl-steps", type=int, default=20, help="saturated steps per environment")
    parser.add_argument("--rl-rate", type=float, default=1000.0, help="offered calls/s of the paced RL case")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("the A/B benchmark needs root (the sandbox runtime)")
    work = Path(tempfile.mkdtemp(prefix="agentenv-ab-", dir="/tmp"))
    rows: list[Row] = []
    try:
        trees = {}
        for label, rev in (("old", args.old), ("new", args.new)):
            sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True,
                                 text=True, check=True).stdout.strip()
            (work / label).mkdir()
            trees[label] = (sha, export(rev, work / label))
        for i in range(args.rounds):
            for label, (sha, src) in trees.items():
                load_1m = round(os.getloadavg()[0], 1)
                srv = server_case(src, args.clients, args.seconds)
                rows.append(Row(f"server-{args.clients}clients {label} r{i}", "-", None, srv.pop("p50_ms"),
                                {"tree": sha, "round": i, "loadavg_1m": load_1m, "seconds": args.seconds},
                                srv, 'stock SDK commands.run("true"); cpu_ms_*: CPU per call by process'))
                rl = rl_case(src, args.rl_envs, args.rl_steps, args.rl_rate, args.seconds)
                rows.append(Row(f"rl-{args.rl_envs}envs {label} r{i}", "-", None, rl.pop("p50_ms"),
                                {"tree": sha, "round": i, "loadavg_1m": round(os.getloadavg()[0], 1),
                                 "paced_rate": args.rl_rate}, rl,
                                "saturated, then paced; server and client of the same tree"))
                print(f"{rows[-2].case:30s} {srv}\n{rows[-1].case:30s} {rl}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = write_results("env-ab", rows, title="AgentEnv server and RL: old vs new code, interleaved",
                         results_dir=args.results_dir, markdown=args.markdown)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
