"""`AgentEnv`: a gymnasium-style, async-first environment over one sandbox.

``reset(seed=, task=) -> (obs, info)``, ``step(action) -> (obs, reward, terminated, truncated, info)``,
``fork(n)`` (n independent continuations of the current state, e.g. 1 -> 16 for group-relative RL) and
``close()``. Actions are OpenAI tool calls (see `agentenv.rl.tools`); observations are dicts whose
``content`` is the text for the policy. Every reset starts from the task's template snapshot (built once per
provider), every step is recorded when a trajectory directory is given, and sandbox faults are retried:
a sandbox lost mid-episode is rebuilt from the start snapshot by re-running the recorded tool calls.

Example::

    import asyncio
    from agentenv.rl import AgentEnv, LocalProvider, load_suite

    async def main():
        with LocalProvider() as provider:
            env = AgentEnv(provider)
            obs, info = await env.reset(seed=0, task=load_suite()[0])
            obs, reward, terminated, truncated, info = await env.step(
                {"type": "function", "function": {"name": "run_shell", "arguments": '{"command": "ls"}'}})
            await env.close()

    asyncio.run(main())
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from agentenv import errors
from agentenv.rl.backends import SandboxHandle, SandboxProvider
from agentenv.rl.tasks import TaskSpec, Verdict, seed_code
from agentenv.rl.tools import ToolCall, ToolContext, ToolOutput, parse_action, run_tool, tool_schemas
from agentenv.rl.trajectory import TrajectoryWriter

log = logging.getLogger(__name__)


def _obs(output: ToolOutput, call: ToolCall | None) -> dict:
    return {"content": output.content, "tool": call.name if call else None, "call_id": call.call_id if call else "",
            "error": output.error, "truncated": output.truncated}


class AgentEnv:
    """One environment: a task's sandbox, a step budget, a verifier and (optionally) a trajectory file.

    Args:
        provider: where sandboxes come from (`LocalProvider`, `RemoteProvider`, `MultiProvider`).
        record_dir: write each episode's trajectory here (None: no recording).
        fsync: trajectory durability (see `TrajectoryWriter`).
        executor: thread pool for the blocking sandbox calls (default: the event loop's).
        retries: how often a sandbox fault in reset, or a sandbox lost mid-step, is retried.
        score_truncated: also run the verifier when the step budget runs out (reward on truncation).
        on_step: called with ``(latency_s, error_type or None)`` after every step (pool metrics).
    """

    def __init__(self, provider: SandboxProvider, *, record_dir: str | os.PathLike | None = None,
                 fsync: str = "step", executor: Executor | None = None, retries: int = 2,
                 score_truncated: bool = True, on_step: Callable[[float, str | None], None] | None = None):
        if not isinstance(provider, SandboxProvider):
            raise ValueError(f"provider must be a SandboxProvider, got {type(provider).__name__}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative int, got {retries!r}")
        self.provider = provider
        self.record_dir = record_dir
        self.fsync = fsync
        self.executor = executor
        self.retries = retries
        self.score_truncated = score_truncated
        self.on_step = on_step
        self.task: TaskSpec | None = None
        self.handle: SandboxHandle | None = None
        self.writer: TrajectoryWriter | None = None
        self.seed: int | None = None
        self.start_snapshot: str | None = None
        self.steps = 0
        self.done = False
        self.answer: str | None = None
        self.verdict: Verdict | None = None
        self.calls: list[ToolCall] = []
        self.recoveries = 0

    # ---- plumbing ------------------------------------------------------------------------------------------
    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    @property
    def tools(self) -> list[dict]:
        """The OpenAI tool schemas to put in the policy's prompt."""
        return tool_schemas()

    def _ctx(self) -> ToolContext:
        assert self.task is not None
        return ToolContext(self.task.workdir, self.task.step_timeout_s, self.task.max_output_bytes)

    # ---- reset -----------------------------------------------------------------------------------------------
    async def reset(self, *, seed: int | None = None, task: TaskSpec, options: dict | None = None
                    ) -> tuple[dict, dict]:
        """Start an episode of `task` in a fresh sandbox (any previous one is destroyed).

        Args:
            seed: seeds the sandbox interpreter's `random` (recorded; replay uses it).
            task: the task to run.
            options: unused; accepted for gymnasium compatibility.

        Returns:
            ``(obs, info)``: obs ``{"content": instruction, ...}``; info has ``task_id``, ``sandbox_id``,
            ``start_snapshot``, ``trajectory_id``, ``tools`` (schemas, at reset only) and ``max_steps``.

        Raises:
            ValueError: `task` is not a `TaskSpec` or `seed` is not an int.
            SandboxError: the sandbox could not be started after `retries` attempts.
        """
        if not isinstance(task, TaskSpec):
            raise ValueError(f"task must be a TaskSpec, got {type(task).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        await self._release()
        self.task, self.seed = task, seed
        self.steps, self.done, self.answer, self.verdict, self.calls = 0, False, None, None, []
        self.handle = await self._start()
        if self.record_dir is not None:
            self.writer = TrajectoryWriter(self.record_dir, fsync=self.fsync)
            self.writer.write({"kind": "header", "trajectory_id": self.writer.id, "task": task.to_dict(),
                               "seed": seed, "start_snapshot": self.start_snapshot, "sandbox_id": self.handle.id,
                               "location": self.handle.location, "parent": None, "created": time.time()})
        obs = {"content": task.instruction, "tool": None, "call_id": "", "error": None, "truncated": False}
        return obs, self._info(tools=self.tools)

    async def _start(self) -> SandboxHandle:
        assert self.task is not None
        task, last = self.task, None
        for attempt in range(self.retries + 1):
            try:
                self.start_snapshot = await self._run(self.provider.template, task.image, task.setup, task.limits)
                handle = self.provider.take_warm(self.start_snapshot)
                if handle is None:
                    handle = await self._run(self.provider.restore, self.start_snapshot, task.limits)
                try:
                    await self._run(task.setup.at_reset, handle)
                    if self.seed is not None:
                        await self._run(handle.python, seed_code(self.seed), timeout_s=30)
                except BaseException:
                    await self._run(handle.destroy)
                    raise
                return handle
            except errors.SandboxError as e:
                last = e
                log.warning("reset of %s: attempt %d failed: %s", task.id, attempt + 1, e)
        raise errors.SandboxError(f"could not start task {task.id} after {self.retries + 1} attempts: {last}") \
            from last

    def _info(self, **extra: Any) -> dict:
        assert self.task is not None and self.handle is not None
        return {"task_id": self.task.id, "sandbox_id": self.handle.id, "start_snapshot": self.start_snapshot,
                "trajectory_id": self.writer.id if self.writer else None,
                "max_steps": self.task.max_steps, "steps": self.steps, **extra}

    # ---- step ------------------------------------------------------------------------------------------------
    async def step(self, action: dict, *, prompt_tokens: int | None = None, completion_tokens: int | None = None
                   ) -> tuple[dict, float, bool, bool, dict]:
        """Run one tool call.

        Args:
            action: an OpenAI tool call. Anything malformed yields an error observation, not an exception.
            prompt_tokens, completion_tokens: token counts of the policy turn, recorded when given.

        Returns:
            ``(obs, reward, terminated, truncated, info)``. `reward` is the verifier's score on the step that
            ends the episode (``submit``, or the last allowed step when `score_truncated`), else 0.
            ``info["verdict"]`` holds the verifier's detail at the end.

        Raises:
            RuntimeError: `reset` was not called.
        """
        if self.task is None or self.handle is None:
            raise RuntimeError("call reset() before step()")
        t_start = time.time()
        t0 = time.perf_counter()
        if self.done:
            out = ToolOutput("error: the episode is over; call reset()",
                             error={"type": "episode_over", "message": "step after the episode ended"})
            return _obs(out, None), 0.0, True, False, self._info()
        call = parse_action(action)
        if isinstance(call, ToolCall):
            out = await self._call(call)
        else:
            out, call = call, None
        self.steps += 1
        if call is not None:
            self.calls.append(call)
        terminated = out.submitted
        truncated = not terminated and self.steps >= self.task.max_steps
        reward = 0.0
        if terminated:
            self.answer = out.answer
        if terminated or (truncated and self.score_truncated):
            self.verdict = await self._verify()
            reward = self.verdict.reward
        self.done = terminated or truncated
        latency = time.perf_counter() - t0
        obs = _obs(out, call)
        if self.writer is not None:
            self.writer.write({"kind": "step", "index": self.steps - 1, "action": action,
                               "call": {"name": call.name, "arguments": call.arguments} if call else None,
                               "observation": out.content, "output": out.to_dict(), "reward": reward,
                               "terminated": terminated, "truncated": truncated, "sandbox_id": self.handle.id,
                               "snapshot_id": None, "t_start": t_start, "latency_ms": latency * 1e3,
                               "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens})
            if self.done:
                self.writer.write({"kind": "end", "reward": reward, "terminated": terminated,
                                   "truncated": truncated, "steps": self.steps, "answer": self.answer,
                                   "verdict": vars(self.verdict) if self.verdict else None,
                                   "recoveries": self.recoveries})
        if self.on_step is not None:
            self.on_step(latency, out.error["type"] if out.error else None)
        extra = {"verdict": vars(self.verdict)} if self.verdict else {}
        return obs, reward, terminated, truncated, self._info(latency_ms=latency * 1e3, **extra)

    async def _call(self, call: ToolCall) -> ToolOutput:
        out = await self._run(run_tool, self.handle, call, self._ctx())
        attempts = 0
        while out.error and out.error["type"] == "sandbox_lost" and attempts < self.retries:
            attempts += 1
            log.warning("sandbox %s lost at step %d of %s; rebuilding from %s", self.handle.id, self.steps,
                        self.task.id, self.start_snapshot)
            try:
                await self._recover()
            except errors.SandboxError as e:
                log.warning("rebuild failed: %s", e)
                continue
            out = await self._run(run_tool, self.handle, call, self._ctx())
        return out

    async def _recover(self) -> None:
        """Replace a lost sandbox: restore the start snapshot and re-run the episode's tool calls so far."""
        old, self.handle = self.handle, None
        try:
            await self._run(old.destroy)
        except errors.SandboxError:
            pass
        self.handle = await self._start()
        ctx = self._ctx()
        for call in self.calls:
            await self._run(run_tool, self.handle, call, ctx)
        self.recoveries += 1

    async def score(self) -> Verdict:
        """Run the verifier on the current state without ending the episode (e.g. for a mid-episode reward).

        Raises:
            RuntimeError: `reset` was not called.
        """
        if self.task is None or self.handle is None:
            raise RuntimeError("call reset() before score()")
        if self.done and self.verdict is not None:
            return self.verdict
        return await self._verify()

    async def _verify(self) -> Verdict:
        try:
            return await self._run(self.task.verifier, self.handle, self.answer, self.task)
        except errors.SandboxError as e:
            log.warning("verifier of %s failed: %s", self.task.id, e)
            return Verdict(0.0, detail=f"verifier failed: {e}")

    # ---- fork / close ----------------------------------------------------------------------------------------
    async def fork(self, n: int) -> list[AgentEnv]:
        """`n` environments continuing from this one's current state (files, interpreter, step count,
        trajectory so far); each records its own trajectory whose header names this one as parent.

        Raises:
            ValueError: `n` is not a positive int.
            RuntimeError: `reset` was not called or the episode is over.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if self.handle is None or self.done:
            raise RuntimeError("fork needs a running episode (call reset(), and fork before it ends)")
        kids = await self._run(self.handle.fork, n)
        envs = []
        for handle in kids:
            env = AgentEnv(self.provider, record_dir=self.record_dir, fsync=self.fsync, executor=self.executor,
                           retries=self.retries, score_truncated=self.score_truncated, on_step=self.on_step)
            env.task, env.seed, env.start_snapshot, env.handle = self.task, self.seed, self.start_snapshot, handle
            env.steps, env.calls = self.steps, list(self.calls)
            if self.writer is not None:
                env.writer = self.writer.branch()
            envs.append(env)
        return envs

    async def _release(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.handle is not None:
            handle, self.handle = self.handle, None
            try:
                await self._run(handle.destroy)
            except errors.SandboxError as e:
                log.warning("destroying %s: %s", handle.id, e)

    async def close(self) -> None:
        """Destroy the sandbox and close the trajectory (idempotent)."""
        await self._release()

    async def __aenter__(self) -> AgentEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
