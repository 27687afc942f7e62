"""Where environments get their sandboxes: one small interface, an in-process and a server implementation.

An environment never talks to `agentenv.Sandbox` directly; it holds a `SandboxHandle` made by a
`SandboxProvider`. The tools need only five sandbox primitives (shell command, persistent Python, read,
write, list), and the episode lifecycle needs four (fork, snapshot, restore, destroy), so the same
environment code runs in-process (`LocalProvider`) or against one or several AgentEnv servers
(`agentenv.rl.remote.RemoteProvider`) without changes.

Handles are synchronous (each call blocks one worker thread); `agentenv.rl.env.AgentEnv` runs them in its
executor, which is what keeps the environment API async-first without an async transport.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import threading
from dataclasses import dataclass

from agentenv.limits import Limits

log = logging.getLogger(__name__)


@dataclass
class ExecResult:
    """Outcome of a shell command in the sandbox."""

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool = False
    """True when output past the byte cap was dropped."""


@dataclass
class PyResult:
    """Outcome of code run in the persistent interpreter (`error` is the exception type name, if any)."""

    stdout: str
    stderr: str
    value: str | None
    error: str | None
    traceback: str = ""


@dataclass
class Entry:
    """One directory entry (``type`` is ``file``, ``dir``, ``symlink`` or ``other``)."""

    name: str
    type: str
    size: int


class SandboxHandle(abc.ABC):
    """One live sandbox, as seen by an environment. Every method blocks; sizes in bytes, times in seconds.

    Faults of the sandbox itself (gone, expired, unreachable) raise `agentenv.SandboxError` subclasses;
    the environment turns them into observations or retries, never into a crashed episode.
    """

    id: str
    """Sandbox id (``sb-...``)."""
    location: str
    """Where it runs: ``local`` or the server URL."""

    @abc.abstractmethod
    def exec(self, command: str, *, cwd: str, timeout_s: float, max_output: int) -> ExecResult:
        """Run `command` with ``/bin/sh -c`` in a fresh process with working directory `cwd`."""

    @abc.abstractmethod
    def python(self, code: str, *, timeout_s: float) -> PyResult:
        """Run `code` in the sandbox's persistent interpreter."""

    @abc.abstractmethod
    def read(self, path: str) -> bytes:
        """File contents; raises `agentenv.NotFoundError` if missing."""

    @abc.abstractmethod
    def write(self, path: str, data: bytes) -> None:
        """Create or replace a file (parents are created)."""

    @abc.abstractmethod
    def list(self, path: str) -> list[Entry]:
        """Entries of a directory, sorted by name."""

    @abc.abstractmethod
    def fork(self, n: int) -> list[SandboxHandle]:
        """`n` live copies (files and interpreter state); this one goes on."""

    @abc.abstractmethod
    def snapshot(self) -> str:
        """Seal the state; returns a snapshot id its provider can `restore`."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Kill the sandbox (idempotent)."""


TEMPLATE_MEMORY_MB = 8192
TEMPLATE_PIDS = 4096


def _template_limits(limits: Limits | None) -> Limits:
    """Limits of the sandbox a template is built (and snapshotted) in: roomy memory and pids.

    Every restore forks the snapshot's tool server (kept in its sealed root), and a child is charged to the
    snapshot's cgroup until the runtime moves it to its own; with the task's small limits, a burst of a few
    hundred restores OOM-kills (or pid-exhausts) the snapshot and every later restore fails. Restores get the
    task's limits.
    """
    base = limits or Limits()
    return Limits(memory_mb=max(base.memory_mb, TEMPLATE_MEMORY_MB), pids=max(base.pids, TEMPLATE_PIDS),
                  cpus=base.cpus, disk_mb=base.disk_mb)


