"""Environments against AgentEnv servers: `RemoteProvider` (one server) and `MultiProvider` (several).

`RemoteProvider` speaks the server's HTTP API (the E2B-compatible control plane plus the ``/agentenv/v1``
extensions): ``POST /sandboxes`` to create, ``.../fork``, ``.../snapshot``, ``/snapshots/{id}/restore``,
``DELETE /sandboxes/{id}``, and ``.../step`` for the work inside a sandbox (shell commands run as
``bash`` actions, everything else as expressions in the sandbox's persistent interpreter, which bind no
names there). Connections are kept alive in a small pool shared by all handles of the provider.

`MultiProvider` spreads sandboxes over several providers (servers, or in-process runtimes) by free
capacity, and routes each snapshot and sandbox back to the provider that owns it.

Example::

    provider = RemoteProvider("http://127.0.0.1:3000", api_key=key)
    env = AgentEnv(provider)          # same code as with LocalProvider
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import logging
import posixpath
import shlex
import threading
from urllib.parse import urlsplit

from agentenv import errors
from agentenv.limits import Limits
from agentenv.rl.backends import Entry, ExecResult, PyResult, SandboxHandle, SandboxProvider
from agentenv.rl.http11 import Connection

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600
"""Sandbox timeout asked of the server when the caller gives none, in seconds."""

_PY_FAULTS = {
    "FileNotFoundError": errors.NotFoundError,
    "IsADirectoryError": errors.SandboxIsADirectoryError,
    "PermissionError": errors.SandboxPermissionError,
    "NotADirectoryError": errors.InvalidArgumentError,
    "FileExistsError": errors.SandboxFileExistsError,
}


def _status_error(status: int, message: str) -> errors.SandboxError:
    if status == 404:
        return errors.SandboxNotFoundError(message)
    if status == 504:
        return errors.SandboxTimeoutError(message)
    if status == 502 and "gone" in message:
        return errors.SandboxGoneError(message)
    if status == 400:
        return errors.InvalidArgumentError(message)
    return errors.SandboxError(f"server answered {status}: {message}")


class RemoteProvider(SandboxProvider):
    """Sandboxes on one AgentEnv server.

    Args:
        url: the server, e.g. ``http://127.0.0.1:3000``.
        api_key: an API key of that server (``agentenv keys create`` / `Server.keys.create`).
        template: the server template (image) new sandboxes start from when a task names ``host``.
        connections: keep-alive connections kept for reuse (more may be open at a burst).
        request_timeout_s: socket timeout of a request beyond the sandbox call's own timeout.
    """

    def __init__(self, url: str, api_key: str, *, connections: int = 64, request_timeout_s: float = 60.0):
        super().__init__()
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must be http://host:port of an AgentEnv server, got {url!r}")
        if not isinstance(api_key, str) or not api_key:
            raise ValueError("api_key must be a non-empty str (create one with `agentenv keys create`)")
        self.url = url.rstrip("/")
        self._host, self._port = parts.hostname, parts.port or 80
        self._headers = {"X-API-Key": api_key, "Content-Type": "application/json"}
        self._idle: list[Connection] = []
        self._idle_lock = threading.Lock()
        self._max_idle = connections
        self.request_timeout_s = request_timeout_s
        self.live = 0
        """Sandboxes this provider made and has not destroyed (for placement)."""

    @property
    def location(self) -> str:
        return self.url

    # ---- HTTP --------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None, *, timeout_s: float | None = None):
        """One JSON request; returns the decoded body (None for 204). Raises `SandboxError` subclasses."""
        data = json.dumps(body or {}).encode() if method != "DELETE" and method != "GET" else None
        with self._idle_lock:
            conn = self._idle.pop() if self._idle else None
        wait_s = self.request_timeout_s + (timeout_s or 0)
        for attempt in range(2):  # a kept-alive connection the server closed gets one fresh retry
            try:
                if conn is None:
                    conn = Connection(self._host, self._port, timeout_s=self.request_timeout_s)
                status, _, raw = conn.request(method, path, data, self._headers, timeout_s=wait_s)
                break
            except OSError as e:  # includes ProtocolError (a ConnectionError) and TimeoutError
                if conn is not None:
                    conn.close()
                conn = None
                if attempt == 1 or isinstance(e, TimeoutError):
                    raise errors.SandboxError(f"server {self.url} unreachable ({method} {path}): {e}") from e
        with self._idle_lock:
            if len(self._idle) < self._max_idle and not conn.will_close:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()
        if status >= 400:
            try:
                message = json.loads(raw).get("message", raw.decode(errors="replace"))
            except (ValueError, AttributeError):
                message = raw.decode(errors="replace")
            raise _status_error(status, f"{method} {path}: {message}")
        return json.loads(raw) if raw else None

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def _handle(self, model: dict) -> RemoteHandle:
        self.live += 1
        return RemoteHandle(self, model["sandboxID"])

    def create(self, source: str, limits: Limits | None = None, *, ttl_s: float | None = None) -> SandboxHandle:
        if limits is not None:
            log.debug("limits are set by the server; %s ignored for %s", limits, self.url)
        if source.startswith("snap-"):
            return self.restore(source, limits, ttl_s=ttl_s)
        model = self.request("POST", "/sandboxes", {"templateID": source, "timeout": int(ttl_s or DEFAULT_TTL_S)})
        return self._handle(model)

    def restore(self, snapshot_id: str, limits: Limits | None = None, *, ttl_s: float | None = None
                ) -> SandboxHandle:
        model = self.request("POST", f"/agentenv/v1/snapshots/{snapshot_id}/restore",
                             {"timeout": int(ttl_s or DEFAULT_TTL_S)})
        return self._handle(model)

    def drop_snapshot(self, snapshot_id: str) -> None:
        try:
            self.request("DELETE", f"/templates/{snapshot_id}")
        except errors.SandboxNotFoundError:
            pass

    def close(self) -> None:
        super().close()
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class RemoteHandle(SandboxHandle):
    """A sandbox on an AgentEnv server."""

    def __init__(self, provider: RemoteProvider, sandbox_id: str):
        self.provider = provider
        self.id = sandbox_id
        self.location = provider.url
        self._dead = False

    def _step(self, action: dict, timeout_s: float) -> dict:
        reply = self.provider.request("POST", f"/agentenv/v1/sandboxes/{self.id}/step",
                                      {"action": action, "timeout": timeout_s}, timeout_s=timeout_s)
        return reply["observation"]

    def exec(self, command: str, *, cwd: str, timeout_s: float, max_output: int) -> ExecResult:
        obs = self._step({"type": "bash", "command": f"cd {shlex.quote(cwd)} || exit 125\n{command}"}, timeout_s)
        return ExecResult(obs["exit_code"], obs["stdout"], obs["stderr"])

    def python(self, code: str, *, timeout_s: float) -> PyResult:
        obs = self._step({"type": "python", "code": code}, timeout_s)
        return PyResult(obs["stdout"], obs["stderr"], obs.get("value"), obs.get("error"), obs.get("error") or "")

    def _expr(self, expr: str, what: str):
        obs = self._step({"type": "python", "code": expr}, 60)
        if obs.get("error"):
            cls = _PY_FAULTS.get(obs["error"], errors.SandboxError)
            raise cls(f"{what}: {obs['error']}")
        return ast.literal_eval(obs["value"]) if obs.get("value") is not None else None

    def read(self, path: str) -> bytes:
        b64 = self._expr(f"__import__('base64').b64encode(open({path!r}, 'rb').read()).decode()", path)
        return base64.b64decode(b64)

    def write(self, path: str, data: bytes) -> None:
        blob = base64.b64encode(data).decode()
        self._expr(f"(__import__('os').makedirs({posixpath.dirname(path) or '/'!r}, exist_ok=True), "
                   f"open({path!r}, 'wb').write(__import__('base64').b64decode({blob!r})))[1]", path)

    def list(self, path: str) -> list[Entry]:
        rows = self._expr(f"sorted((e.name, 'dir' if e.is_dir() else 'symlink' if e.is_symlink() else 'file', "
                          f"e.stat(follow_symlinks=False).st_size) for e in __import__('os').scandir({path!r}))",
                          path)
        return [Entry(*row) for row in rows]

    def fork(self, n: int) -> list[SandboxHandle]:
        reply = self.provider.request("POST", f"/agentenv/v1/sandboxes/{self.id}/fork", {"n": n})
        return [self.provider._handle(m) for m in reply["sandboxes"]]

    def snapshot(self) -> str:
        return self.provider.request("POST", f"/agentenv/v1/sandboxes/{self.id}/snapshot", {})["snapshotID"]

    def destroy(self) -> None:
        if self._dead:
            return
        try:
            self.provider.request("DELETE", f"/sandboxes/{self.id}")
        except errors.SandboxNotFoundError:
            pass
        self._dead = True
        self.provider.live -= 1


class MultiProvider(SandboxProvider):
    """Spreads sandboxes over several providers by free capacity and routes snapshots back to their owner.

    Args:
        providers: the members (e.g. one `RemoteProvider` per server).
        capacity: sandboxes each member should hold at most (placement prefers the member with the most
            room left; members over capacity are still used when all are full).
    """

    def __init__(self, providers: list[SandboxProvider], *, capacity: int = 1024):
        super().__init__()
        if not providers or not all(isinstance(p, SandboxProvider) for p in providers):
            raise ValueError("providers must be a non-empty list of SandboxProvider")
        self.providers = list(providers)
        self.capacity = capacity
        self._owner: dict[str, SandboxProvider] = {}
        self._virtual: dict[str, tuple] = {}
        self._load = {id(p): 0 for p in self.providers}
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return ",".join(p.location for p in self.providers)

    def _pick(self) -> SandboxProvider:
        with self._lock:
            best = max(self.providers, key=lambda p: self.capacity - self._load[id(p)])
            self._load[id(best)] += 1
            return best

    def _track(self, provider: SandboxProvider, handle: SandboxHandle) -> SandboxHandle:
        return _Tracked(handle, self, provider)

    def _done(self, provider: SandboxProvider) -> None:
        with self._lock:
            self._load[id(provider)] -= 1

    def loads(self) -> dict[str, int]:
        """Live sandboxes per member location."""
        with self._lock:
            return {p.location: self._load[id(p)] for p in self.providers}

    def template(self, source: str, setup, limits: Limits | None = None) -> str:
        """A provider-wide template id; each member builds its own copy on first use (in `restore`)."""
        key = "multi-" + hashlib.sha256(json.dumps([source, setup.key]).encode()).hexdigest()[:16]
        with self._lock:
            self._virtual[key] = (source, setup, limits)
        return key

    def create(self, source: str, limits: Limits | None = None, *, ttl_s: float | None = None) -> SandboxHandle:
        if source in self._owner or source in self._virtual:
            return self.restore(source, limits, ttl_s=ttl_s)
        member = self._pick()
        try:
            return self._track(member, member.create(source, limits, ttl_s=ttl_s))
        except BaseException:
            self._done(member)
            raise

    def restore(self, snapshot_id: str, limits: Limits | None = None, *, ttl_s: float | None = None
                ) -> SandboxHandle:
        with self._lock:
            member = self._owner.get(snapshot_id)
            virtual = self._virtual.get(snapshot_id)
        if virtual is not None:
            member = self._pick()  # placement: the member with the most room left
        elif member is None:
            raise errors.SandboxNotFoundError(f"snapshot {snapshot_id} was not made through this MultiProvider")
        else:
            with self._lock:
                self._load[id(member)] += 1
        try:
            real = member.template(*virtual) if virtual is not None else snapshot_id
            return self._track(member, member.restore(real, limits, ttl_s=ttl_s))
        except BaseException:
            self._done(member)
            raise

    def drop_snapshot(self, snapshot_id: str) -> None:
        with self._lock:
            self._virtual.pop(snapshot_id, None)
            member = self._owner.pop(snapshot_id, None)
        if member is not None:
            member.drop_snapshot(snapshot_id)

    def close(self) -> None:
        super().close()
        for p in self.providers:
            p.close()


class _Tracked(SandboxHandle):
    """A member's handle that keeps the `MultiProvider`'s load and snapshot routing up to date."""

    def __init__(self, inner: SandboxHandle, multi: MultiProvider, member: SandboxProvider):
        self.inner, self.multi, self.member = inner, multi, member
        self.id, self.location = inner.id, inner.location
        self._dead = False

    def exec(self, command: str, *, cwd: str, timeout_s: float, max_output: int) -> ExecResult:
        return self.inner.exec(command, cwd=cwd, timeout_s=timeout_s, max_output=max_output)

    def python(self, code: str, *, timeout_s: float) -> PyResult:
        return self.inner.python(code, timeout_s=timeout_s)

    def read(self, path: str) -> bytes:
        return self.inner.read(path)

    def write(self, path: str, data: bytes) -> None:
        self.inner.write(path, data)

    def list(self, path: str) -> list[Entry]:
        return self.inner.list(path)

    def fork(self, n: int) -> list[SandboxHandle]:
        kids = self.inner.fork(n)
        with self.multi._lock:
            self.multi._load[id(self.member)] += len(kids)
        return [_Tracked(k, self.multi, self.member) for k in kids]

    def snapshot(self) -> str:
        snap = self.inner.snapshot()
        with self.multi._lock:
            self.multi._owner[snap] = self.member
        return snap

    def destroy(self) -> None:
        if not self._dead:
            self.inner.destroy()
            self._dead = True
            self.multi._done(self.member)
