"""Policies for tests, demos and benchmarks: no model, just scripted tool calls.

`ScriptedPolicy` replays a task's reference solution (optionally with a number of wrong turns first, so
reward varies); `rollout` runs one episode of a policy in an `AgentEnv` and returns its summary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from agentenv.rl.env import AgentEnv
from agentenv.rl.tasks import TaskSpec


def tool_call(name: str, call_id: str = "", **arguments) -> dict:
    """An OpenAI tool call dict (arguments JSON-encoded), e.g. ``tool_call("run_shell", command="ls")``."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


class ScriptedPolicy:
    """Acts out `task.solution`, one call per step.

    Args:
        task: the task whose reference solution is played.
        skip_solution: play only the final ``submit`` (a policy that gives up: reward is usually 0).
    """

    def __init__(self, task: TaskSpec, *, skip_solution: bool = False):
        if not task.solution:
            raise ValueError(f"task: {task.id} has no reference solution to script")
        self.calls = [task.solution[-1]] if skip_solution else list(task.solution)
        self.position = 0

    def act(self, obs: dict) -> dict:
        """The next tool call (the last one, ``submit``, repeats if the episode runs on)."""
        call = self.calls[min(self.position, len(self.calls) - 1)]
        self.position += 1
        return call


@dataclass
class EpisodeResult:
    """Summary of one episode."""

    task_id: str
    reward: float
    steps: int
    terminated: bool
    truncated: bool
    errors: list[str] = field(default_factory=list)
    """Error types of steps that failed (e.g. ``invalid_arguments``)."""
    trajectory_id: str | None = None
    seconds: float = 0.0


async def rollout(env: AgentEnv, policy, task: TaskSpec, *, seed: int | None = None,
                  already_reset: bool = False) -> EpisodeResult:
    """Run `policy` in `env` on `task` until the episode ends (the env stays open; the caller closes it)."""
    import time

    t0 = time.perf_counter()
    if already_reset:
        obs = {"content": task.instruction}
    else:
        obs, _ = await env.reset(seed=seed, task=task)
    reward, terminated, truncated, errs, info = 0.0, False, False, [], {}
    while not (terminated or truncated):
        obs, reward, terminated, truncated, info = await env.step(policy.act(obs))
        if obs["error"]:
            errs.append(obs["error"]["type"])
    return EpisodeResult(task.id, reward, env.steps, terminated, truncated, errs, info.get("trajectory_id"),
                         time.perf_counter() - t0)