class SandboxProvider(abc.ABC):
    """Makes sandboxes and owns the snapshots it took for task templates.

    `template(source, setup)` builds (once per provider) a snapshot of `source` after the `setup` step, so
    a thousand resets of one task cost a thousand restores, not a thousand setups.
    """

    def __init__(self) -> None:
        self._templates: dict[str, str] = {}
        self._template_lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self._warm: dict[str, list[SandboxHandle]] = {}

    @abc.abstractmethod
    def create(self, source: str, limits: Limits | None = None, *, ttl_s: float | None = None) -> SandboxHandle:
        """A new sandbox from an image, template or snapshot id."""

    @abc.abstractmethod
    def restore(self, snapshot_id: str, limits: Limits | None = None, *, ttl_s: float | None = None
                ) -> SandboxHandle:
        """A new sandbox from a snapshot (the snapshot stays)."""

    @abc.abstractmethod
    def drop_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot (idempotent)."""

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """``local`` or a server URL."""

    def template(self, source: str, setup, limits: Limits | None = None) -> str:
        """Snapshot id of `source` after `setup(handle)` ran in it, built once and cached by `setup.key`.

        Args:
            source: image name (``host``) or snapshot id the template starts from.
            setup: an object with `key` (str, identifies the setup) and `__call__(handle)`.
            limits: limits of the sandbox the template is built in.
        """
        key = hashlib.sha256(json.dumps([source, setup.key]).encode()).hexdigest()[:16]
        with self._template_lock:
            if key in self._templates:
                return self._templates[key]
            lock = self._building.setdefault(key, threading.Lock())
        with lock:  # one builder per template; the others wait for its snapshot
            with self._template_lock:
                if key in self._templates:
                    return self._templates[key]
            handle = self.create(source, _template_limits(limits))
            try:
                setup(handle)
                snap = handle.snapshot()
            finally:
                handle.destroy()
            with self._template_lock:
                self._templates[key] = snap
            log.debug("template %s of %s: snapshot %s", key, source, snap)
            return snap

    def prewarm(self, snapshot_id: str, n: int, limits: Limits | None = None) -> int:
        """Restore `n` sandboxes of `snapshot_id` ahead of time; `take_warm` hands them out. Returns `n`."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        made = [self.restore(snapshot_id, limits) for _ in range(n)]
        with self._template_lock:
            self._warm.setdefault(snapshot_id, []).extend(made)
        return n

    def take_warm(self, snapshot_id: str) -> SandboxHandle | None:
        """A pre-restored sandbox of `snapshot_id`, or None when the warm pool is empty."""
        with self._template_lock:
            ready = self._warm.get(snapshot_id)
            return ready.pop() if ready else None

    def warm_count(self) -> int:
        with self._template_lock:
            return sum(len(v) for v in self._warm.values())

    def close(self) -> None:
        """Destroy unused warm sandboxes and drop the template snapshots this provider built."""
        with self._template_lock:
            warm, self._warm = [h for v in self._warm.values() for h in v], {}
        for handle in warm:
            handle.destroy()
        with self._template_lock:
            snaps, self._templates = list(self._templates.values()), {}
        for snap in snaps:
            self.drop_snapshot(snap)

    def __enter__(self) -> SandboxProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalHandle(SandboxHandle):
    """A sandbox of the in-process runtime (`agentenv.Sandbox`)."""

    location = "local"

    def __init__(self, sandbox, provider: LocalProvider):
        self.sb = sandbox
        self.id = sandbox.id
        self._provider = provider
        provider._track(self)

    def exec(self, command: str, *, cwd: str, timeout_s: float, max_output: int) -> ExecResult:
        r = self.sb.exec(command, cwd=cwd, timeout=timeout_s, max_output=max_output)
        return ExecResult(r.exit_code, r.stdout, r.stderr, r.truncated)

    def python(self, code: str, *, timeout_s: float) -> PyResult:
        r = self.sb.python.run(code, timeout=timeout_s)
        return PyResult(r.stdout, r.stderr, r.value, r.error, r.traceback)

    def read(self, path: str) -> bytes:
        return self.sb.files.read(path, text=False)

    def write(self, path: str, data: bytes) -> None:
        self.sb.files.write(path, data)

    def list(self, path: str) -> list[Entry]:
        return [Entry(e.name, e.type, e.size) for e in self.sb.files.list(path)]

    def fork(self, n: int) -> list[SandboxHandle]:
        return [LocalHandle(kid, self._provider) for kid in self.sb.fork(n)]

    def snapshot(self) -> str:
        snap = self.sb.snapshot()
        self._provider._track_snapshot(snap)
        return snap

    def destroy(self) -> None:
        self._provider._untrack(self.id)
        self.sb.destroy()


class LocalProvider(SandboxProvider):
    """Sandboxes of the embedded namespace runtime in this process.

    Args:
        backend: an `agentenv.runtime.backend.Backend` (default: the namespace backend on `home`).
        home: data directory of the default backend (default `$AGENTENV_HOME` or /var/lib/agentenv).

    Example::

        with LocalProvider(home="/tmp/ae") as provider:
            handle = provider.create("host")
            print(handle.exec("echo hi", cwd="/root", timeout_s=5, max_output=1024).stdout)
            handle.destroy()
    """

    def __init__(self, backend=None, *, home: str | None = None):
        super().__init__()
        self._own_backend = backend is None
        if backend is None:
            from agentenv.sandbox import default_backend

            backend = default_backend(home)
        self.backend = backend
        self._made: dict[str, LocalHandle] = {}
        self._snapshots: set[str] = set()
        self._made_lock = threading.Lock()

    def _track(self, handle: LocalHandle) -> None:
        with self._made_lock:
            self._made[handle.id] = handle

    def _track_snapshot(self, snapshot_id: str) -> None:
        with self._made_lock:
            self._snapshots.add(snapshot_id)

    def _untrack(self, sandbox_id: str) -> None:
        with self._made_lock:
            self._made.pop(sandbox_id, None)
            self._snapshots.discard(sandbox_id)

    def close(self) -> None:
        """Destroy every sandbox and snapshot this provider made and did not destroy; with its own backend,
        also the image seeds of that data directory once no sandbox or snapshot of anybody's is left in it."""
        super().close()
        with self._made_lock:
            handles, self._made = list(self._made.values()), {}
            snaps, self._snapshots = list(self._snapshots), set()
        for handle in handles:
            handle.sb.destroy()
        for snap in snaps:
            self.drop_snapshot(snap)
        if self._own_backend and not any(i.kind in ("sandbox", "snapshot") for i in self.backend.list()):
            self.backend.gc(everything=True)

    @property
    def location(self) -> str:
        return "local"

    def create(self, source: str, limits: Limits | None = None, *, ttl_s: float | None = None) -> SandboxHandle:
        from agentenv.sandbox import Sandbox

        return LocalHandle(Sandbox.create(source, limits=limits, ttl=ttl_s, backend=self.backend), self)

    def restore(self, snapshot_id: str, limits: Limits | None = None, *, ttl_s: float | None = None
                ) -> SandboxHandle:
        from agentenv.sandbox import Sandbox

        return LocalHandle(Sandbox.restore(snapshot_id, limits=limits, ttl=ttl_s, backend=self.backend), self)

    def drop_snapshot(self, snapshot_id: str) -> None:
        from agentenv import errors

        try:
            self.backend.destroy(snapshot_id)
        except errors.SandboxNotFoundError:
            pass
