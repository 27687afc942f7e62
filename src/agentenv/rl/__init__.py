"""AgentEnv for RL: environments, tools, tasks, a rollout pool, trajectories, remote/Ray/verl integration.

Public API (names resolve lazily: importing the package does no work and imports neither ray nor pyarrow):
`AgentEnv`, `EnvPool`, `LocalProvider`, `RemoteProvider`, `MultiProvider`, `TaskSpec` and the verifiers,
`load_suite`, `tool_schemas`, `ScriptedPolicy`, `rollout`, `TrajectoryWriter`, `load_trajectory`,
`to_parquet`, `replay`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AgentEnv": "agentenv.rl.env",
    "EnvPool": "agentenv.rl.pool",
    "PoolMetrics": "agentenv.rl.pool",
    "LocalProvider": "agentenv.rl.backends",
    "SandboxProvider": "agentenv.rl.backends",
    "SandboxHandle": "agentenv.rl.backends",
    "RemoteProvider": "agentenv.rl.remote",
    "MultiProvider": "agentenv.rl.remote",
    "TaskSpec": "agentenv.rl.tasks",
    "Setup": "agentenv.rl.tasks",
    "Verdict": "agentenv.rl.tasks",
    "UnitTestVerifier": "agentenv.rl.tasks",
    "CommandVerifier": "agentenv.rl.tasks",
    "FileVerifier": "agentenv.rl.tasks",
    "AnswerVerifier": "agentenv.rl.tasks",
    "CallableVerifier": "agentenv.rl.tasks",
    "load_suite": "agentenv.rl.suite",
    "tool_schemas": "agentenv.rl.tools",
    "ScriptedPolicy": "agentenv.rl.policy",
    "EpisodeResult": "agentenv.rl.policy",
    "rollout": "agentenv.rl.policy",
    "tool_call": "agentenv.rl.policy",
    "TrajectoryWriter": "agentenv.rl.trajectory",
    "load_trajectory": "agentenv.rl.trajectory",
    "to_parquet": "agentenv.rl.trajectory",
    "replay": "agentenv.rl.trajectory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentenv.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
