"""`EnvPool`: many environments stepping at once, with admission control, timeouts, retries and metrics.

The pool runs episodes as asyncio tasks. Two limits keep a host healthy under thousands of environments:
`max_envs` (live sandboxes at once: an episode waits for a slot before its reset) and `max_inflight`
(sandbox calls in flight at once: the size of the worker thread pool). Each step is bounded by
`step_timeout_s` on top of the tool's own timeout; an episode whose reset fails (after the environment's own
retries) is retried up to `episode_retries` times; a sandbox lost mid-episode is rebuilt by the environment.
Metrics: steps/s, step latency percentiles, failures by kind; a progress bar (tqdm) for long rollouts.

Example::

    async def main():
        with LocalProvider() as provider:
            async with EnvPool(provider, max_envs=256) as pool:
                tasks = load_suite() * 100
                results = await pool.run(tasks, ScriptedPolicy)
                print(pool.metrics().summary())
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from agentenv import errors
from agentenv.rl.backends import SandboxProvider
from agentenv.rl.env import AgentEnv
from agentenv.rl.policy import EpisodeResult, rollout
from agentenv.rl.tasks import TaskSpec

log = logging.getLogger(__name__)


class _TimedEnv:
    """An `AgentEnv` whose `step` is bounded by a wall-clock timeout (the episode is then abandoned)."""

    def __init__(self, env: AgentEnv, timeout_s: float):
        self.env = env
        self.timeout_s = timeout_s

    @property
    def steps(self) -> int:
        return self.env.steps

    async def step(self, action: dict):
        return await asyncio.wait_for(self.env.step(action), self.timeout_s)


def percentile(values: list[float], q: float) -> float:
    """The `q`-quantile (0..100) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


@dataclass
class PoolMetrics:
    """Counters of a pool since it started (latencies in milliseconds)."""

    steps: int = 0
    episodes: int = 0
    failed_episodes: int = 0
    step_errors: dict[str, int] = field(default_factory=dict)
    """Tool-call errors by type (agent mistakes and sandbox faults alike)."""
    seconds: float = 0.0
    steps_per_s: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    peak_envs: int = 0

    def summary(self) -> str:
        return (f"{self.episodes} episodes ({self.failed_episodes} failed), {self.steps} steps in "
                f"{self.seconds:.2f} s = {self.steps_per_s:.0f} steps/s; step latency p50 {self.p50_ms:.1f} "
                f"p90 {self.p90_ms:.1f} p99 {self.p99_ms:.1f} ms; peak {self.peak_envs} envs; "
                f"errors {self.step_errors or 'none'}")


