"""A Python client for the `agentenv serve` extensions E2B lacks: fork(n), snapshot, restore, reset, step.

Stdlib only (``http.client``, one keep-alive connection per thread and server). `Client` talks to one
server; `Cluster` spreads new sandboxes over several servers (the least loaded first) and routes every later
call to the server that holds the sandbox. `AsyncClient` / `AsyncCluster` are the asyncio faces (each call
runs in a worker thread). Everything else (commands, files, run_code) goes through the stock E2B SDKs.

Example::

    from agentenv.client import Client

    client = Client("http://127.0.0.1:3000", api_key)
    sb = client.create("base")
    client.step(sb, {"type": "python", "code": "x = 41"})
    kids = client.fork(sb, 4)                       # live copies: files and interpreter state
    print(client.step(kids[0], {"type": "python", "code": "x + 1"}).observation["value"])   # 42
    snap = client.snapshot(sb)
    again = client.restore(snap)
    for s in [sb, again, *kids]:
        client.kill(s)
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from agentenv import errors
from agentenv._aio import AsyncProxy


class ServerError(errors.SandboxError):
    """The server refused a request; `status` is the HTTP status, the message is the server's."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class AuthenticationError(ServerError, PermissionError):
    """401: the API key is missing, unknown or revoked."""


class ForbiddenError(ServerError, PermissionError):
    """403: the sandbox or snapshot belongs to another API key."""


class ServerNotFoundError(ServerError, errors.SandboxNotFoundError):
    """404: no such sandbox, snapshot or template."""


class ConflictError(ServerError):
    """409: the sandbox is in the wrong state (e.g. paused) or the name is taken."""


class QuotaExceededError(ServerError):
    """429: the key's quota (live sandboxes, CPUs, memory) would be exceeded."""


_BY_STATUS = {401: AuthenticationError, 403: ForbiddenError, 404: ServerNotFoundError, 409: ConflictError,
              429: QuotaExceededError}


@dataclass(frozen=True)
class RemoteSandbox:
    """A sandbox on one server (pass it, or its id, to the client's methods)."""

    id: str
    access_token: str
    """The envd access token (what the E2B SDK sends as ``X-Access-Token``)."""
    server: str
    """Base URL of the server that holds it."""
    template: str = ""


@dataclass(frozen=True)
class StepResult:
    """One environment step (gymnasium's 5-tuple, named)."""

    observation: dict
    reward: float
    terminated: bool
    truncated: bool
    info: dict = field(default_factory=dict)


def _sid(sandbox: RemoteSandbox | str) -> str:
    if isinstance(sandbox, RemoteSandbox):
        return sandbox.id
    if isinstance(sandbox, str) and sandbox:
        return sandbox
    raise ValueError(f"sandbox must be a RemoteSandbox or a sandbox id, got {sandbox!r}")


