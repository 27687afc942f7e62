"""A short RL rollout demo: the task suite solved by a scripted policy in a pool, a 1 -> 16 fork group,
a replay of a recorded trajectory, and bad actions answered with error observations.

`run_demo()` returns rows for `k3infra demo` (``component, check, result, ok``); ``python -m
agentenv.rl.demo`` prints them as a table. Needs root and cgroup v1 like the runtime; elsewhere it returns
one row saying so. Uses its own temporary data directory and leaves nothing behind (checked).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DemoLine:
    """One row of the demo table (the fields of `k3infra.demos.DemoRow`)."""

    component: str
    check: str
    result: str
    ok: bool


def _row(check: str, result: str, ok: bool):
    try:
        from k3infra.demos import DemoRow
    except ImportError:
        return DemoLine("env-rl", check, result, ok)
    return DemoRow("env-rl", check, result, ok)


async def _demo(provider, record_dir: Path) -> list:
    from agentenv.rl import AgentEnv, EnvPool, ScriptedPolicy, load_suite, replay
    from agentenv.rl.policy import tool_call

    rows = []
    suite = load_suite()
    async with EnvPool(provider, max_envs=64, max_inflight=16, record_dir=record_dir) as pool:
        start = time.perf_counter()
        await pool.warm(suite)
        rows.append(_row(f"build {len(suite)} task templates (setup once, snapshot)",
                         f"{(time.perf_counter() - start) * 1e3:.0f} ms", True))
        pool.reset_metrics()
        results = await pool.run(suite, ScriptedPolicy)
        for r in results:
            rows.append(_row(f"task {r.task_id}: scripted policy", f"reward {r.reward:.2f} in {r.steps} steps, "
                             f"{r.seconds * 1e3:.0f} ms", r.reward == 1.0 and not r.errors))
        m = pool.metrics()
        rows.append(_row("pool: episodes concurrently", f"{m.steps} steps, {m.steps_per_s:.0f} steps/s, "
                         f"p50 {m.p50_ms:.1f} / p99 {m.p99_ms:.1f} ms", m.failed_episodes == 0))
        gave_up = await pool.run(load_suite(["fizzbuzz", "fix-median", "roman"]),
                                 lambda t: ScriptedPolicy(t, skip_solution=True))
        rows.append(_row("policy that submits at once (hidden tests)",
                         "rewards " + ", ".join(f"{r.reward:.2f}" for r in gave_up),
                         all(r.reward < 1.0 for r in gave_up)))

    (task,) = load_suite(["prime-sum"])
    async with AgentEnv(provider, record_dir=record_dir) as env:
        await env.reset(task=task, seed=0)
        await env.step(task.solution[0])
        start = time.perf_counter()
        kids = await env.fork(16)
        took = (time.perf_counter() - start) * 1e3
        rewards = []
        for i, kid in enumerate(kids):
            await kid.step(task.solution[1])
            _, reward, *_ = await kid.step(tool_call("submit", answer="5736396" if i % 2 == 0 else str(i)))
            rewards.append(reward)
            await kid.close()
        rows.append(_row("fork 1 -> 16 continuations (group of answers)",
                         f"fork {took:.0f} ms, mean reward {sum(rewards) / 16:.2f}", rewards == [1.0, 0.0] * 8))
        bad, *_ = await env.step({"name": "rm_everything", "arguments": {}})
        worse, *_ = await env.step({"name": "run_shell", "arguments": "{not json"})
        ok = bad["error"]["type"] == "unknown_tool" and worse["error"]["type"] == "invalid_arguments"
        rows.append(_row("bad actions -> error observations", f"{bad['error']['type']}, {worse['error']['type']}",
                         ok))

    traj = sorted(record_dir.glob("*.jsonl"), key=lambda p: p.stat().st_mtime)[0]
    report = await asyncio.to_thread(replay, traj, provider)
    rows.append(_row("replay a recorded trajectory from its start snapshot",
                     f"{report.steps} steps, {len(report.divergences)} divergences, {report.seconds * 1e3:.0f} ms",
                     report.ok))
    return rows


def run_demo(device: str = "cpu") -> list:
    """Run the demo (on the host CPU whatever `device` is) and return its rows."""
    from agentenv.rl import LocalProvider
    from agentenv.runtime import cgroups
    from agentenv.runtime.local import NamespaceBackend

    if os.geteuid() != 0 or not cgroups.available():
        return [_row("RL rollout", "skipped: needs root and cgroup v1 (memory/pids/cpu/freezer)", True)]
    home = Path(tempfile.mkdtemp(prefix="agentenv-rl-demo-", dir="/tmp"))
    backend = NamespaceBackend(home / "runtime")
    try:
        with LocalProvider(backend) as provider:
            rows = asyncio.run(_demo(provider, home / "trajectories"))
    finally:
        backend.gc(everything=True)
        left = [p.name for p in (home / "runtime" / "layers").iterdir() if not p.name.startswith("i")]
        shutil.rmtree(home, ignore_errors=True)
    rows.append(_row("cleanup: no sandboxes or layers left", "clean" if not left else f"left {left}", not left))
    return rows


def main() -> int:
    rows = run_demo()
    width = max(len(r.check) for r in rows)
    for r in rows:
        print(f"{'ok ' if r.ok else 'FAIL'} {r.check:<{width}}  {r.result}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
