"""AgentEnv RL benchmark: tool calls/s and step latency at 64/256/1000 concurrent environments, through the
Python API and through the server, and fork-branching rollouts (1 -> 16) per second.

Run: `k3infra bench env --rl` (the env runner calls `run_rl_bench`) or `python -m benchmarks.env.rl`
(root, cgroup v1). Every case first passes a correctness gate (a suite task solved in-process and through
the server). A burst of restores from a snapshot with small memory/pids limits kills that snapshot (its
restored children are charged to its cgroup until moved), so the server here runs with roomy default limits
(8 GiB, 4096 pids); in-process, `SandboxProvider.template` builds templates with such limits itself.
Baselines in the same run: for the API rows, the same sandboxes driven by the raw SDK
(`Sandbox.python.run`, no environment layer) with the same concurrency; for the server rows, the in-process
API row of the same size; for fork rollouts, 16 fresh resets that re-run the shared prefix.
Each step is one `run_python` tool call (``counter += 1``) on an `AgentEnv`; latency is per step, as seen by
the caller. Two kinds of rows:

- saturated (``api-N``, ``server-N``): every environment steps again as soon as its last step returned (no
  policy time), with ``--inflight`` worker threads. This measures the most tool calls per second; its latency
  is queueing by construction (Little's law: mean latency = N / calls per second, so 256 environments at
  1,000 calls/s wait 256 ms on average whatever the server does).
- paced (``server-N-paced``, for N in ``--rl-paced-envs``): each environment steps on its own clock, one
  step every N / ``--rl-paced-rate`` seconds from a random phase (a policy that takes that long per turn), so
  the offered load is ``--rl-paced-rate`` calls/s in total; the baseline is the in-process API, same pacing.
  This is the step latency a trainer sees at that load; a step that comes due while the previous one still
  runs starts when it returns.

The server runs as its own process (``agentenv serve``, as deployed), so clients and server do not share a
GIL; ``--rl-server-inproc`` serves from a thread of this process instead (the first runs did).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentenv.limits import Limits
from agentenv.rl import AgentEnv, CommandVerifier, LocalProvider, RemoteProvider, TaskSpec, load_suite, rollout
from agentenv.rl.policy import ScriptedPolicy, tool_call
from agentenv.rl.pool import percentile
from agentenv.runtime.local import NamespaceBackend
from benchmarks.harness import Row, write_results

TASK = TaskSpec(id="bench", instruction="count", verifier=CommandVerifier("true"), max_steps=10_000,
                step_timeout_s=60)
STEP = tool_call("run_python", code="counter = globals().get('counter', 0) + 1")


def add_rl_args(parser: argparse.ArgumentParser) -> None:
    """The RL benchmark's options (the env runner adds them next to its `--rl` flag)."""
    parser.add_argument("--rl-envs", default="64,256,1000", help="comma-separated concurrent environment counts")
    parser.add_argument("--rl-steps", type=int, default=10, help="tool calls per environment per case")
    parser.add_argument("--rl-inflight", type=int, default=64, help="worker threads (sandbox calls in flight)")
    parser.add_argument("--rl-fork-reps", type=int, default=5, help="repetitions of the 1 -> 16 fork rollout")
    parser.add_argument("--rl-no-server", action="store_true", help="skip the server rows")
    parser.add_argument("--rl-server-inproc", action="store_true",
                        help="serve from a thread of this process (default: an `agentenv serve` subprocess)")
    parser.add_argument("--rl-paced-rate", type=float, default=1000.0,
                        help="offered tool calls/s of the paced server rows (0 skips them)")
    parser.add_argument("--rl-paced-seconds", type=float, default=10.0, help="duration of a paced row")
    parser.add_argument("--rl-paced-envs", default="256",
                        help="comma-separated environment counts that also get a paced row (the goal's 256)")


def _gate(provider) -> None:
    (task,) = load_suite(["fix-median"])

    async def main():
        async with AgentEnv(provider) as env:
            return await rollout(env, ScriptedPolicy(task), task)

    result = asyncio.run(main())
    if result.reward != 1.0:
        raise SystemExit(f"correctness gate failed on {provider.location}: {result}")


