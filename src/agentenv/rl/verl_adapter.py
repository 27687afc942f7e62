"""verl integration: AgentEnv tools with verl's `BaseTool` shape, and an agent loop that owns one episode.

verl's tool agent loop (``verl/experimental/agent_loop/tool_agent_loop.py``) calls, for every tool call of
the model, ``instance_id, _ = await tool.create(create_kwargs=...)``, then ``response, reward, metrics =
await tool.execute(instance_id, args)`` and ``await tool.release(instance_id)``; ``response.text`` goes
back into the prompt. An instance therefore lives for one call, while a sandbox must live for an episode,
so `AgentEnvTool` binds each instance to an *episode* named by ``create_kwargs["episode_id"]`` (from the
dataset's ``tools_kwargs``) and kept in an `EpisodeRegistry`: the first call of an episode resets an
`AgentEnv` on its task, later calls step it, `calc_reward` scores it, `close_episode` frees it.
`register_agent_loop()` adds an ``agentenv_tool_agent`` loop (verl's `ToolAgentLoop` that gives every
rollout its own episode id, so the n samples of a GRPO group get n sandboxes, and closes it at the end).

The tool classes subclass verl's `BaseTool` when verl is importable and follow the same signatures
otherwise (``create -> (instance_id, ToolResponse)``, ``execute -> (ToolResponse, reward, metrics)``).

Example (tool config YAML for verl)::

    tools:
      - class_name: agentenv.rl.verl_adapter.AgentEnvTool
        config: {type: native, server: "http://127.0.0.1:3000", api_key: "..."}
        tool_schema: {type: function, function: {name: run_shell, ...}}   # from tool_schemas()
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from agentenv.rl.backends import SandboxProvider
from agentenv.rl.env import AgentEnv
from agentenv.rl.suite import load_suite
from agentenv.rl.tasks import TaskSpec
from agentenv.rl.tools import TOOLS, tool_schemas

log = logging.getLogger(__name__)

try:  # verl is optional and heavy; its BaseTool is used as the base class when present
    from verl.tools.base_tool import BaseTool as _Base
    from verl.tools.schemas import OpenAIFunctionToolSchema as _Schema
    from verl.tools.schemas import ToolResponse
except ImportError:
    _Base, _Schema = object, None

    @dataclass
    class ToolResponse:  # type: ignore[no-redef]
        """verl's ToolResponse shape (text plus optional image/video)."""

        text: str | None = None
        image: Any = None
        video: Any = None


class EpisodeRegistry:
    """Episodes (one `AgentEnv` each) shared by all tool objects of a process, keyed by episode id.

    Args:
        provider: where sandboxes come from.
        tasks: tasks by id that ``create_kwargs["task_id"]`` may name (default: the shipped suite).
        record_dir: trajectory directory for the episodes (None: no recording).
    """

    def __init__(self, provider: SandboxProvider, tasks: list[TaskSpec] | None = None, *, record_dir=None):
        self.provider = provider
        self.tasks = {t.id: t for t in (tasks if tasks is not None else load_suite())}
        self.record_dir = record_dir
        self.episodes: dict[str, AgentEnv] = {}
        self.instances: dict[str, str] = {}
        self.pending: dict[str, dict] = {}
        """create_kwargs of instances whose episode is bound at their first `execute`."""
        self._locks: dict[str, asyncio.Lock] = {}

    def _task(self, kwargs: dict) -> TaskSpec:
        if isinstance(kwargs.get("task"), dict):
            return TaskSpec.from_dict(kwargs["task"])
        task_id = kwargs.get("task_id")
        if task_id not in self.tasks:
            raise ValueError(f"create_kwargs must name a task: task_id in {sorted(self.tasks)} or a task dict, "
                             f"got task_id={task_id!r}")
        return self.tasks[task_id]

    async def bind(self, instance_id: str, create_kwargs: dict, default_episode: str | None = None) -> AgentEnv:
        """Attach `instance_id` to its episode, starting the episode (reset) on first use.

        The episode is ``create_kwargs["episode_id"]``, else `default_episode` (verl's per-rollout request id),
        else the instance itself (a one-call episode).
        """
        episode_id = str(create_kwargs.get("episode_id") or default_episode or instance_id)
        lock = self._locks.setdefault(episode_id, asyncio.Lock())
        async with lock:  # parallel tool calls of one turn must not start the episode twice
            env = self.episodes.get(episode_id)
            if env is None:
                env = AgentEnv(self.provider, record_dir=self.record_dir)
                await env.reset(seed=create_kwargs.get("seed"), task=self._task(create_kwargs))
                self.episodes[episode_id] = env
        self.instances[instance_id] = episode_id
        return env

    async def env(self, instance_id: str, default_episode: str | None = None) -> AgentEnv:
        """The episode of an instance (bound now if `create` deferred it)."""
        if instance_id in self.pending:
            return await self.bind(instance_id, self.pending.pop(instance_id), default_episode)
        episode_id = self.instances.get(instance_id)
        if episode_id is None:
            raise ValueError(f"instance_id {instance_id!r} is unknown or released; call create() first")
        return self.episodes[episode_id]

    async def unbind(self, instance_id: str) -> None:
        """Detach an instance; an episode that is over and has no instances left is closed."""
        self.pending.pop(instance_id, None)
        episode_id = self.instances.pop(instance_id, None)
        env = self.episodes.get(episode_id) if episode_id else None
        if env is not None and env.done and episode_id not in self.instances.values():
            await self.close_episode(episode_id)

    async def close_episode(self, episode_id: str) -> float | None:
        """Close an episode (destroying its sandbox); returns its final reward if it ended, else None."""
        env = self.episodes.pop(episode_id, None)
        self._locks.pop(episode_id, None)
        for iid in [i for i, e in self.instances.items() if e == episode_id]:
            del self.instances[iid]
        if env is None:
            return None
        reward = env.verdict.reward if env.verdict is not None else None
        await env.close()
        return reward

    async def close(self) -> None:
        for episode_id in list(self.episodes):
            await self.close_episode(episode_id)

    # ---- one registry per tool config, for tools that verl builds from YAML -----------------------------------
    _shared: dict[str, EpisodeRegistry] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def for_config(cls, config: dict) -> EpisodeRegistry:
        """The registry for a tool config (``registry``: an instance; or ``server`` + ``api_key``; or ``home``).

        verl constructs each tool separately from YAML, so tools of one config share a registry made on
        first use (never at import).
        """
        if isinstance(config.get("registry"), EpisodeRegistry):
            return config["registry"]
        key = json.dumps({k: config.get(k) for k in ("server", "api_key", "home", "record_dir")}, sort_keys=True)
        with cls._shared_lock:
            if key not in cls._shared:
                if config.get("server"):
                    from agentenv.rl.remote import RemoteProvider

                    provider = RemoteProvider(config["server"], config.get("api_key", ""))
                else:
                    from agentenv.rl.backends import LocalProvider

                    provider = LocalProvider(home=config.get("home"))
                cls._shared[key] = cls(provider, record_dir=config.get("record_dir"))
            return cls._shared[key]


