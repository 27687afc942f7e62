"""The same environments against AgentEnv servers: one server, and several behind a MultiProvider."""

from __future__ import annotations

import pytest

from agentenv.rl import (
    AgentEnv,
    CommandVerifier,
    EnvPool,
    MultiProvider,
    RemoteProvider,
    ScriptedPolicy,
    TaskSpec,
    load_suite,
    replay,
    rollout,
)
from agentenv.rl.policy import tool_call

SUITE = load_suite()


@pytest.mark.parametrize("task", SUITE, ids=[t.id for t in SUITE])
def test_scripted_policy_solves_task_through_server(remote, run, task):
    async def main():
        async with AgentEnv(remote) as env:
            obs, info = await env.reset(task=task, seed=0)
            result = await rollout(env, ScriptedPolicy(task), task, already_reset=True)
            return info, result

    info, result = run(main())
    assert info["sandbox_id"].startswith("sb-")
    assert result.reward == 1.0 and result.errors == []


def test_errors_come_back_as_observations_through_server(remote, run):
    task = TaskSpec(id="remote-errors", instruction="x", verifier=CommandVerifier("true"), step_timeout_s=1.0)

    async def main():
        async with AgentEnv(remote) as env:
            await env.reset(task=task)
            out = []
            for action in (tool_call("read_file", path="missing.txt"), tool_call("list_files", path="/nope"),
                           tool_call("run_shell", command="sleep 20"), {"name": "nope", "arguments": {}},
                           tool_call("run_python", code="1/0"), tool_call("run_shell", command="echo fine")):
                obs, *_ = await env.step(action)
                out.append(obs)
            return out

    missing, nodir, slow, unknown, zero, fine = run(main())
    assert missing["error"]["type"] == "not_found" and nodir["error"]["type"] == "not_found"
    assert slow["error"]["type"] == "timeout" and unknown["error"]["type"] == "unknown_tool"
    assert zero["error"] is None and "ZeroDivisionError" in zero["content"]
    assert fine["error"] is None and "fine" in fine["content"]


def test_fork_and_replay_through_server(remote, run, tmp_path):
    (task,) = load_suite(["prime-sum"])

    async def main():
        async with AgentEnv(remote, record_dir=tmp_path) as env:
            await env.reset(task=task)
            await env.step(task.solution[0])
            kids = await env.fork(3)
            rewards = []
            for i, kid in enumerate(kids):
                await kid.step(task.solution[1])
                _, reward, *_ = await kid.step(tool_call("submit", answer="5736396" if i == 1 else "0"))
                rewards.append(reward)
            paths = [kid.writer.path for kid in kids]
            for kid in kids:
                await kid.close()
            return rewards, paths

    rewards, paths = run(main())
    assert rewards == [0.0, 1.0, 0.0]
    assert all(replay(p, remote).ok for p in paths)


def test_pool_over_two_servers_uses_both(servers, run, live):
    members = [RemoteProvider(server.url, key) for server, key in servers]
    multi = MultiProvider(members, capacity=16)
    tasks = load_suite(["roman", "prime-sum", "json-config"]) * 8
    peak: dict[str, int] = {}

    def on_step(latency_s, error):
        for where, n in multi.loads().items():
            peak[where] = max(peak.get(where, 0), n)

    async def main():
        async with EnvPool(multi, max_envs=24, max_inflight=16) as pool:
            pool._on_step = on_step
            return await pool.run(tasks, ScriptedPolicy)

    before = live()
    try:
        results = run(main())
    finally:
        multi.close()
    assert all(r.reward == 1.0 for r in results)
    assert set(peak) == {s.url for s, _ in servers} and min(peak.values()) >= 4
    assert set(multi.loads().values()) == {0}
    assert live() <= before


def test_remote_provider_validates_arguments():
    with pytest.raises(ValueError, match="url must be"):
        RemoteProvider("ftp://x", "k")
    with pytest.raises(ValueError, match="api_key"):
        RemoteProvider("http://127.0.0.1:1", "")
    with pytest.raises(ValueError, match="providers"):
        MultiProvider([])


def test_unreachable_server_fails_reset_cleanly(run):
    provider = RemoteProvider("http://127.0.0.1:9", "key", request_timeout_s=2)
    (task,) = load_suite(["roman"])

    async def main():
        env = AgentEnv(provider, retries=1)
        with pytest.raises(Exception, match="could not start task roman"):
            await env.reset(task=task)
        await env.close()

    run(main())
