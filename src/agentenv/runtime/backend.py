"""The backend interface: what a sandbox runtime must provide (namespaces here; a microVM backend later).

A backend owns the lifecycle (create, fork, snapshot, restore, pause, destroy, gc) and hands out
connections to a sandbox's tool server; everything that happens inside a sandbox (commands, sessions,
files) goes through that connection with the frames of `agentenv.protocol`, whatever the isolation.
"""

from __future__ import annotations

import abc

from agentenv.limits import Limits
from agentenv.protocol import SandboxInfo
from agentenv.runtime.client import Connection


class Backend(abc.ABC):
    """Lifecycle operations on sandboxes, by id."""

    @abc.abstractmethod
    def create(self, source: str, limits: Limits, *, ttl_s: float | None = None) -> str:
        """Start a sandbox from an image name, a template name or a snapshot id; return its id."""

    @abc.abstractmethod
    def connect(self, sandbox_id: str) -> Connection:
        """A new connection to the sandbox's tool server."""

    @abc.abstractmethod
    def fork(self, sandbox_id: str, n: int, *, ttl_s: float | None = None) -> list[str]:
        """`n` live copies of the sandbox (files and interpreter state); the parent keeps running."""

    @abc.abstractmethod
    def snapshot(self, sandbox_id: str) -> str:
        """Seal the sandbox's state (files and interpreter) as a snapshot; return the snapshot id."""

    @abc.abstractmethod
    def restore(self, snapshot_id: str, limits: Limits | None = None, *, ttl_s: float | None = None) -> str:
        """A new sandbox from a snapshot; the snapshot stays usable."""

    @abc.abstractmethod
    def pause(self, sandbox_id: str) -> None:
        """Freeze every process of the sandbox."""

    @abc.abstractmethod
    def resume(self, sandbox_id: str) -> None:
        """Thaw a paused sandbox."""

    @abc.abstractmethod
    def destroy(self, sandbox_id: str) -> None:
        """Kill the sandbox (or drop the snapshot) and release what nothing else uses."""

    @abc.abstractmethod
    def list(self) -> list[SandboxInfo]:
        """Live sandboxes and snapshots."""

    @abc.abstractmethod
    def gc(self, *, everything: bool = False) -> dict:
        """Reclaim what dead or expired sandboxes left behind; `everything` also stops all sandboxes."""
