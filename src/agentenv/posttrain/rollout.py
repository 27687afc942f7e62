"""Rollouts of an LM policy through `EnvPool`: fork-based GRPO groups, greedy evaluation, SFT transcripts.

Works with any provider the pool takes (local sandboxes, AgentEnv servers, the Ray fleet's envs): only
`pool.make_env()`, `reset`, `fork`, `step` and `close` are used.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from agentenv.posttrain.policy import generate_actions, prompt_text, turn_texts
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
    and spent sampling from the policy (`policy_seconds`, never overlapping: sampling holds the event loop).
    `parts` splits `seconds` by the label each wait was given (``reset``, ``fork``, ``step``, ``close``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.policy_seconds = 0.0
        self.parts: dict[str, float] = {}

    async def __call__(self, awaitable, label: str = "other"):
        t0 = time.perf_counter()
        try:
            return await awaitable
        finally:
            dt = time.perf_counter() - t0
            self.seconds += dt
            self.parts[label] = self.parts.get(label, 0.0) + dt


async def _play(envs, episodes: list[Episode], model, tokenizer, temperature: float, generator, clock: EnvClock,
                max_new_tokens: int = 24):
    """Step every env with the policy until all episodes end: each round samples every live episode's action in
    one batch, then runs their env steps concurrently."""
    live = list(range(len(envs)))
    while live:
        contexts = ["".join(text for text, _ in episodes[i].segments) for i in live]
        t0 = time.perf_counter()
        actions = generate_actions(model, tokenizer, contexts, temperature=temperature, generator=generator,
                                   max_new_tokens=max_new_tokens)
        clock.policy_seconds += time.perf_counter() - t0
        calls = dict(zip(live, actions))
        for i in live:
            episodes[i].actions.append(calls[i])
        results = await clock(asyncio.gather(*(envs[i].step(parse_action(calls[i])) for i in live)), "step")
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


@dataclass
class ForkedGroups:
    """Groups ready to play (`fork_groups`): per task, the `n` environments forked after the shared prompt and
    their episodes (holding the prompt so far)."""

    tasks: list[TaskSpec]
    envs: list[list]
    groups: list[list[Episode]]


def _check_group_size(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2 (a group), got {n!r}")


async def _close(pool, envs: list, clock: EnvClock, after=None) -> None:
    """Destroy `envs`: in the background when the pool can (`EnvPool.close_later`, once `after` is done), else
    awaited."""
    if hasattr(pool, "close_later"):
        pool.close_later(envs, after=after)
    else:
        await clock(asyncio.gather(*(e.close() for e in envs)), "close")


async def fork_groups(pool, tasks: list[TaskSpec], n: int, *, clock: EnvClock | None = None) -> ForkedGroups:
    """Reset one sandbox per task and fork it into `n` children (one `fork(n)` call per group); the parents are
    closed (their children live on). Start it early (``asyncio.create_task``) to have the next groups' sandboxes
    made while the policy works, then hand it to `rollout_groups` as `forked`.

    Raises:
        ValueError: `n` is not an int >= 2.
    """
    _check_group_size(n)
    clock = clock or EnvClock()
    roots = [pool.make_env() for _ in tasks]
    broods: list[list] = []
    try:
        await clock(asyncio.gather(*(r.reset(task=t) for r, t in zip(roots, tasks))), "reset")
        parents = [r.writer.id if r.writer is not None else None for r in roots]
        broods = list(await clock(asyncio.gather(*(r.fork(n) for r in roots)), "fork"))
    except BaseException:
        await asyncio.gather(*(k.close() for b in broods for k in b), return_exceptions=True)
        raise
    finally:
        await _close(pool, roots, clock)
    groups = [[Episode(t.id, [(prompt_text(t.instruction), False)], parent_id=parent,
                       trajectory_id=k.writer.id if k.writer is not None else None) for k in kids]
              for parent, t, kids in zip(parents, tasks, broods)]
    return ForkedGroups(list(tasks), broods, groups)


async def rollout_groups(pool, tasks: list[TaskSpec], model, tokenizer, n: int, *, temperature: float = 1.0,
                         generator: torch.Generator | None = None, clock: EnvClock | None = None,
                         max_new_tokens: int = 24, forked=None, close_after=None) -> list[list[Episode]]:
    """One group of `n` episodes per task: each task's sandbox is reset once and forked into `n` children after
    the shared prompt (one `fork(n)` call per group); all children of all groups are then played together, the
    policy sampling every live child's action in one batch per turn. The children are destroyed afterwards, in
    the background when the pool supports it (`EnvPool.close_later`).

    Args:
        forked: the groups already forked for `tasks` (a `ForkedGroups`, or an awaitable of one such as the
            task of an earlier `fork_groups` call); None forks them now.
        close_after: a future the children's background destroys wait for (the next groups' `fork_groups`
            task, so that forking them does not queue behind the destroys).

    Raises:
        ValueError: `n` is not an int >= 2, or `forked` was made for other tasks or another group size.
    """
    _check_group_size(n)
    clock = clock or EnvClock()
    if forked is None:
        forked = await fork_groups(pool, tasks, n, clock=clock)
    elif not isinstance(forked, ForkedGroups):
        forked = await clock(forked, "fork_wait")
    kids = [k for b in forked.envs for k in b]
    try:
        if [t.id for t in forked.tasks] != [t.id for t in tasks] or any(len(b) != n for b in forked.envs):
            raise ValueError(f"forked: groups of {[t.id for t in forked.tasks]} x {[len(b) for b in forked.envs]}, "
                             f"expected {[t.id for t in tasks]} x {n}")
        await _play(kids, [e for g in forked.groups for e in g], model, tokenizer, temperature, generator, clock,
                    max_new_tokens)
        return forked.groups
    finally:
        await _close(pool, kids, clock, after=close_after)


async def rollout_group(pool, task: TaskSpec, model, tokenizer, n: int, **kwargs) -> list[Episode]:
    """`n` episodes of `task` from one reset and one `fork(n)`; `rollout_groups` for a single task."""
    return (await rollout_groups(pool, [task], model, tokenizer, n, **kwargs))[0]


async def evaluate(pool, tasks: list[TaskSpec], model, tokenizer, *, clock: EnvClock | None = None,
                   max_new_tokens: int = 24, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> list[Episode]:
    """One episode per task, each in a fresh env: greedy by default, else sampled at `temperature` (repeat a
    task in `tasks` for several samples); returns them (success = reward 1)."""
    clock = clock or EnvClock()
    envs = [pool.make_env() for _ in tasks]
    try:
        await clock(asyncio.gather(*(e.reset(task=t) for e, t in zip(envs, tasks))), "reset")
        episodes = [Episode(t.id, [(prompt_text(t.instruction), False)],
                            trajectory_id=e.writer.id if e.writer is not None else None)
                    for e, t in zip(envs, tasks)]
        await _play(envs, episodes, model, tokenizer, temperature, generator, clock, max_new_tokens)
        return episodes
    finally:
        await _close(pool, envs, clock)


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
