"""The REST control plane: E2B's v1 and v2 sandbox routes, snapshots, and our ``/agentenv/v1`` extensions.

Each endpoint is a few lines over `Registry`; errors are `HTTPError` and leave as ``{"code", "message"}``.
"""

from __future__ import annotations

import re
import time
from urllib.parse import parse_qs, unquote

from agentenv import errors
from agentenv.server.auth import KeyInfo
from agentenv.server.httpd import Handler, HTTPError
from agentenv.server.registry import Registry

SANDBOX_ROUTE = re.compile(r"^/(?:v2/)?sandboxes/([^/]+)(?:/([a-z]+))?$")
EXT_ROUTE = re.compile(r"^/agentenv/v1/(sandboxes|snapshots)/([^/]+)/([a-z]+)$")
MAX_PAGE = 1000

MAX_STEP_TIMEOUT_S = 24 * 3600
"""Longest `timeout` one step may ask for, in seconds."""


class ControlPlane:
    def __init__(self, registry: Registry):
        self.reg = registry

    def handle(self, h: Handler, key: KeyInfo) -> bool:
        """Serve `h` if it is a control-plane route; False if the route is unknown."""
        route, method = h.route.rstrip("/") or "/", h.command
        if route in ("/sandboxes", "/v2/sandboxes"):
            if method == "POST":
                self.create(h, key)
            elif method == "GET":
                self.list(h, key, paginated=route.startswith("/v2"))
            else:
                raise HTTPError(405, f"{method} not allowed on {route}")
            return True
        m = SANDBOX_ROUTE.match(route)
        if m:
            self.sandbox(h, key, m.group(1), m.group(2), method)
            return True
        if route == "/snapshots" and method == "GET":
            self.list_snapshots(h, key)
            return True
        if route.startswith("/templates/") and method == "DELETE":
            self.reg.delete_snapshot(route.split("/", 2)[2], key)
            h.send_empty(204)
            return True
        m = EXT_ROUTE.match(route)
        if m and method == "POST":
            self.extension(h, key, m.group(1), m.group(2), m.group(3))
            return True
        return False

    # ---- E2B routes ------------------------------------------------------------------------------------------
    def create(self, h: Handler, key: KeyInfo) -> None:
        body = h.json_body()
        entry = self.reg.create(key, body.get("templateID") or "base", timeout=body.get("timeout"),
                                metadata=body.get("metadata"), env_vars=body.get("envVars"))
        h.send_json(201, entry.model())

    def list(self, h: Handler, key: KeyInfo, *, paginated: bool) -> None:
        raw = parse_qs(h.path.partition("?")[2], keep_blank_values=True)
        states = [s for v in raw.get("state", []) for s in v.split(",") if s]
        metadata = {}
        if raw.get("metadata"):
            metadata = {unquote(k): unquote(v[-1]) for k, v in parse_qs(raw["metadata"][-1]).items()}
        entries = sorted(self.reg.owned(key), key=lambda e: (e.started_at, e.id))
        entries = [e for e in entries if (not states or e.state in states)
                   and all(e.metadata.get(k) == v for k, v in metadata.items())]
        if raw.get("order", ["asc"])[-1] == "desc":
            entries.reverse()
        if not paginated:
            h.send_json(200, [e.listed() for e in entries])
            return
        try:
            limit = int(h.query.get("limit") or 100)
        except ValueError as e:
            raise HTTPError(400, "limit must be an integer") from e
        if not 1 <= limit <= MAX_PAGE:
            raise HTTPError(400, f"limit must be in [1, {MAX_PAGE}], got {limit}")
        start = 0
        token = h.query.get("nextToken")
        if token:
            ids = [e.id for e in entries]
            if token not in ids:
                raise HTTPError(400, f"nextToken {token!r} is not valid (the sandbox it names is gone)")
            start = ids.index(token)
        page = entries[start : start + limit]
        headers = {"x-next-token": entries[start + limit].id} if start + limit < len(entries) else {}
        h.send_json(200, [e.listed() for e in page], headers)

    def sandbox(self, h: Handler, key: KeyInfo, sid: str, action: str | None, method: str) -> None:
        reg = self.reg
        if action is None:
            if method == "GET":
                h.send_json(200, reg.get(sid, key).detail())
            elif method == "DELETE":
                reg.kill(sid, key)
                h.send_empty(204)
            else:
                raise HTTPError(405, f"{method} not allowed on a sandbox")
            return
        if method != ("GET" if action in ("metrics", "logs") else "POST"):
            raise HTTPError(405, f"{method} not allowed on /sandboxes/{{id}}/{action}")
        body = {} if method == "GET" else h.json_body()
        if action == "timeout":
            reg.set_timeout(sid, key, body.get("timeout"))
            h.send_empty(204)
        elif action == "refreshes":
            reg.set_timeout(sid, key, body.get("duration", 60))
            h.send_empty(204)
        elif action == "pause":
            reg.pause(sid, key)
            h.send_empty(204)
        elif action == "resume":
            reg.resume(sid, key, body.get("timeout"))
            h.send_json(201, reg.get(sid).model())
        elif action == "connect":
            resumed = reg.resume(sid, key, body.get("timeout"), strict=False)
            h.send_json(201 if resumed else 200, reg.get(sid).model())
        elif action == "snapshots":
            record = reg.snapshot(sid, key, body.get("name"))
            h.send_json(201, {"snapshotID": record["snapshotID"], "names": record["names"]})
        elif action == "fork":
            kids = reg.fork(sid, key, body.get("count", 1), body.get("timeout"))
            h.send_json(201, [{"sandbox": kid.model()} for kid in kids])
        elif action == "metrics":
            h.send_json(200, [self._metric(reg.get(sid, key))])
        elif action == "logs":
            h.send_json(200, {"logs": [], "logEntries": []})
        else:
            raise HTTPError(404, f"unknown sandbox action {action!r}")

    def _metric(self, entry) -> dict:
        """One sample read from the sandbox's cgroups (memory and CPU time) and its limits."""
        mem_used = _memory_usage(self.reg.backend, entry.id)
        now = time.time()
        return {"timestamp": _iso(now), "timestampUnix": int(now),
                "cpuCount": max(1, int(round(entry.limits.get("cpus", 1) or 1))),
                "cpuUsedPct": 0.0, "memUsed": mem_used, "memTotal": entry.limits.get("memory_mb", 512) << 20,
                "memCache": 0, "diskUsed": 0, "diskTotal": entry.limits.get("disk_mb", 1024) << 20}

    def list_snapshots(self, h: Handler, key: KeyInfo) -> None:
        sid = h.query.get("sandboxID")
        snaps = [s for s in self.reg.owned_snapshots(key) if not sid or s["sandboxID"] == sid]
        snaps.sort(key=lambda s: s["created"])
        limit = int(h.query.get("limit") or MAX_PAGE)
        token = h.query.get("nextToken")
        start = next((i for i, s in enumerate(snaps) if s["snapshotID"] == token), 0) if token else 0
        page = snaps[start : start + limit]
        headers = {"x-next-token": snaps[start + limit]["snapshotID"]} if start + limit < len(snaps) else {}
        h.send_json(200, [{"snapshotID": s["snapshotID"], "names": s["names"]} for s in page], headers)

    # ---- our extensions ----------------------------------------------------------------------------------------
    def extension(self, h: Handler, key: KeyInfo, kind: str, ident: str, action: str) -> None:
        body = h.json_body()
        reg = self.reg
        if kind == "sandboxes" and action == "fork":
            kids = reg.fork(ident, key, body.get("n", 1), body.get("timeout"))
            h.send_json(201, {"sandboxes": [k.model() for k in kids]})
        elif kind == "sandboxes" and action == "snapshot":
            record = reg.snapshot(ident, key, body.get("name"))
            h.send_json(201, {"snapshotID": record["snapshotID"], "names": record["names"]})
        elif kind == "snapshots" and action == "restore":
            entry = reg.restore(ident, key, timeout=body.get("timeout"), metadata=body.get("metadata"))
            h.send_json(201, entry.model())
        elif kind == "sandboxes" and action == "reset":
            self.reset(h, key, ident, body)
        elif kind == "sandboxes" and action == "step":
            self.step(h, key, ident, body)
        else:
            raise HTTPError(404, f"unknown extension route {kind}/{{id}}/{action}")

    def reset(self, h: Handler, key: KeyInfo, sid: str, body: dict) -> None:
        """Replace the sandbox with a fresh one restored from `snapshotID` (the episode's start state)."""
        snapshot = body.get("snapshotID")
        if not isinstance(snapshot, str) or not snapshot:
            raise HTTPError(400, "snapshotID (the episode's initial state) is required")
        old = self.reg.get(sid, key)
        entry = self.reg.restore(snapshot, key, timeout=body.get("timeout"), metadata=old.metadata)
        self.reg.kill(sid, key)
        h.send_json(201, {"sandbox": entry.model(), "observation": "", "info": {"snapshotID": snapshot}})

    def step(self, h: Handler, key: KeyInfo, sid: str, body: dict) -> None:
        """Run one action (shell command or Python code); reward from an optional `reward_cmd`'s stdout."""
        entry = self.reg.get(sid, key)
        if entry.state == "paused":
            raise HTTPError(409, f"sandbox {sid} is paused")
        sb = self.reg.runtime(sid)
        action = body.get("action")
        if not isinstance(action, dict) or action.get("type") not in ("bash", "python"):
            raise HTTPError(400, 'action must be {"type": "bash", "command": ...} or {"type": "python", "code": ...}')
        timeout = body.get("timeout", 60)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_STEP_TIMEOUT_S:
            raise HTTPError(400, f"timeout must be a number of seconds in (0, {MAX_STEP_TIMEOUT_S}], got {timeout!r}")
        field = "command" if action["type"] == "bash" else "code"
        if not isinstance(action.get(field, ""), str):
            raise HTTPError(400, f"action.{field} must be a string, got {type(action[field]).__name__}")
        if not isinstance(body.get("reward_cmd") or "", str):
            raise HTTPError(400, f"reward_cmd must be a string, got {type(body['reward_cmd']).__name__}")
        try:
            if action["type"] == "bash":
                r = sb.exec(str(action.get("command", "")), timeout=timeout)
                obs = {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code}
            else:
                p = sb.python.run(str(action.get("code", "")), timeout=timeout)
                obs = {"stdout": p.stdout, "stderr": p.stderr, "value": p.value, "error": p.error}
            reward = 0.0
            if body.get("reward_cmd"):
                out = sb.exec(str(body["reward_cmd"]), timeout=timeout).stdout.strip()
                try:
                    reward = float(out.splitlines()[-1]) if out else 0.0
                except ValueError as e:
                    raise HTTPError(400, f"reward_cmd must print a number last, printed {out[-200:]!r}") from e
        except errors.SandboxTimeoutError as e:
            raise HTTPError(504, str(e)) from e
        except errors.SandboxError as e:
            raise HTTPError(502, str(e)) from e
        h.send_json(200, {"observation": obs, "reward": reward, "terminated": bool(body.get("terminate")),
                          "truncated": False, "info": {}})


def _memory_usage(backend, sandbox_id: str) -> int:
    """Bytes charged to the sandbox's memory cgroup (0 where the backend has no cgroups)."""
    group = getattr(backend, "cgroup_group", None)
    if group is None:
        return 0
    from agentenv.runtime import cgroups

    try:
        return cgroups.Cgroup(sandbox_id, group, backend.cgroup_root).memory_usage()
    except (OSError, ValueError):
        return 0


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + "Z"
