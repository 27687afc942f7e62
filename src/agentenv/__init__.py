"""AgentEnv: isolated sandboxes for agent RL with millisecond snapshot, restore and fork.

Public API: `Sandbox` / `AsyncSandbox` (SDK), `Limits`, `Network`, the result types, and the `SandboxError` family.
Names resolve lazily (PEP 562): importing the package does no work, never imports torch, and keeps the
in-sandbox tool server (which imports `agentenv.protocol`) from loading the SDK.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncSandbox": "agentenv.sandbox",
    "Sandbox": "agentenv.sandbox",
    "Limits": "agentenv.limits",
    "Network": "agentenv.limits",
    "CommandResult": "agentenv.protocol",
    "EntryInfo": "agentenv.protocol",
    "PythonResult": "agentenv.protocol",
    "SandboxInfo": "agentenv.protocol",
    "CommandNotFoundError": "agentenv.errors",
    "InvalidArgumentError": "agentenv.errors",
    "NotFoundError": "agentenv.errors",
    "SandboxError": "agentenv.errors",
    "SandboxGoneError": "agentenv.errors",
    "SandboxNotFoundError": "agentenv.errors",
    "SandboxTimeoutError": "agentenv.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentenv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
