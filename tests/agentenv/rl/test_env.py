"""AgentEnv end to end on real sandboxes: the suite solved by a scripted policy, bad input, limits, faults."""

from __future__ import annotations

import pytest

from agentenv.rl import AgentEnv, CallableVerifier, CommandVerifier, ScriptedPolicy, TaskSpec, load_suite, rollout
from agentenv.rl.policy import tool_call
from agentenv.rl.tasks import Setup

SUITE = load_suite()


@pytest.mark.parametrize("task", SUITE, ids=[t.id for t in SUITE])
def test_scripted_policy_solves_suite_task(provider, run, task):
    async def main():
        async with AgentEnv(provider) as env:
            result = await rollout(env, ScriptedPolicy(task), task, seed=0)
        return result

    result = run(main())
    assert result.reward == 1.0 and result.terminated and not result.truncated
    assert result.errors == [] and result.steps == len(task.solution)


@pytest.mark.parametrize("task_id", ["fizzbuzz", "fix-median", "roman"])
def test_giving_up_scores_zero_on_hidden_tests(provider, run, task_id):
    (task,) = load_suite([task_id])

    async def main():
        async with AgentEnv(provider) as env:
            return await rollout(env, ScriptedPolicy(task, skip_solution=True), task)

    result = run(main())
    assert result.terminated and result.steps == 1
    assert result.reward < 1.0


def test_reset_returns_instruction_tools_and_ids(provider, run):
    task = SUITE[0]

    async def main():
        async with AgentEnv(provider) as env:
            return await env.reset(seed=7, task=task)

    obs, info = run(main())
    assert obs["content"] == task.instruction
    assert info["task_id"] == task.id and info["sandbox_id"].startswith("sb-")
    assert info["start_snapshot"].startswith("snap-")
    assert [t["function"]["name"] for t in info["tools"]][-1] == "submit"


def test_bad_actions_are_observations_and_episode_goes_on(provider, run, live):
    task = SUITE[0]
    bad = [
        {"name": "format_disk", "arguments": {}},
        {"name": "run_shell", "arguments": "{oops"},
        {"name": "write_file", "arguments": {"path": "x.py"}},
        {"name": "read_file", "arguments": {"path": "no/such/file.txt"}},
        {"name": "edit_file", "arguments": {"path": "README.md", "old": "absent", "new": "x"}},
        {"name": "list_files", "arguments": {"path": "/nonexistent-dir"}},
        "not even a dict",
    ]

    async def main():
        async with AgentEnv(provider) as env:
            await env.reset(task=task)
            kinds = []
            for action in bad:
                obs, reward, terminated, truncated, _ = await env.step(action)
                assert reward == 0.0 and not terminated and not truncated
                kinds.append(obs["error"]["type"])
            obs, *_ = await env.step(tool_call("run_shell", command="echo still-alive"))
            return kinds, obs

    before = live()
    kinds, obs = run(main())
    assert kinds == ["unknown_tool", "invalid_arguments", "invalid_arguments", "not_found", "invalid_arguments",
                     "not_found", "invalid_action"]
    assert "still-alive" in obs["content"] and obs["error"] is None
    assert live() <= before


def test_oversized_output_is_cut_and_flagged(provider, run):
    task = TaskSpec(id="big", instruction="x", verifier=CommandVerifier("true"), max_output_bytes=1024)

    async def main():
        async with AgentEnv(provider) as env:
            await env.reset(task=task)
            shell, *_ = await env.step(tool_call("run_shell", command="head -c 200000 /dev/zero | tr '\\0' a"))
            py, *_ = await env.step(tool_call("run_python", code="print('b' * 100000)"))
            await env.step(tool_call("write_file", path="big.txt", content="c" * 50000))
            read, *_ = await env.step(tool_call("read_file", path="big.txt"))
            return shell, py, read

    for obs in run(main()):
        assert obs["truncated"] and "[output truncated to 1024 bytes]" in obs["content"]
        assert len(obs["content"]) < 1400