class EnvPool:
    """Runs environments concurrently over one provider.

    Args:
        provider: where sandboxes come from.
        max_envs: live environments (sandboxes) at once; further episodes wait for a slot.
        max_inflight: worker threads, i.e. sandbox calls in flight at once.
        step_timeout_s: wall-clock bound of one step as seen by the pool (None: only the tools' own timeouts);
            a step past it fails its episode and the sandbox is destroyed.
        episode_retries: how often an episode whose sandbox could not be started is tried again.
        env_retries: passed to each `AgentEnv` (`retries`).
        record_dir: trajectory directory (None: no recording); fsync: see `TrajectoryWriter`.
        progress: show a tqdm progress bar over episodes (on stderr).
    """

    def __init__(self, provider: SandboxProvider, *, max_envs: int = 256, max_inflight: int = 64,
                 step_timeout_s: float | None = 120.0, episode_retries: int = 1, env_retries: int = 2,
                 record_dir: str | os.PathLike | None = None, fsync: str = "step", progress: bool = False):
        if not isinstance(provider, SandboxProvider):
            raise ValueError(f"provider must be a SandboxProvider, got {type(provider).__name__}")
        for name, value in (("max_envs", max_envs), ("max_inflight", max_inflight)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if step_timeout_s is not None and (not isinstance(step_timeout_s, (int, float)) or step_timeout_s <= 0):
            raise ValueError(f"step_timeout_s must be a positive number of seconds or None, got {step_timeout_s!r}")
        if isinstance(episode_retries, bool) or not isinstance(episode_retries, int) or episode_retries < 0:
            raise ValueError(f"episode_retries must be a non-negative int, got {episode_retries!r}")
        self.provider = provider
        self.max_envs = max_envs
        self.step_timeout_s = step_timeout_s
        self.episode_retries = episode_retries
        self.env_retries = env_retries
        self.record_dir = record_dir
        self.fsync = fsync
        self.progress = progress
        self.executor = ThreadPoolExecutor(max_inflight, thread_name_prefix="envpool")
        self._lock = threading.Lock()
        self._latencies: list[float] = []
        self._errors: Counter = Counter()
        self._episodes = 0
        self._failed = 0
        self._live = 0
        self._peak = 0
        self._t0 = time.perf_counter()
        self._slots: asyncio.Semaphore | None = None
        self._closing: set[asyncio.Task] = set()

    # ---- metrics -----------------------------------------------------------------------------------------
    def _on_step(self, latency_s: float, error: str | None) -> None:
        with self._lock:
            self._latencies.append(latency_s * 1e3)
            if error:
                self._errors[error] += 1

    def reset_metrics(self) -> None:
        """Start counting afresh (e.g. after a warm-up)."""
        with self._lock:
            self._latencies, self._errors, self._episodes, self._failed = [], Counter(), 0, 0
            self._peak, self._t0 = self._live, time.perf_counter()

    def metrics(self) -> PoolMetrics:
        with self._lock:
            lat = list(self._latencies)
            seconds = time.perf_counter() - self._t0
            return PoolMetrics(len(lat), self._episodes, self._failed, dict(self._errors), seconds,
                               len(lat) / seconds if seconds > 0 else 0.0, percentile(lat, 50), percentile(lat, 90),
                               percentile(lat, 99), max(lat, default=0.0), self._peak)

    # ---- environments --------------------------------------------------------------------------------------
    def make_env(self) -> AgentEnv:
        """An environment wired to this pool's executor and metrics (the caller resets and closes it)."""
        return AgentEnv(self.provider, record_dir=self.record_dir, fsync=self.fsync, executor=self.executor,
                        retries=self.env_retries, on_step=self._on_step)

    def close_later(self, envs: list[AgentEnv], *, after: asyncio.Future | None = None) -> None:
        """Destroy `envs` in the background (on the pool's workers) instead of awaiting it: the caller goes on
        with its next step while the sandboxes are torn down. With `after` (e.g. the task forking the next
        groups), the destroys start once it is done, so they do not queue ahead of it for the runtime's lock.
        `drain` (and leaving ``async with``) waits for them; a failure is logged, like `AgentEnv.close`'s."""
        async def close(env: AgentEnv) -> None:
            if after is not None:
                await asyncio.wait([after])
            await env.close()

        for env in envs:
            task = asyncio.get_running_loop().create_task(close(env))
            self._closing.add(task)
            task.add_done_callback(self._closed)

    def _closed(self, task: asyncio.Task) -> None:
        self._closing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background close failed: %r", task.exception())

    async def drain(self) -> None:
        """Wait until every `close_later` environment is destroyed."""
        while self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    async def warm(self, tasks: list[TaskSpec], per_task: int = 0) -> None:
        """Build each distinct task's template snapshot now, and pre-restore `per_task` sandboxes of each."""
        loop = asyncio.get_running_loop()
        seen: dict[str, TaskSpec] = {}
        for t in tasks:
            seen.setdefault(t.setup.key + t.image, t)
        for t in seen.values():
            snap = await loop.run_in_executor(self.executor, self.provider.template, t.image, t.setup, t.limits)
            if per_task:
                await loop.run_in_executor(self.executor, self.provider.prewarm, snap, per_task, t.limits)

    def _slot(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_envs)
        return self._slots

    async def episode(self, task: TaskSpec, policy, *, seed: int | None = None) -> EpisodeResult:
        """One episode of `policy` on `task` in a pool slot; failures are returned, not raised."""
        async with self._slot():
            with self._lock:
                self._live += 1
                self._peak = max(self._peak, self._live)
            try:
                return await self._episode(task, policy, seed)
            finally:
                with self._lock:
                    self._live -= 1

    async def _episode(self, task: TaskSpec, policy, seed: int | None) -> EpisodeResult:
        t0 = time.perf_counter()
        for attempt in range(self.episode_retries + 1):
            env = self.make_env()
            try:
                await env.reset(seed=seed, task=task)
                result = await self._steps(env, policy, task)
                with self._lock:
                    self._episodes += 1
                return result
            except errors.SandboxError as e:
                log.warning("episode of %s: attempt %d failed: %s", task.id, attempt + 1, e)
                failure = f"sandbox_error: {e}"
            except asyncio.TimeoutError:
                log.warning("episode of %s: a step ran past %s s", task.id, self.step_timeout_s)
                failure = "step_timeout"
                with self._lock:
                    self._errors["step_timeout"] += 1
                break  # a hung step is not retried: it would most likely hang again
            finally:
                await env.close()
        with self._lock:
            self._episodes += 1
            self._failed += 1
        return EpisodeResult(task.id, 0.0, 0, False, True, [failure], None, time.perf_counter() - t0)

    async def _steps(self, env: AgentEnv, policy, task: TaskSpec) -> EpisodeResult:
        bounded = env if self.step_timeout_s is None else _TimedEnv(env, self.step_timeout_s)
        return await rollout(bounded, policy, task, already_reset=True)

    async def run(self, tasks: list[TaskSpec], policy_factory: Callable[[TaskSpec], object], *,
                  seeds: list[int] | None = None) -> list[EpisodeResult]:
        """One episode per task (in order), at most `max_envs` at once.

        Args:
            tasks: tasks to run (repeat a task for several episodes).
            policy_factory: builds a fresh policy (an object with ``act(obs) -> action``) per episode.
            seeds: per-episode seeds (default: the episode's index).

        Returns:
            One `EpisodeResult` per task, in order; failed episodes have ``errors`` set and reward 0.
        """
        if seeds is not None and len(seeds) != len(tasks):
            raise ValueError(f"seeds must have one entry per task ({len(tasks)}), got {len(seeds)}")
        bar = None
        if self.progress:
            try:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(tasks), desc="episodes", unit="ep", leave=False)
            except ImportError:
                log.info("tqdm is not installed; no progress bar")

        async def one(i: int, task: TaskSpec) -> EpisodeResult:
            result = await self.episode(task, policy_factory(task), seed=seeds[i] if seeds else i)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{self.metrics().steps_per_s:.0f} steps/s")
            return result

        try:
            return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))
        finally:
            if bar is not None:
                bar.close()

    def close(self) -> None:
        """Stop the worker threads (the provider stays open: it belongs to the caller). Environments handed to
        `close_later` and not yet destroyed are left to the provider's close (``async with`` drains them)."""
        if self._closing:
            log.warning("%d background closes still pending; the provider's close destroys them", len(self._closing))
        self.executor.shutdown(wait=True)

    async def __aenter__(self) -> EnvPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()
        self.close()
