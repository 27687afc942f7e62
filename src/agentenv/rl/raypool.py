"""Ray integration: one environment actor per node, so a rollout fleet uses the sandboxes of every node.

`RayEnvFleet` starts an `EnvActor` on each alive node of the Ray cluster (pinned with a hard node-affinity
strategy), each owning a `LocalProvider` on its node's runtime and an `EnvPool`. Work goes to actors by
free capacity: `run` splits episodes in proportion to each actor's free slots, and `make_env` places a
single interactive environment (`RayEnv`, the `AgentEnv` API over an actor) on the actor with the most free
slots. Ray is imported only when a fleet is made (``pip install 'k3-infra[rl]'``).

Example::

    import ray
    ray.init(address="auto")
    fleet = RayEnvFleet(max_envs_per_node=256)
    results = fleet.run(load_suite() * 100, ScriptedPolicy)    # episodes on every node
    env = fleet.make_env()                                     # interactive, on the least-loaded node
    obs, info = env.reset(task=load_suite()[0])
    fleet.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid

from agentenv.rl.tasks import TaskSpec

log = logging.getLogger(__name__)


class EnvActorImpl:
    """The body of `EnvActor` (a plain class, so it is testable and documented without Ray).

    Args:
        max_envs: live environments this actor allows at once.
        max_inflight: its worker threads.
        home: runtime data directory on this node (default: a fresh one under /tmp).
    """

    def __init__(self, max_envs: int = 256, max_inflight: int = 64, home: str | None = None):
        from agentenv.rl.backends import LocalProvider
        from agentenv.rl.pool import EnvPool
        from agentenv.runtime.local import NamespaceBackend

        self.home = home or tempfile.mkdtemp(prefix="agentenv-ray-", dir="/tmp")
        self.backend = NamespaceBackend(self.home)
        self.provider = LocalProvider(self.backend)
        self.max_envs = max_envs
        self.pool = EnvPool(self.provider, max_envs=max_envs, max_inflight=max_inflight)
        self.loop = asyncio.new_event_loop()
        self.envs: dict[str, object] = {}
        self.running = 0

    def node(self) -> dict:
        """Where this actor lives: Ray node id (when run by Ray), hostname, pid, runtime home."""
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except ImportError:
            node_id = None
        return {"node_id": node_id, "host": os.uname().nodename, "pid": os.getpid(), "home": self.home}

    def free(self) -> int:
        """Free environment slots (placement uses this)."""
        return self.max_envs - self.running - len(self.envs)

    def run(self, tasks: list[dict], policy_factory) -> list[dict]:
        """Episodes of `tasks` (task dicts) in this actor's pool; returns `EpisodeResult` dicts."""
        specs = [TaskSpec.from_dict(t) for t in tasks]
        self.running += len(specs)
        try:
            results = self.loop.run_until_complete(self.pool.run(specs, policy_factory))
        finally:
            self.running -= len(specs)
        node = self.node()
        return [{**vars(r), "node_id": node["node_id"], "pid": node["pid"]} for r in results]

    def metrics(self) -> dict:
        return vars(self.pool.metrics())

    def open_env(self, task: dict, seed: int | None = None) -> tuple[str, dict, dict]:
        env = self.pool.make_env()
        obs, info = self.loop.run_until_complete(env.reset(seed=seed, task=TaskSpec.from_dict(task)))
        env_id = f"env-{uuid.uuid4().hex[:12]}"
        self.envs[env_id] = env
        return env_id, obs, info

    def step(self, env_id: str, action: dict) -> tuple:
        return self.loop.run_until_complete(self.envs[env_id].step(action))

    def close_env(self, env_id: str) -> None:
        env = self.envs.pop(env_id, None)
        if env is not None:
            self.loop.run_until_complete(env.close())

    def shutdown(self) -> dict:
        """Close every environment and reclaim this node's sandboxes; returns what gc removed."""
        for env_id in list(self.envs):
            self.close_env(env_id)
        self.pool.close()
        self.provider.close()
        return self.backend.gc(everything=True)


class RayEnv:
    """An interactive environment living in an `EnvActor` (synchronous calls; same tuples as `AgentEnv`)."""

    def __init__(self, actor, ray_module):
        self.actor = actor
        self._ray = ray_module
        self.env_id: str | None = None

    def reset(self, *, task: TaskSpec, seed: int | None = None) -> tuple[dict, dict]:
        if self.env_id is not None:
            self.close()
        self.env_id, obs, info = self._ray.get(self.actor.open_env.remote(task.to_dict(), seed))
        return obs, info

    def step(self, action: dict) -> tuple:
        if self.env_id is None:
            raise RuntimeError("call reset() before step()")
        return self._ray.get(self.actor.step.remote(self.env_id, action))

    def close(self) -> None:
        if self.env_id is not None:
            self._ray.get(self.actor.close_env.remote(self.env_id))
            self.env_id = None


class RayEnvFleet:
    """One `EnvActor` per alive Ray node.

    Args:
        max_envs_per_node: live environments per node.
        max_inflight: worker threads per actor.
        nodes: node ids to use (default: every alive node).

    Raises:
        RuntimeError: Ray is not initialised (call ``ray.init(address=...)`` first).
    """

    def __init__(self, *, max_envs_per_node: int = 256, max_inflight: int = 64, nodes: list[str] | None = None):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call ray.init(address='auto') (or a cluster address) first")
        self._ray = ray
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        self.node_ids = nodes or alive
        remote_cls = ray.remote(num_cpus=0)(EnvActorImpl)
        self.actors = [remote_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False))
                       .remote(max_envs_per_node, max_inflight) for nid in self.node_ids]

    def nodes(self) -> list[dict]:
        """`EnvActorImpl.node()` of each actor."""
        return self._ray.get([a.node.remote() for a in self.actors])

    def free(self) -> list[int]:
        return self._ray.get([a.free.remote() for a in self.actors])

    def run(self, tasks: list[TaskSpec], policy_factory) -> list[dict]:
        """Episodes of `tasks` spread over the actors in proportion to their free slots.

        Returns:
            One result dict per task, in order (`EpisodeResult` fields plus ``node_id`` and ``pid``).
        """
        free = [max(1, f) for f in self.free()]
        total = sum(free)
        shares, start = [], 0
        for i, f in enumerate(free):
            end = len(tasks) if i == len(free) - 1 else start + round(len(tasks) * f / total)
            shares.append((start, end))
            start = end
        refs = [a.run.remote([t.to_dict() for t in tasks[s:e]], policy_factory)
                for a, (s, e) in zip(self.actors, shares) if e > s]
        return [r for part in self._ray.get(refs) for r in part]

    def make_env(self) -> RayEnv:
        """An interactive environment on the actor with the most free slots."""
        free = self.free()
        return RayEnv(self.actors[free.index(max(free))], self._ray)

    def metrics(self) -> list[dict]:
        return self._ray.get([a.metrics.remote() for a in self.actors])

    def shutdown(self) -> list[dict]:
        """Reclaim every node's sandboxes and stop the actors; returns each node's gc report."""
        reports = self._ray.get([a.shutdown.remote() for a in self.actors])
        for a in self.actors:
            self._ray.kill(a)
        return reports
