"""The verl adapter: verl's tool lifecycle (create -> execute -> release per call) over AgentEnv episodes.

The contract tests run everywhere (they call the tools exactly as verl's `ToolAgentLoop._call_tool` does);
the last tests drive the adapter through verl's own `ToolAgentLoop._call_tool` when verl is importable.
"""

from __future__ import annotations

import json

import pytest

from agentenv.rl import load_suite
from agentenv.rl.verl_adapter import AgentEnvTool, EpisodeRegistry, make_tools


async def _call(tools: dict, name: str, args: dict, tools_kwargs: dict):
    """What verl's ToolAgentLoop does for one tool call (create, execute, release)."""
    tool = tools[name]
    instance_id, _ = await tool.create(create_kwargs=tools_kwargs.get(name, {}).get("create_kwargs", {}))
    try:
        response, reward, metrics = await tool.execute(instance_id, args)
    finally:
        await tool.release(instance_id)
    return response.text, reward, metrics


def _kwargs(episode_id: str, task_id: str) -> dict:
    from agentenv.rl.tools import TOOLS

    return {n: {"create_kwargs": {"episode_id": episode_id, "task_id": task_id}} for n in TOOLS}


def test_episode_spans_tool_instances_and_scores(provider, run, live):
    registry = EpisodeRegistry(provider)
    tools = {t.name: t for t in make_tools(registry)}
    (task,) = load_suite(["fix-median"])

    async def main():
        kw = _kwargs("ep-1", task.id)
        outs = []
        for action in task.solution[:-1]:
            fn = action["function"]
            outs.append(await _call(tools, fn["name"], json.loads(fn["arguments"]), kw))
        inst, _ = await tools["run_shell"].create(create_kwargs=kw["run_shell"]["create_kwargs"])
        mid = await tools["run_shell"].calc_reward(inst)
        await tools["run_shell"].release(inst)
        last = await _call(tools, "submit", {}, kw)
        return outs, mid, last, dict(registry.episodes)

    before = live()
    outs, mid, last, left = run(main())
    assert "def median" in outs[0][0] and outs[2][0] == "2.5"
    assert mid == 1.0
    assert last[0] == "submitted" and last[1] == 1.0 and last[2]["terminated"]
    assert left == {} and live() <= before  # submitted + released: the episode closed itself


def test_group_rollouts_get_separate_sandboxes(provider, run):
    registry = EpisodeRegistry(provider)
    tools = {t.name: t for t in make_tools(registry)}

    async def main():
        rewards = []
        for i in range(3):
            kw = _kwargs(f"group-{i}", "prime-sum")
            await _call(tools, "run_python", {"code": f"x = {i}"}, kw)
        for i in range(3):
            kw = _kwargs(f"group-{i}", "prime-sum")
            text, *_ = await _call(tools, "run_python", {"code": "x"}, kw)
            _, reward, _ = await _call(tools, "submit", {"answer": "5736396" if i == 0 else text}, kw)
            rewards.append((text, reward))
        return rewards

    assert run(main()) == [("0", 1.0), ("1", 0.0), ("2", 0.0)]


def test_bad_input_to_the_adapter(provider, run):
    registry = EpisodeRegistry(provider)
    shell = make_tools(registry, ["run_shell"])[0]

    async def main():
        with pytest.raises(ValueError, match="create_kwargs must name a task"):
            await shell.create(create_kwargs={"task_id": "nope"})
        with pytest.raises(ValueError, match="unknown or released"):
            await shell.execute("inst-missing", {"command": "ls"})
        iid, _ = await shell.create(create_kwargs={"task_id": "roman"})
        response, reward, metrics = await shell.execute(iid, {"command": 42})
        await shell.release(iid)
        await registry.close()
        return response.text, metrics

    text, metrics = run(main())
    assert metrics["error"] == "invalid_arguments" and "must be string" in text
    with pytest.raises(ValueError, match="not an AgentEnv tool"):
        AgentEnvTool({"registry": registry}, {"type": "function", "function": {"name": "browse"}})


def test_verl_tool_agent_loop_drives_the_adapter(provider, run):
    pytest.importorskip("verl", reason="verl is not installed (it is heavy; see the report)")
    tool_agent_loop = pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop")
    from verl.experimental.agent_loop.tool_parser import FunctionCall
    from verl.tools.base_tool import BaseTool

    registry = EpisodeRegistry(provider)
    tools = make_tools(registry)
    assert all(isinstance(t, BaseTool) for t in tools)
    loop = tool_agent_loop.ToolAgentLoop.__new__(tool_agent_loop.ToolAgentLoop)
    loop.tools = {t.name: t for t in tools}
    loop.max_tool_response_length = 4096
    loop.tool_response_truncate_side = "middle"
    (task,) = load_suite(["roman"])

    async def main():
        import inspect

        kw = {n: {"create_kwargs": {"task_id": task.id}} for n in loop.tools}  # no episode_id: the rollout's
        takes_agent_data = "agent_data" in inspect.signature(loop._call_tool).parameters
        agent_data = None
        if takes_agent_data:  # verl >= 0.5 passes the rollout state; its request_id names the episode
            agent_data = tool_agent_loop.AgentData(messages=[], image_data=None, video_data=None, audio_data=None,
                                                   mm_processor_kwargs=None, metrics={}, request_id="req-1",
                                                   tools_kwargs=kw)
        texts, rewards = [], []
        for action in task.solution:
            call = FunctionCall(name=action["function"]["name"], arguments=action["function"]["arguments"])
            out = await (loop._call_tool(call, kw, agent_data) if takes_agent_data else loop._call_tool(call, kw))
            response = out[0] if isinstance(out, tuple) else out
            texts.append(response.text)
            rewards.append(out[1] if isinstance(out, tuple) else None)
        return texts, rewards, dict(registry.episodes), takes_agent_data

    texts, rewards, left, takes_agent_data = run(main())
    assert texts[0].startswith("wrote") and texts[-1] == "submitted" and left == {}
    if takes_agent_data:
        assert rewards == [0.0, 1.0]


def test_agent_loop_registration_with_verl():
    pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop")
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from agentenv.rl.verl_adapter import register_agent_loop

    cls = register_agent_loop("agentenv_tool_agent_test")
    assert issubclass(cls, ToolAgentLoop)