def test_command_timeout_is_reported_and_sandbox_stays_usable(provider, run):
    task = TaskSpec(id="slow", instruction="x", verifier=CommandVerifier("true"), step_timeout_s=1.0)

    async def main():
        async with AgentEnv(provider) as env:
            await env.reset(task=task)
            slow, *_ = await env.step(tool_call("run_shell", command="sleep 30"))
            fast, *_ = await env.step(tool_call("run_shell", command="echo ok"))
            return slow, fast

    slow, fast = run(main())
    assert slow["error"]["type"] == "timeout"
    assert fast["error"] is None and "ok" in fast["content"]


def test_step_budget_truncates_and_scores(provider, run):
    task = TaskSpec(id="budget", instruction="x", verifier=CommandVerifier("test -f done"), max_steps=2)

    async def main():
        async with AgentEnv(provider) as env:
            await env.reset(task=task)
            first = await env.step(tool_call("run_shell", command="true"))
            second = await env.step(tool_call("run_shell", command="touch done"))
            after = await env.step(tool_call("run_shell", command="true"))
            return first, second, after

    first, second, after = run(main())
    assert first[2:4] == (False, False)
    assert second[1] == 1.0 and second[3] is True and second[2] is False
    assert after[0]["error"]["type"] == "episode_over"


def test_lost_sandbox_is_rebuilt_from_start_snapshot(provider, run, backend):
    task = TaskSpec(id="lost", instruction="x", verifier=CommandVerifier("test \"$(cat n.txt)\" = 2"),
                    setup=Setup(files={"/root/task/n.txt": "1"}))

    async def main():
        async with AgentEnv(provider) as env:
            await env.reset(task=task)
            await env.step(tool_call("run_python", code="counter = 41"))
            await env.step(tool_call("write_file", path="n.txt", content="2"))
            old = env.handle.id
            backend.destroy(old)  # the sandbox dies under the episode
            obs, *_ = await env.step(tool_call("run_python", code="counter + 1"))
            _, reward, terminated, *_ = await env.step(tool_call("submit"))
            return old, env.handle.id, env.recoveries, obs, reward

    old, new, recoveries, obs, reward = run(main())
    assert new != old and recoveries == 1
    assert obs["content"] == "42" and reward == 1.0


def test_callable_verifier_gets_answer_and_sandbox(provider, run):
    def check(handle, answer, task):
        return float(handle.read("/root/task/out.txt") == b"7" and answer == "seven")

    task = TaskSpec(id="callable", instruction="x", verifier=CallableVerifier(check))

    async def main():
        async with AgentEnv(provider) as env:
            await env.reset(task=task)
            await env.step(tool_call("write_file", path="out.txt", content="7"))
            return await env.step(tool_call("submit", answer="seven"))

    _, reward, terminated, _, info = run(main())
    assert terminated and reward == 1.0 and info["verdict"]["reward"] == 1.0


def test_reset_and_step_validate_arguments(provider, run):
    async def main():
        env = AgentEnv(provider)
        with pytest.raises(ValueError, match="task must be a TaskSpec"):
            await env.reset(task={"id": "x"})
        with pytest.raises(ValueError, match="seed must be an int"):
            await env.reset(task=SUITE[0], seed="1")
        with pytest.raises(RuntimeError, match="call reset"):
            await env.step(tool_call("submit"))
        with pytest.raises(ValueError, match="provider must be a SandboxProvider"):
            AgentEnv("local")
        with pytest.raises(ValueError, match="retries"):
            AgentEnv(provider, retries=-1)
        await env.close()

    run(main())


def test_task_spec_validates_fields():
    with pytest.raises(ValueError, match="max_steps"):
        TaskSpec(id="t", instruction="x", verifier=CommandVerifier("true"), max_steps=0)
    with pytest.raises(ValueError, match="verifier must be"):
        TaskSpec(id="t", instruction="x", verifier="true")
    with pytest.raises(ValueError, match="score must be"):
        CommandVerifier("true", score="vibes")
    with pytest.raises(ValueError, match="ids: unknown tasks"):
        load_suite(["nope"])
