"""Branching with fork: one state into several continuations that share the past and not the future."""

from __future__ import annotations

import pytest

from agentenv.rl import AgentEnv, CommandVerifier, TaskSpec, load_suite
from agentenv.rl.policy import tool_call

TASK = TaskSpec(id="branch", instruction="write a.txt", verifier=CommandVerifier("test \"$(cat a.txt)\" = good"),
                max_steps=10)


def test_fork_continuations_are_independent(provider, run):
    async def main():
        async with AgentEnv(provider) as env:
            await env.reset(task=TASK)
            await env.step(tool_call("run_python", code="history = ['root']"))
            await env.step(tool_call("write_file", path="a.txt", content="base"))
            kids = await env.fork(4)
            try:
                outs = []
                for i, kid in enumerate(kids):
                    word = "good" if i % 2 == 0 else "bad"
                    await kid.step(tool_call("write_file", path="a.txt", content=word))
                    await kid.step(tool_call("run_python", code=f"history.append({i})"))
                for kid in kids:
                    seen, *_ = await kid.step(tool_call("run_python", code="history"))
                    _, reward, terminated, _, _ = await kid.step(tool_call("submit"))
                    outs.append((seen["content"], reward, terminated, kid.steps, kid.handle.id))
                parent, *_ = await env.step(tool_call("read_file", path="a.txt"))
                parent_hist, *_ = await env.step(tool_call("run_python", code="history"))
                return outs, parent["content"], parent_hist["content"], env.handle.id
            finally:
                for kid in kids:
                    await kid.close()

    outs, parent_file, parent_hist, parent_id = run(main())
    assert [o[0] for o in outs] == [f"['root', {i}]" for i in range(4)]
    assert [o[1] for o in outs] == [1.0, 0.0, 1.0, 0.0]
    assert all(o[2] for o in outs) and all(o[3] == 6 for o in outs)
    assert len({o[4] for o in outs} | {parent_id}) == 5
    assert parent_file == "base" and parent_hist == "['root']"


def test_fork_one_into_sixteen_for_group_rollouts(provider, run, live):
    (task,) = load_suite(["prime-sum"])

    async def main():
        async with AgentEnv(provider) as env:
            await env.reset(task=task, seed=3)
            await env.step(task.solution[0])
            kids = await env.fork(16)
            rewards = []
            for i, kid in enumerate(kids):
                answer = "5736396" if i < 8 else str(i)
                _, reward, *_ = await kid.step(tool_call("submit", answer=answer))
                rewards.append(reward)
                await kid.close()
            return rewards

    before = live()
    rewards = run(main())
    assert rewards == [1.0] * 8 + [0.0] * 8
    assert live() <= before


def test_fork_validates_and_needs_a_live_episode(provider, run):
    async def main():
        env = AgentEnv(provider)
        with pytest.raises(RuntimeError, match="running episode"):
            await env.fork(2)
        await env.reset(task=TASK)
        with pytest.raises(ValueError, match="n must be a positive int"):
            await env.fork(0)
        await env.step(tool_call("submit"))
        with pytest.raises(RuntimeError, match="running episode"):
            await env.fork(1)
        await env.close()

    run(main())
