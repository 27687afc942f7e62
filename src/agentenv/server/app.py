"""`Server`: the E2B-compatible HTTP API over the runtime, and the request router.

Routing: a request with ``E2b-Sandbox-Id`` is sandbox traffic (envd services on port 49983, the code
interpreter on 49999, any other ``E2b-Sandbox-Port`` proxied to that port inside the sandbox) and is
authorised by the sandbox's access token (``X-Access-Token``); anything else is the control plane,
authorised by an API key (``X-API-Key`` or ``Authorization: Bearer``).

Example::

    from agentenv.server import Server
    server = Server(port=0, state_dir="/tmp/ae-server")
    key = server.keys.create("me")[0]
    server.start()                      # serves in a background thread on 127.0.0.1
    print(server.url)                   # point E2B_API_URL and E2B_SANDBOX_URL here, E2B_API_KEY=key
    server.stop(kill_all=True)
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from pathlib import Path

from agentenv.limits import Limits
from agentenv.server import interpreter, proxy
from agentenv.server.auth import KeyStore
from agentenv.server.control import ControlPlane
from agentenv.server.envd import Envd
from agentenv.server.httpd import Handler, HTTPError, HTTPServer
from agentenv.server.registry import Registry

log = logging.getLogger(__name__)

ENVD_PORT = 49983
INTERPRETER_PORT = 49999
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def default_state_dir(home: Path | str | None = None) -> Path:
    """``$AGENTENV_SERVER_STATE``, else ``<home>/server`` (`home` default: the runtime's `default_home()`)."""
    if os.environ.get("AGENTENV_SERVER_STATE"):
        return Path(os.environ["AGENTENV_SERVER_STATE"])
    from agentenv.runtime.store import default_home

    return Path(home if home is not None else default_home()) / "server"


class App:
    """Routes requests; owns nothing but references to the registry and key store."""

    def __init__(self, registry: Registry, keys: KeyStore):
        self.registry = registry
        self.keys = keys
        self.control = ControlPlane(registry)
        self.envd = Envd(registry)

    def handle(self, h: Handler) -> None:
        sandbox_id = h.headers.get("E2b-Sandbox-Id")
        if sandbox_id:
            self.sandbox_traffic(h, sandbox_id)
            return
        if h.route in ("/health", "/agentenv/v1/health"):
            h.send_json(200, {"status": "ok"})
            return
        if h.route == "/agentenv/v1/openapi.json":
            from agentenv.server.openapi import document

            h.send_json(200, document())
            return
        key = self.keys.verify(h.headers.get("X-API-Key") or _bearer(h.headers.get("Authorization", "")))
        if key is None:
            raise HTTPError(401, "missing, unknown or revoked API key: send X-API-Key (E2B_API_KEY) with a key "
                                 "from `agentenv keys create`")
        if h.route == "/agentenv/v1/info":
            mine = self.registry.owned(key)
            h.send_json(200, {"sandboxes": len(mine), "gone_after_restart": self.registry.gone,
                              "quota": key.quota.__dict__})
            return
        if not self.control.handle(h, key):
            raise HTTPError(404, f"no route {h.command} {h.route}")

    def sandbox_traffic(self, h: Handler, sandbox_id: str) -> None:
        entry = self.registry.entries.get(sandbox_id)
        if entry is None:  # what E2B's edge answers for a sandbox that is not running (the SDK maps it so)
            raise HTTPError(502, f"sandbox {sandbox_id!r} is not running: it was killed, timed out or never existed")
        port = h.headers.get("E2b-Sandbox-Port", str(ENVD_PORT))
        token = h.headers.get("X-Access-Token")
        # the code-interpreter SDK sends no token with its /contexts calls (E2B checks none there); we check one
        # whenever it is sent, and always elsewhere
        tokenless = port == str(INTERPRETER_PORT) and h.route.startswith("/contexts")
        if not token and not tokenless:
            raise HTTPError(401, f"sandbox {sandbox_id}: missing X-Access-Token (the envdAccessToken from create)")
        if token and not hmac.compare_digest(token, entry.token):
            raise HTTPError(403, f"sandbox {sandbox_id}: the access token does not match this sandbox")
        if entry.state == "paused":
            raise HTTPError(502, f"sandbox {sandbox_id} is paused; resume it with Sandbox.connect")
        if port == str(INTERPRETER_PORT):
            if h.route == "/execute":
                interpreter.execute(h, self.registry.runtime(sandbox_id))
            elif h.route.startswith("/contexts"):
                interpreter.contexts(h, self.registry.runtime(sandbox_id))
            elif h.route == "/health":
                h.send_empty(204)
            else:
                raise HTTPError(404, f"no route {h.route} on the code interpreter")
            return
        if port != str(ENVD_PORT):
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise HTTPError(400, f"E2b-Sandbox-Port must be a TCP port number, got {port!r}")
            proxy.forward(h, entry.pid, sandbox_id, int(port))
            return
        if h.route == "/health":
            h.send_empty(204)
        elif h.route == "/files":
            self.envd.files(h, entry)
        elif h.route.startswith("/process.Process/") or h.route.startswith("/filesystem.Filesystem/"):
            service, method = h.route[1:].split("/", 1)
            self.envd.rpc(h, entry, service.split(".")[0], method)
        else:
            raise HTTPError(404, f"no route {h.route} in sandbox {sandbox_id}")


def _bearer(value: str) -> str | None:
    return value[7:].strip() if value.startswith("Bearer ") else None


class Server:
    """The HTTP API bound to a loopback address, over one runtime backend.

    Args:
        host: a loopback address (the server refuses anything else: it has no TLS).
        port: TCP port (0 picks a free one; see `port` after construction).
        state_dir: keys, sandbox registry (default `default_state_dir()`).
        backend: the runtime backend (default: the namespace backend on `home`).
        home: data directory of the default backend.
        limits: default limits of new sandboxes.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 3000, *, state_dir: Path | str | None = None,
                 backend=None, home: Path | str | None = None, limits: Limits | None = None):
        if host not in LOOPBACK:
            raise ValueError(f"host must be a loopback address ({', '.join(LOOPBACK)}), got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        if backend is None:
            from agentenv.sandbox import default_backend

            backend = default_backend(home)
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir(
            home if home is not None else getattr(getattr(backend, "store", None), "home", None))
        self.keys = KeyStore(self.state_dir)
        self.registry = Registry(backend, self.state_dir, limits)
        self.recovered = self.registry.adopt()
        self.httpd = HTTPServer((host, port), App(self.registry, self.keys))
        self.host, self.port = self.httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Server:
        """Serve in a background thread."""
        self.registry.start_reaper()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="agentenv-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until `stop` (or KeyboardInterrupt)."""
        self.registry.start_reaper()
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()

    def stop(self, *, kill_all: bool = False) -> None:
        """Stop serving; with `kill_all`, kill every sandbox and snapshot (else the next server adopts them)."""
        if self._thread is not None:  # shutdown() waits for a serve_forever loop, so only for a started one
            self.httpd.shutdown()
            self._thread.join(timeout=5)
        self.httpd.server_close()
        self.registry.stop(kill_all=kill_all)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(kill_all=True)