async def _env_case(provider, n: int, steps: int, executor, server_pid: int | None = None
                    ) -> tuple[float, list[float], int, tuple[float, float]]:
    """Saturated stepping; returns (wall s, latencies ms, errors, (client, server) CPU s while stepping)."""
    envs = [AgentEnv(provider, executor=executor) for _ in range(n)]
    await asyncio.gather(*(e.reset(task=TASK) for e in envs))
    latencies: list[float] = []
    errors = 0

    async def drive(env: AgentEnv) -> None:
        nonlocal errors
        for _ in range(steps):
            t0 = time.perf_counter()
            obs, *_ = await env.step(STEP)
            latencies.append((time.perf_counter() - t0) * 1e3)
            errors += obs["error"] is not None

    c0, s0 = time.process_time(), _cpu_s(server_pid)
    start = time.perf_counter()
    await asyncio.gather(*(drive(e) for e in envs))
    wall = time.perf_counter() - start
    cpu = (time.process_time() - c0, _cpu_s(server_pid) - s0)
    await asyncio.gather(*(e.close() for e in envs))
    return wall, latencies, errors, cpu


async def _sdk_case(provider: LocalProvider, n: int, steps: int, executor) -> tuple[float, list[float]]:
    loop = asyncio.get_running_loop()
    snap = provider.template(TASK.image, TASK.setup, TASK.limits)
    handles = await asyncio.gather(*(loop.run_in_executor(executor, provider.restore, snap, TASK.limits)
                                     for _ in range(n)))
    latencies: list[float] = []

    async def drive(handle) -> None:
        for _ in range(steps):
            t0 = time.perf_counter()
            await loop.run_in_executor(executor, handle.sb.python.run, "counter = globals().get('counter', 0) + 1")
            latencies.append((time.perf_counter() - t0) * 1e3)

    start = time.perf_counter()
    await asyncio.gather(*(drive(h) for h in handles))
    wall = time.perf_counter() - start
    await asyncio.gather(*(loop.run_in_executor(executor, h.destroy) for h in handles))
    return wall, latencies


async def _paced_case(provider, n: int, rate: float, seconds: float, executor) -> tuple[float, list[float], int]:
    """`n` environments, each stepping every ``n / rate`` s from a random phase, for `seconds`."""
    envs = [AgentEnv(provider, executor=executor) for _ in range(n)]
    await asyncio.gather(*(e.reset(task=TASK) for e in envs))
    period = n / rate
    rng = random.Random(0)
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter() + 0.5
    end = start + seconds

    async def drive(env: AgentEnv, due: float) -> None:
        nonlocal errors
        while due < end:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            t0 = time.perf_counter()
            obs, *_ = await env.step(STEP)
            latencies.append((time.perf_counter() - t0) * 1e3)
            errors += obs["error"] is not None
            due += period

    await asyncio.gather(*(drive(e, start + rng.random() * period) for e in envs))
    wall = time.perf_counter() - start
    await asyncio.gather(*(e.close() for e in envs))
    return wall, latencies, errors


def _fork_case(provider, reps: int, executor) -> tuple[list[float], list[float]]:
    (task,) = load_suite(["prime-sum"])
    answer = tool_call("submit", answer="5736396")

    async def forked() -> float:
        async with AgentEnv(provider, executor=executor) as env:
            await env.reset(task=task)
            await env.step(task.solution[0])  # the shared prefix: the sieve, in interpreter state
            start = time.perf_counter()
            kids = await env.fork(16)
            results = await asyncio.gather(*(k.step(task.solution[1]) for k in kids))
            finals = await asyncio.gather(*(k.step(answer) for k in kids))
            took = time.perf_counter() - start
            await asyncio.gather(*(k.close() for k in kids))
        assert all(r[0]["content"] == "5736396" for r in results) and all(f[1] == 1.0 for f in finals)
        return took

    async def fresh() -> float:
        envs = [AgentEnv(provider, executor=executor) for _ in range(16)]
        start = time.perf_counter()
        await asyncio.gather(*(e.reset(task=task) for e in envs))
        await asyncio.gather(*(e.step(task.solution[0]) for e in envs))  # each re-runs the prefix
        await asyncio.gather(*(e.step(task.solution[1]) for e in envs))
        finals = await asyncio.gather(*(e.step(answer) for e in envs))
        took = time.perf_counter() - start
        await asyncio.gather(*(e.close() for e in envs))
        assert all(f[1] == 1.0 for f in finals)
        return took

    ours = [asyncio.run(forked()) for _ in range(reps)]
    base = [asyncio.run(fresh()) for _ in range(reps)]
    return ours, base