class AgentEnvTool(_Base):
    """One AgentEnv tool (``run_shell``, ``read_file``, ``submit``, ...) with verl's `BaseTool` interface.

    Args:
        config: ``{"registry": EpisodeRegistry}`` or ``{"server": url, "api_key": key}`` or ``{"home": dir}``.
        tool_schema: the tool's OpenAI schema (a dict from `tool_schemas()` or verl's pydantic model).
    """

    def __init__(self, config: dict, tool_schema):
        schema = tool_schema if isinstance(tool_schema, dict) else tool_schema.model_dump()
        name = schema["function"]["name"]
        if name not in TOOLS:
            raise ValueError(f"tool_schema names {name!r}, not an AgentEnv tool ({', '.join(TOOLS)})")
        if _Schema is not None and isinstance(tool_schema, dict):
            tool_schema = _Schema.model_validate(tool_schema)
        self.config = config
        self.name = name
        self.tool_schema = tool_schema
        self.registry = EpisodeRegistry.for_config(config)

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """A new instance of the episode named in ``create_kwargs`` (bound, and the episode started if new,
        at its first `execute`, where verl passes the rollout's ``agent_data``).

        Raises:
            ValueError: ``create_kwargs`` names no known task.
        """
        instance_id = instance_id or f"inst-{uuid.uuid4().hex[:12]}"
        create_kwargs = kwargs.get("create_kwargs") or {k: v for k, v in kwargs.items() if k != "create_kwargs"}
        self.registry._task(create_kwargs)  # fail now on a bad task, not at the first step
        self.registry.pending[instance_id] = create_kwargs
        return instance_id, ToolResponse(text=None)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float,
                                                                                          dict]:
        """One step of the episode: returns the observation text, the step reward and step metrics.

        Without an ``episode_id`` in ``create_kwargs`` the episode is verl's rollout (``agent_data.request_id``,
        passed by verl >= 0.5), so each sample of a group gets its own sandbox.
        """
        agent_data = kwargs.get("agent_data")
        env = await self.registry.env(instance_id, getattr(agent_data, "request_id", None))
        obs, reward, terminated, truncated, info = await env.step({"name": self.name, "arguments": parameters})
        metrics = {"latency_ms": info.get("latency_ms"), "error": (obs["error"] or {}).get("type"),
                   "terminated": terminated, "truncated": truncated, "sandbox_id": info["sandbox_id"]}
        return ToolResponse(text=obs["content"]), reward, metrics

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The verifier's score of the episode (the final one if it ended, else of the current state)."""
        return (await (await self.registry.env(instance_id)).score()).reward

    async def release(self, instance_id: str, **kwargs) -> None:
        await self.registry.unbind(instance_id)


def make_tools(registry: EpisodeRegistry, names: list[str] | None = None) -> list[AgentEnvTool]:
    """`AgentEnvTool`s for the given tool names (default: all) over one registry."""
    return [AgentEnvTool({"registry": registry}, schema) for schema in tool_schemas(names)]


def register_agent_loop(name: str = "agentenv_tool_agent"):
    """Register (with verl) a `ToolAgentLoop` whose rollouts each get their own AgentEnv episode.

    Returns:
        The registered class.

    Raises:
        ImportError: verl is not installed.
    """
    from verl.experimental.agent_loop.agent_loop import register
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    class AgentEnvToolAgentLoop(ToolAgentLoop):
        async def run(self, sampling_params: dict[str, Any], **kwargs):
            episode_id = f"ep-{uuid.uuid4().hex[:16]}"
            tools_kwargs = {n: {**v, "create_kwargs": {**v.get("create_kwargs", {}), "episode_id": episode_id}}
                            for n, v in (kwargs.get("tools_kwargs") or {}).items()}
            try:
                return await super().run(sampling_params, **{**kwargs, "tools_kwargs": tools_kwargs})
            finally:
                for tool in self.tools.values():
                    if isinstance(tool, AgentEnvTool):
                        await tool.registry.close_episode(episode_id)
                        break

    return register(name)(AgentEnvToolAgentLoop)
