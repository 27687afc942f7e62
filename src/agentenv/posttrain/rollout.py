"""Rollouts of an LM policy through `EnvPool`: fork-based GRPO groups, greedy evaluation, SFT transcripts.

Works with any provider the pool takes (local sandboxes, AgentEnv servers, the Ray fleet's envs): only
`pool.make_env()`, `reset`, `fork`, `step` and `close` are used.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from agentenv.posttrain.policy import generate_action, prompt_text, turn_texts
from agentenv.posttrain.tasks import format_action, parse_action
from agentenv.rl.policy import ScriptedPolicy
from agentenv.rl.tasks import TaskSpec
from agentenv.rl.trajectory import load_trajectory


@dataclass
class Episode:
    """One finished rollout: its text segments ``(text, trained)``, reward and where it came from."""

    task_id: str
    segments: list[tuple[str, bool]]
    reward: float = 0.0
    trajectory_id: str | None = None
    parent_id: str | None = None
    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)


class EnvClock:
    """Wall time spent awaiting the environment (create, fork, step, reward, destroy; concurrent waits overlap)
    and spent sampling from the policy (`policy_seconds`, never overlapping: sampling holds the event loop)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.policy_seconds = 0.0

    async def __call__(self, awaitable):
        t0 = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.seconds += time.perf_counter() - t0


async def _play(envs, episodes: list[Episode], model, tokenizer, temperature: float, generator, clock: EnvClock):
    """Step every env with the policy until all episodes end (env steps of one round run concurrently)."""
    live = list(range(len(envs)))
    while live:
        calls = {}
        for i in live:
            context = "".join(text for text, _ in episodes[i].segments)
            t0 = time.perf_counter()
            action = generate_action(model, tokenizer, context, temperature=temperature, generator=generator)
            clock.policy_seconds += time.perf_counter() - t0
            episodes[i].actions.append(action)
            calls[i] = action
        results = await clock(asyncio.gather(*(envs[i].step(parse_action(calls[i])) for i in live)))
        still = []
        for i, (obs, reward, terminated, truncated, _) in zip(live, results):
            act_text, obs_text = turn_texts(calls[i], obs)
            episodes[i].segments += [(act_text, True), (obs_text, False)]
            episodes[i].observations.append(obs_text[3:].rstrip("\n"))
            if terminated or truncated:
                episodes[i].reward = reward
            else:
                still.append(i)
        live = still


async def rollout_group(pool, task: TaskSpec, model, tokenizer, n: int, *, temperature: float = 1.0,
                        generator: torch.Generator | None = None, clock: EnvClock | None = None) -> list[Episode]:
    """`n` episodes of `task` from one reset: the sandbox is forked into `n` children after the shared prompt.

    Raises:
        ValueError: `n` is not an int >= 2.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2 (a group), got {n!r}")
    clock = clock or EnvClock()
    root = pool.make_env()
    kids = []
    try:
        await clock(root.reset(task=task))
        parent = root.writer.id if root.writer is not None else None
        kids = await clock(root.fork(n))
        await clock(root.close())
        episodes = [Episode(task.id, [(prompt_text(task.instruction), False)], parent_id=parent,
                            trajectory_id=k.writer.id if k.writer is not None else None) for k in kids]
        await _play(kids, episodes, model, tokenizer, temperature, generator, clock)
        return episodes
    finally:
        await clock(asyncio.gather(root.close(), *(k.close() for k in kids)))


async def evaluate(pool, tasks: list[TaskSpec], model, tokenizer, *, clock: EnvClock | None = None) -> list[Episode]:
    """Greedy episodes, one fresh env per task; returns them (success = reward 1)."""
    clock = clock or EnvClock()
    envs = [pool.make_env() for _ in tasks]
    try:
        await clock(asyncio.gather(*(e.reset(task=t) for e, t in zip(envs, tasks))))
        episodes = [Episode(t.id, [(prompt_text(t.instruction), False)],
                            trajectory_id=e.writer.id if e.writer is not None else None)
                    for e, t in zip(envs, tasks)]
        await _play(envs, episodes, model, tokenizer, 0.0, None, clock)
        return episodes
    finally:
        await clock(asyncio.gather(*(e.close() for e in envs)))


async def record_transcripts(pool, tasks: list[TaskSpec]) -> list[str]:
    """Run the scripted solver on `tasks` through the pool (which must have a `record_dir`); returns the ids of
    the recorded trajectories."""
    if pool.record_dir is None:
        raise ValueError("pool: record_transcripts needs an EnvPool with record_dir set")
    results = await pool.run(tasks, ScriptedPolicy)
    return [r.trajectory_id for r in results if r.trajectory_id]


def transcript_segments(path: str, task: TaskSpec) -> list[tuple[str, bool]]:
    """A recorded trajectory (project JSONL format) -> the policy's text segments for SFT."""
    traj = load_trajectory(path)
    segments = [(prompt_text(task.instruction), False)]
    for step in traj.steps:
        obs = {"content": step["observation"], "error": step["output"].get("error")}
        act_text, obs_text = turn_texts(format_action(step["action"]), obs)
        segments += [(act_text, True), (obs_text, False)]
    return segments