def _guarded(what: str, fn) -> list[Row]:
    """Rows of one case; a case that fails is reported on stderr and skipped (the other rows stay)."""
    try:
        rows = fn()
    except Exception as e:  # noqa: BLE001 - a benchmark keeps the rows it measured before a failure
        print(f"case {what} FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return []
    for r in rows:
        print(f"{r.case:<22} ours p50 {r.ours_ms:8.2f} ms  baseline {r.baseline_ms or float('nan'):8.2f} ms  "
              + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items()),
              flush=True)
    return rows


def _api_rows(local, n: int, args, executor) -> list[Row]:
    base_wall, base_lat = asyncio.run(_sdk_case(local, n, args.rl_steps, executor))
    wall, lat, errors, _ = asyncio.run(_env_case(local, n, args.rl_steps, executor))
    params = {"envs": n, "steps_per_env": args.rl_steps, "inflight": args.rl_inflight}
    return [Row(f"api-{n}envs", "raw SDK python.run, same concurrency", percentile(base_lat, 50),
                percentile(lat, 50), params,
                {"calls_per_s": len(lat) / wall, "p99_ms": percentile(lat, 99), "errors": errors,
                 "baseline_calls_per_s": len(base_lat) / base_wall, "baseline_p99_ms": percentile(base_lat, 99)})]


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` (all threads); 0 when there is no such process."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_rows(remote, n: int, api: list[Row], args, executor, server_pid: int | None) -> list[Row]:
    wall, lat, errors, (client_s, server_s) = asyncio.run(_env_case(remote, n, args.rl_steps, executor, server_pid))
    client_ms, server_ms = client_s * 1e3 / len(lat), server_s * 1e3 / len(lat)
    params = {"envs": n, "steps_per_env": args.rl_steps, "inflight": args.rl_inflight}
    extra = {"calls_per_s": len(lat) / wall, "p99_ms": percentile(lat, 99), "errors": errors,
             "client_cpu_ms_per_call": client_ms}
    if server_pid is not None:  # in-process, the server's CPU is in the client's figure
        extra["server_cpu_ms_per_call"] = server_ms
    return [Row(f"server-{n}envs", "in-process API (row above)", api[0].ours_ms if api else None,
                percentile(lat, 50), params, extra)]


def _paced_rows(local, remote, n: int, args, executor) -> list[Row]:
    rate, seconds = args.rl_paced_rate, args.rl_paced_seconds
    _, base_lat, _ = asyncio.run(_paced_case(local, n, rate, seconds, executor))
    wall, lat, errors = asyncio.run(_paced_case(remote, n, rate, seconds, executor))
    params = {"envs": n, "offered_calls_per_s": rate, "seconds": seconds, "inflight": args.rl_inflight}
    return [Row(f"server-{n}envs-paced", "in-process API, same pacing", percentile(base_lat, 50),
                percentile(lat, 50), params,
                {"calls_per_s": len(lat) / wall, "p99_ms": percentile(lat, 99), "errors": errors,
                 "baseline_p99_ms": percentile(base_lat, 99)},
                f"each env steps every {n / rate * 1e3:.0f} ms (policy time), {rate:.0f} calls/s offered")]


def _serve(home: Path) -> tuple[subprocess.Popen, str, str]:
    """`agentenv serve` in its own process on a free port; returns (process, url, API key).

    Roomy default limits (see the module docstring) and a key without a sandbox quota (1,000 environments).
    """
    from benchmarks.env.server import start_server

    server = start_server(home, runtime_home=home / "server-runtime",
                          serve_args=("--key-max-sandboxes", "0", "--memory-mb", "8192", "--pids", "4096"))
    return server.proc, server.url, server.api_key


def _fork_rows(provider, name: str, args, executor) -> list[Row]:
    ours, base = _fork_case(provider, args.rl_fork_reps, executor)
    med, bmed = sorted(ours)[len(ours) // 2] * 1e3, sorted(base)[len(base) // 2] * 1e3
    return [Row(f"fork-1to16-{name}", "16 fresh resets re-running the prefix", bmed, med,
                {"branches": 16, "reps": args.rl_fork_reps},
                {"rollouts_per_s": 16 / (med / 1e3), "baseline_rollouts_per_s": 16 / (bmed / 1e3)})]


def run_rl_bench(args: argparse.Namespace) -> list[Row]:
    """Measure and return the rows (the caller writes them with `write_results`)."""
    sizes = [int(x) for x in str(args.rl_envs).split(",") if x]
    home = Path(tempfile.mkdtemp(prefix="agentenv-rl-bench-", dir="/tmp"))
    backend = NamespaceBackend(home / "runtime")
    executor = ThreadPoolExecutor(args.rl_inflight, thread_name_prefix="rl-bench")
    rows: list[Row] = []
    server = server_proc = None
    load_start = os.getloadavg()
    try:
        local = LocalProvider(backend)
        _gate(local)
        remote = None
        if not args.rl_no_server:
            if args.rl_server_inproc:
                from agentenv.server import Server
                from agentenv.server.auth import Quota

                # Roomy default limits: the server builds task templates with its defaults, and a burst of
                # restores from a snapshot with small memory/pids limits kills that snapshot (module docstring).
                server = Server(port=0, state_dir=home / "server", backend=backend,
                                limits=Limits(memory_mb=8192, pids=4096)).start()
                url, key = server.url, server.keys.create("bench", Quota(max_sandboxes=0))[0]
            else:
                server_proc, url, key = _serve(home)
            remote = RemoteProvider(url, key, connections=args.rl_inflight, request_timeout_s=300)
            _gate(remote)
        warm = min(16, min(sizes))  # warm-up: thread pool, connections, template snapshot, page cache
        asyncio.run(_sdk_case(local, warm, 3, executor))
        asyncio.run(_env_case(local, warm, 3, executor))
        if remote is not None:
            asyncio.run(_env_case(remote, warm, 3, executor))
        for n in sizes:
            api = _guarded(f"api {n} envs", lambda n=n: _api_rows(local, n, args, executor))
            rows += api
            if remote is not None:
                pid = server_proc.pid if server_proc is not None else None
                rows += _guarded(f"server {n} envs",
                                 lambda n=n, api=api, pid=pid: _server_rows(remote, n, api, args, executor, pid))
                if args.rl_paced_rate > 0 and str(n) in str(args.rl_paced_envs).split(","):
                    rows += _guarded(f"server {n} envs paced",
                                     lambda n=n: _paced_rows(local, remote, n, args, executor))
        for name, provider in (("api", local), ("server", remote)):
            if provider is not None and args.rl_fork_reps > 0:
                rows += _guarded(f"fork {name}", lambda p=provider, name=name: _fork_rows(p, name, args, executor))
        local.close()
        if remote is not None:
            remote.close()
    finally:
        executor.shutdown(wait=True)
        if server is not None:
            server.stop(kill_all=True)
        if server_proc is not None:
            server_proc.terminate()  # --kill-on-exit: the server kills its sandboxes first
            try:
                server_proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                server_proc.kill()
                server_proc.wait()
            NamespaceBackend(home / "server-runtime").gc(everything=True)
        backend.gc(everything=True)
        shutil.rmtree(home, ignore_errors=True)
    load = os.getloadavg()
    for row in rows:  # the dev machine is shared: record how busy it was
        row.params["loadavg_1m_at_start_and_end"] = [round(load_start[0], 1), round(load[0], 1)]
        row.params["server"] = "in-process thread" if args.rl_server_inproc else "agentenv serve subprocess"
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_rl_args(parser)
    parser.add_argument("--component", default="env-rl", help="results name (BENCHMARKS.md section key)")
    parser.add_argument("--results-dir", type=Path, default=None, help="where the JSON goes")
    parser.add_argument("--markdown", type=Path, default=None, help="a scratch markdown file to render the table into")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("the RL benchmark needs root (the sandbox runtime)")
    rows = run_rl_bench(args)
    if not rows:
        raise SystemExit("no case completed")
    path = write_results(args.component, rows, title="AgentEnv RL (environments, pool, server, fork rollouts)",
                         results_dir=args.results_dir, markdown=args.markdown)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