class Client:
    """The extension API of one server.

    Args:
        url: the server's base URL (``http://127.0.0.1:3000``).
        api_key: a key from `agentenv keys create`.
        timeout: seconds to wait for each response.
    """

    def __init__(self, url: str, api_key: str, *, timeout: float = 120.0):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must be http://host:port, got {url!r}")
        if not isinstance(api_key, str) or not api_key:
            raise ValueError("api_key must be a non-empty str")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.url = url.rstrip("/")
        self._host, self._port = parts.hostname, parts.port or 80
        self._key = api_key
        self._timeout = timeout
        self._local = threading.local()

    # ---- transport ---------------------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        return conn

    def request(self, method: str, path: str, body: dict | None = None) -> object:
        """One JSON request; returns the decoded body (None for 204). Raises `ServerError` subclasses."""
        payload = None if body is None else json.dumps(body).encode()
        headers = {"X-API-Key": self._key, "Content-Type": "application/json"}
        for attempt in range(2):
            conn = self._conn()
            try:
                conn.request(method, path, payload, headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()  # a kept-alive connection the server closed: retry once on a fresh one
                self._local.conn = None
                if attempt == 1:
                    raise
        if resp.status >= 400:
            try:
                message = json.loads(data).get("message", data.decode(errors="replace"))
            except (ValueError, AttributeError):
                message = data.decode(errors="replace")
            raise _BY_STATUS.get(resp.status, ServerError)(resp.status, message)
        return json.loads(data) if data else None

    def _sandbox(self, model: dict) -> RemoteSandbox:
        return RemoteSandbox(model["sandboxID"], model.get("envdAccessToken") or "", self.url,
                             model.get("templateID", ""))

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def create(self, template: str = "base", *, timeout: float | None = None, metadata: dict | None = None
               ) -> RemoteSandbox:
        """A new sandbox from an image, template, snapshot id or snapshot name; `timeout` in seconds."""
        body: dict = {"templateID": template, "metadata": metadata or {}}
        if timeout is not None:
            body["timeout"] = timeout
        return self._sandbox(self.request("POST", "/v2/sandboxes", body))

    def kill(self, sandbox: RemoteSandbox | str) -> bool:
        """Kill a sandbox; False if it was already gone."""
        try:
            self.request("DELETE", f"/sandboxes/{_sid(sandbox)}")
            return True
        except ServerNotFoundError:
            return False

    def list(self) -> list[dict]:
        """This key's live sandboxes (E2B ``ListedSandbox`` dicts)."""
        return self.request("GET", "/sandboxes")

    def fork(self, sandbox: RemoteSandbox | str, n: int = 1, *, timeout: float | None = None
             ) -> list[RemoteSandbox]:
        """`n` live copies (files, Python and shell state); the parent goes on."""
        body: dict = {"n": n}
        if timeout is not None:
            body["timeout"] = timeout
        reply = self.request("POST", f"/agentenv/v1/sandboxes/{_sid(sandbox)}/fork", body)
        return [self._sandbox(m) for m in reply["sandboxes"]]

    def snapshot(self, sandbox: RemoteSandbox | str, *, name: str | None = None) -> str:
        """Seal the sandbox's state; returns the snapshot id (restore it any number of times)."""
        body = {"name": name} if name else {}
        return self.request("POST", f"/agentenv/v1/sandboxes/{_sid(sandbox)}/snapshot", body)["snapshotID"]

    def restore(self, snapshot: str, *, timeout: float | None = None) -> RemoteSandbox:
        """A new sandbox from a snapshot id or name."""
        body = {} if timeout is None else {"timeout": timeout}
        return self._sandbox(self.request("POST", f"/agentenv/v1/snapshots/{snapshot}/restore", body))

    def delete_snapshot(self, snapshot: str) -> bool:
        try:
            self.request("DELETE", f"/templates/{snapshot}")
            return True
        except ServerNotFoundError:
            return False

    # ---- RL environment verbs ------------------------------------------------------------------------------
    def reset(self, sandbox: RemoteSandbox | str, snapshot: str) -> RemoteSandbox:
        """Start a new episode: a fresh sandbox from `snapshot` replaces `sandbox` (which is killed)."""
        return self._sandbox(self.request("POST", f"/agentenv/v1/sandboxes/{_sid(sandbox)}/reset",
                                          {"snapshotID": snapshot})["sandbox"])

    def step(self, sandbox: RemoteSandbox | str, action: dict, *, reward_cmd: str | None = None,
             timeout: float = 60.0) -> StepResult:
        """Run one action: ``{"type": "bash", "command": ...}`` or ``{"type": "python", "code": ...}``.

        `reward_cmd` (a shell command) runs after the action; the last line it prints is the reward.
        """
        body = {"action": action, "timeout": timeout}
        if reward_cmd:
            body["reward_cmd"] = reward_cmd
        reply = self.request("POST", f"/agentenv/v1/sandboxes/{_sid(sandbox)}/step", body)
        return StepResult(reply["observation"], float(reply["reward"]), bool(reply["terminated"]),
                          bool(reply["truncated"]), reply.get("info", {}))

    def openapi(self) -> dict:
        """The server's OpenAPI document."""
        return self.request("GET", "/agentenv/v1/openapi.json")


class Cluster:
    """Sandboxes spread over several servers: `create` picks the server with the fewest of our sandboxes.

    Args:
        clients: one `Client` per server.
    """

    def __init__(self, clients: list[Client]):
        if not clients or not all(isinstance(c, Client) for c in clients):
            raise ValueError("clients must be a non-empty list of agentenv.client.Client")
        self.clients = {c.url: c for c in clients}
        self._load = {c.url: 0 for c in clients}
        self._lock = threading.Lock()

    def client_for(self, sandbox: RemoteSandbox) -> Client:
        if not isinstance(sandbox, RemoteSandbox):
            raise ValueError("a Cluster needs RemoteSandbox objects (they name their server), not bare ids")
        return self.clients[sandbox.server]

    def _track(self, url: str, delta: int) -> None:
        with self._lock:
            self._load[url] += delta

    def create(self, template: str = "base", **kwargs) -> RemoteSandbox:
        with self._lock:
            url = min(self._load, key=self._load.get)
            self._load[url] += 1
        try:
            return self.clients[url].create(template, **kwargs)
        except BaseException:
            self._track(url, -1)
            raise

    def kill(self, sandbox: RemoteSandbox) -> bool:
        gone = self.client_for(sandbox).kill(sandbox)
        self._track(sandbox.server, -1)
        return gone

    def fork(self, sandbox: RemoteSandbox, n: int = 1, **kwargs) -> list[RemoteSandbox]:
        kids = self.client_for(sandbox).fork(sandbox, n, **kwargs)
        self._track(sandbox.server, len(kids))
        return kids

    def snapshot(self, sandbox: RemoteSandbox, **kwargs) -> tuple[str, str]:
        """Returns ``(server url, snapshot id)``: a snapshot lives on the server that took it."""
        return sandbox.server, self.client_for(sandbox).snapshot(sandbox, **kwargs)

    def restore(self, snapshot: tuple[str, str], **kwargs) -> RemoteSandbox:
        url, snap_id = snapshot
        kid = self.clients[url].restore(snap_id, **kwargs)
        self._track(url, 1)
        return kid

    def step(self, sandbox: RemoteSandbox, action: dict, **kwargs) -> StepResult:
        return self.client_for(sandbox).step(sandbox, action, **kwargs)

    def reset(self, sandbox: RemoteSandbox, snapshot: str) -> RemoteSandbox:
        return self.client_for(sandbox).reset(sandbox, snapshot)


class AsyncClient(AsyncProxy):
    """`Client` with every method awaited (each runs in a worker thread with its own connection)."""

    def __init__(self, url: str, api_key: str, **kwargs):
        super().__init__(Client(url, api_key, **kwargs))


class AsyncCluster(AsyncProxy):
    """`Cluster` with every method awaited."""

    def __init__(self, clients: list[Client]):
        super().__init__(Cluster(clients))
