"""The server's view of its sandboxes and snapshots: ownership, deadlines, tokens, quotas, persistence.

The runtime (`agentenv.Sandbox` over a `Backend`) does the work; the registry adds what E2B's API promises on
top: an owner key per sandbox, a timeout that can be moved (`set_timeout`) and is enforced by a reaper
thread, per-key quotas, an access token per sandbox, paused state, named snapshots. It is written to
``<state_dir>/sandboxes.json`` (and its second slot, see `agentenv.server.state`) after every change, so a
restarted server re-adopts the sandboxes that are still alive and drops (and logs) the ones that are gone;
nothing is left running without an owner.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentenv import errors
from agentenv.limits import Limits
from agentenv.sandbox import Sandbox
from agentenv.server.agents import AgentLink
from agentenv.server.auth import KeyInfo, new_access_token
from agentenv.server.httpd import HTTPError
from agentenv.server.state import StateFile

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 24 * 3600
MAX_LIFETIME_S = 24 * 3600
"""Longest life of a sandbox (E2B's cap too). The runtime gets it as the sandbox's TTL, so a sandbox whose
server crashed and never came back still ends; `set_timeout` cannot move the deadline past it."""
MAX_FORK = 64
TEMPLATE_ALIASES = {"base": "host", "code-interpreter-v1": "host", "code-interpreter": "host", "desktop": "host"}
"""E2B template names mapped to our images (E2B's stock templates are all served by the ``host`` image)."""


@dataclass
class Entry:
    """One sandbox the server owns (persisted)."""

    id: str
    template: str
    key_id: str
    token: str
    started_at: float
    end_at: float
    limits: dict
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    state: str = "running"
    pid: int = 0
    error: str = ""
    """Why the sandbox is in state ``error`` (its init died: OOM kill, signal), else empty."""

    def model(self) -> dict:
        """E2B's ``Sandbox`` (create/connect) response."""
        return {"templateID": self.template, "sandboxID": self.id, "clientID": "agentenv", "alias": self.template,
                "envdVersion": ENVD_VERSION, "envdAccessToken": self.token, "trafficAccessToken": None,
                "domain": None}

    def listed(self) -> dict:
        """E2B's ``ListedSandbox``."""
        return {"templateID": self.template, "sandboxID": self.id, "clientID": "agentenv", "alias": self.template,
                "startedAt": _iso(self.started_at), "endAt": _iso(self.end_at),
                "cpuCount": max(1, int(round(self.limits.get("cpus", 1) or 1))),
                "memoryMB": self.limits.get("memory_mb", 512), "diskSizeMB": self.limits.get("disk_mb", 1024),
                "state": self.state, "envdVersion": ENVD_VERSION, "metadata": self.metadata}

    def detail(self) -> dict:
        """E2B's ``SandboxDetail``."""
        detail = {**self.listed(), "envdAccessToken": self.token}
        if self.error:
            detail["error"] = self.error
        return detail


ENVD_VERSION = "0.6.3"
"""The envd version we report: new enough for stdin, the default user, octet-stream uploads, user file metadata
(0.6.2: ``user.e2b.*`` xattrs) and entries in watch events (0.6.3); the SDK gates each on this version."""


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


class Registry:
    """Sandboxes of one server.

    Args:
        backend: the runtime backend (`agentenv.runtime.backend.Backend`).
        state_dir: where ``sandboxes.json`` lives.
        limits: default limits of a new sandbox.
    """

    def __init__(self, backend, state_dir: Path, limits: Limits | None = None):
        self.backend = backend
        self.path = Path(state_dir) / "sandboxes.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.state = StateFile(self.path)
        self.owner = str(self.path.parent.resolve())
        if hasattr(backend, "owner"):  # the runtime tags what it makes for us (see `_drop_unrecorded`)
            backend.owner = self.owner
        self.limits = limits or Limits()
        self.lock = threading.RLock()
        self.entries: dict[str, Entry] = {}
        self.snapshots: dict[str, dict] = {}
        self.gone: list[str] = []
        self._inflight: list[tuple[str, dict]] = []
        self._runtime: dict[str, Sandbox] = {}
        self._links: dict[str, AgentLink] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # ---- persistence and recovery --------------------------------------------------------------------------
    def _save(self) -> None:
        self.state.save({"sandboxes": {k: asdict(v) for k, v in self.entries.items()}, "snapshots": self.snapshots})

    def adopt(self) -> dict[str, list[str]]:
        """Load the state file; keep what is still alive in the runtime, drop and report the rest.

        Returns:
            ``{"adopted": [...], "gone": [...]}`` sandbox and snapshot ids.
        """
        if hasattr(self.backend, "gc"):  # forks a dead runtime left half made are finished or undone first
            self.backend.gc()
        data = self.state.load()
        unrecorded = self._drop_unrecorded(data or {})
        if data is None:
            return {"adopted": [], "gone": [], "unrecorded": unrecorded}
        live = {info.id: info for info in self.backend.list() if info.alive}
        adopted, gone = [], []
        with self.lock:
            for sid, raw in data.get("sandboxes", {}).items():
                info = live.get(sid)
                if info is not None and info.kind == "sandbox":
                    entry = Entry(**raw)
                    entry.pid = info.pid
                    self.entries[sid] = entry
                    adopted.append(sid)
                else:
                    gone.append(sid)
            for snap_id, raw in data.get("snapshots", {}).items():
                if snap_id in live:
                    self.snapshots[snap_id] = raw
                    adopted.append(snap_id)
                else:
                    gone.append(snap_id)
            self.gone = gone
            self._save()
        for sid in gone:
            log.warning("sandbox or snapshot %s from the previous run is gone; dropped it", sid)
        return {"adopted": adopted, "gone": gone, "unrecorded": unrecorded}

    def _drop_unrecorded(self, data: dict) -> list[str]:
        """Destroy what the runtime made for a previous run of ours that died before recording it (killed
        between the runtime's answer and the state save): nobody was ever given those ids. Returns them."""
        store = getattr(self.backend, "store", None)
        if store is None:
            return []
        known = set(data.get("sandboxes", {})) | set(data.get("snapshots", {}))
        known |= {(store.load_image(name) or {}).get("template") for name in store.image_names()}
        dropped = []
        for rec in store.all_records():
            if rec.owner == self.owner and rec.kind in ("sandbox", "snapshot") and rec.id not in known:
                try:
                    self.backend.destroy(rec.id)
                except errors.SandboxError as e:
                    log.warning("dropping unrecorded %s: %s", rec.id, e)
                log.warning("%s %s was made for the previous run but never recorded; destroyed it", rec.kind, rec.id)
                dropped.append(rec.id)
        return dropped

    # ---- lookups ------------------------------------------------------------------------------------------
    def owned(self, key: KeyInfo) -> list[Entry]:
        """The key's live sandboxes (a copy, safe while other threads create and kill)."""
        with self.lock:
            return [e for e in self.entries.values() if e.key_id == key.id]

    def owned_snapshots(self, key: KeyInfo) -> list[dict]:
        with self.lock:
            return [s for s in self.snapshots.values() if s["key_id"] == key.id]

    def get(self, sandbox_id: str, key: KeyInfo | None = None) -> Entry:
        """The entry, checking ownership when `key` is given (404 unknown, 403 another key's)."""
        entry = self.entries.get(sandbox_id)
        if entry is None:
            raise HTTPError(404, f"sandbox {sandbox_id!r} not found (it was killed, timed out or never existed)")
        if key is not None and entry.key_id != key.id:
            raise HTTPError(403, f"sandbox {sandbox_id!r} belongs to another API key")
        return entry

    def runtime(self, sandbox_id: str) -> Sandbox:
        with self.lock:
            sb = self._runtime.get(sandbox_id)
            if sb is None:
                sb = self._runtime[sandbox_id] = Sandbox(sandbox_id, self.backend)
            return sb

    def link(self, sandbox_id: str) -> AgentLink:
        entry = self.get(sandbox_id)
        if entry.state == "error":
            raise HTTPError(502, f"sandbox {sandbox_id} is not running: {entry.error}")
        with self.lock:
            link = self._links.get(sandbox_id)
            if link is None:
                link = self._links[sandbox_id] = AgentLink(self.runtime(sandbox_id), entry.pid)
            return link

    def _pid(self, sandbox_id: str) -> int:
        store = getattr(self.backend, "store", None)
        if store is not None:  # the namespace backend: read the one record, not every record (`list`)
            record = store.read_record(sandbox_id)
            if record is not None and record.pid:
                return record.pid
        for info in self.backend.list():
            if info.id == sandbox_id:
                return info.pid
        raise HTTPError(500, f"sandbox {sandbox_id} vanished right after it started")

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _reserve(self, key: KeyInfo, count: int, limits: Limits) -> tuple:
        """Check the key's quota counting live sandboxes and creations in flight, and hold `count` slots.

        Call with `lock` held; release the returned token with `_unreserve` once the sandboxes are
        registered (or failed), so concurrent creates cannot overrun the quota together.
        """
        mine = [e.limits for e in self.owned(key)] + [lim for kid, lim in self._inflight if kid == key.id]
        q = key.quota
        if q.max_sandboxes and len(mine) + count > q.max_sandboxes:
            raise HTTPError(429, f"quota exceeded: API key {key.name!r} may run {q.max_sandboxes} sandboxes "
                                 f"and has {len(mine)} live; kill some first")
        if q.max_cpus and sum(m.get("cpus", 1) for m in mine) + count * limits.cpus > q.max_cpus:
            raise HTTPError(429, f"quota exceeded: API key {key.name!r} may use {q.max_cpus} CPUs in total")
        if q.max_memory_mb and sum(m.get("memory_mb", 0) for m in mine) + count * limits.memory_mb > q.max_memory_mb:
            raise HTTPError(429, f"quota exceeded: API key {key.name!r} may use {q.max_memory_mb} MiB in total")
        token = tuple((key.id, limits.to_dict()) for _ in range(count))
        self._inflight.extend(token)
        return token

    def _unreserve(self, token: tuple) -> None:
        with self.lock:
            for item in token:
                self._inflight.remove(item)

    @staticmethod
    def _timeout(timeout: object) -> float:
        if timeout is None:
            return DEFAULT_TIMEOUT_S
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise HTTPError(400, f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {timeout!r}")
        return float(timeout)

    def _source(self, template: str, key: KeyInfo) -> str:
        if template in self.snapshots:
            return template
        by_name = next((sid for sid, s in self.snapshots.items() if template in s.get("names", [])), None)
        if by_name is not None:
            return by_name
        return TEMPLATE_ALIASES.get(template, template)

    def _add(self, sid: str, template: str, key: KeyInfo, timeout_s: float, limits: Limits,
             metadata: dict, env_vars: dict) -> Entry:
        now = time.time()
        entry = Entry(sid, template, key.id, new_access_token(), now, now + timeout_s, limits.to_dict(),
                      dict(metadata), dict(env_vars), "running", self._pid(sid))
        with self.lock:
            self.entries[sid] = entry
            self._save()
        return entry

    def create(self, key: KeyInfo, template: str, *, timeout: object = None, metadata: dict | None = None,
               env_vars: dict | None = None, limits: Limits | None = None) -> Entry:
        """Start a sandbox from an image, a template or a snapshot (id or name)."""
        if not isinstance(template, str) or not template:
            raise HTTPError(400, "templateID must be a non-empty string")
        for name, value in (("metadata", metadata), ("envVars", env_vars)):
            if value is not None and (not isinstance(value, dict)
                                      or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
                raise HTTPError(400, f"{name} must map strings to strings")
        timeout_s = self._timeout(timeout)
        limits = limits or self.limits
        with self.lock:
            token = self._reserve(key, 1, limits)
            source = self._source(template, key)
        try:
            sb = Sandbox.create(source, limits=limits, backend=self.backend, ttl=MAX_LIFETIME_S)
            with self.lock:
                self._runtime[sb.id] = sb
            return self._add(sb.id, template, key, timeout_s, limits, metadata or {}, env_vars or {})
        except errors.SandboxNotFoundError as e:
            raise HTTPError(404, f"template {template!r} not found: {e}") from e
        except ValueError as e:  # the runtime refused the name (a path, a NUL, too long)
            raise HTTPError(400, f"templateID {template!r} is not a valid template name: {e}") from e
        except errors.SandboxError as e:
            raise HTTPError(500, f"sandbox failed to start: {e}") from e
        finally:
            self._unreserve(token)

    def kill(self, sandbox_id: str, key: KeyInfo | None = None) -> None:
        with self.lock:
            entry = self.get(sandbox_id, key)
            del self.entries[entry.id]
            sb = self._runtime.pop(entry.id, None)
            link = self._links.pop(entry.id, None)
            self._save()
        if link is not None:
            link.close()
        try:
            (sb or Sandbox(entry.id, self.backend)).destroy()
        except errors.SandboxError as e:
            log.warning("destroying %s: %s", entry.id, e)

    def set_timeout(self, sandbox_id: str, key: KeyInfo, timeout: object) -> Entry:
        timeout_s = self._timeout(timeout)
        with self.lock:
            entry = self.get(sandbox_id, key)
            entry.end_at = min(time.time() + timeout_s, entry.started_at + MAX_LIFETIME_S)
            self._save()
        return entry

    def pause(self, sandbox_id: str, key: KeyInfo) -> None:
        with self.lock:
            entry = self.get(sandbox_id, key)
            if entry.state == "paused":
                raise HTTPError(409, f"sandbox {sandbox_id} is already paused")
            self.backend.pause(sandbox_id)
            entry.state = "paused"
            self._save()

    def resume(self, sandbox_id: str, key: KeyInfo, timeout: object = None, *, strict: bool = True) -> bool:
        """Thaw a paused sandbox; returns whether it was paused. `strict`: 409 when it is running."""
        with self.lock:
            entry = self.get(sandbox_id, key)
            was_paused = entry.state == "paused"
            if not was_paused and strict:
                raise HTTPError(409, f"sandbox {sandbox_id} is already running")
            if was_paused:
                self.backend.resume(sandbox_id)
                entry.state = "running"
            if timeout is not None or was_paused:
                entry.end_at = min(max(entry.end_at, time.time() + self._timeout(timeout)),
                                   entry.started_at + MAX_LIFETIME_S)
            self._save()
            return was_paused

    def snapshot(self, sandbox_id: str, key: KeyInfo, name: str | None = None) -> dict:
        if name is not None and (not isinstance(name, str) or not name):
            raise HTTPError(400, "name must be a non-empty string")
        with self.lock:
            entry = self.get(sandbox_id, key)
            if entry.state == "paused":
                raise HTTPError(409, f"sandbox {sandbox_id} is paused; resume it before taking a snapshot")
            if name is not None and any(name in s.get("names", []) for s in self.snapshots.values()):
                raise HTTPError(409, f"a snapshot named {name!r} already exists")
        self._drop_link(sandbox_id, "snapshot")
        try:
            snap_id = self.runtime(sandbox_id).snapshot()
        except errors.SandboxError as e:
            raise HTTPError(500, f"snapshot of {sandbox_id} failed: {e}") from e
        record = {"snapshotID": snap_id, "names": [name] if name else [], "key_id": key.id,
                  "sandboxID": sandbox_id, "template": entry.template, "created": time.time()}
        with self.lock:
            self.snapshots[snap_id] = record
            self._save()
        return record

    def delete_snapshot(self, snapshot_id: str, key: KeyInfo) -> None:
        with self.lock:
            snap_id = self._source(snapshot_id, key)
            record = self.snapshots.get(snap_id)
            if record is None:
                raise HTTPError(404, f"snapshot {snapshot_id!r} not found")
            if record["key_id"] != key.id:
                raise HTTPError(403, f"snapshot {snapshot_id!r} belongs to another API key")
            del self.snapshots[snap_id]
            self._save()
        try:
            self.backend.destroy(snap_id)
        except errors.SandboxError as e:
            log.warning("deleting snapshot %s: %s", snap_id, e)

    def restore(self, snapshot_id: str, key: KeyInfo, *, timeout: object = None, metadata: dict | None = None
                ) -> Entry:
        """A new sandbox from a snapshot (files and interpreter state)."""
        with self.lock:
            snap_id = self._source(snapshot_id, key)
            record = self.snapshots.get(snap_id)
            if record is None:
                raise HTTPError(404, f"snapshot {snapshot_id!r} not found")
        return self.create(key, snap_id, timeout=timeout, metadata=metadata)

    def fork(self, sandbox_id: str, key: KeyInfo, count: object = 1, timeout: object = None) -> list[Entry]:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK:
            raise HTTPError(400, f"count must be an int in [1, {MAX_FORK}], got {count!r}")
        with self.lock:
            entry = self.get(sandbox_id, key)
            if entry.state == "paused":
                raise HTTPError(409, f"sandbox {sandbox_id} is paused; resume it before forking")
            timeout_s = self._timeout(timeout) if timeout is not None else max(1.0, entry.end_at - time.time())
            limits = Limits.from_dict(entry.limits)
            token = self._reserve(key, count, limits)
        try:
            self._drop_link(sandbox_id, "fork")
            try:
                kids = self.runtime(sandbox_id).fork(count, ttl=MAX_LIFETIME_S)
            except errors.SandboxError as e:
                raise HTTPError(500, f"fork of {sandbox_id} failed: {e}") from e
            out = []
            for kid in kids:
                with self.lock:
                    self._runtime[kid.id] = kid
                out.append(self._add(kid.id, entry.template, key, timeout_s, limits, entry.metadata,
                                     entry.env_vars))
            return out
        finally:
            self._unreserve(token)

    def _drop_link(self, sandbox_id: str, reason: str) -> None:
        """Forget pooled agent connections: fork and snapshot (`reason`) kill the sandbox's processes (the agent
        too: the sandbox moves onto a new writable layer, which running processes could not follow)."""
        with self.lock:
            link = self._links.pop(sandbox_id, None)
        if link is not None:
            link.retire(reason)

    # ---- reaper -------------------------------------------------------------------------------------------
    def _dead_init(self, entry: Entry) -> str | None:
        """Why `entry`'s init (tool server) is gone, or None while it runs."""
        try:
            with open(f"/proc/{entry.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X"):
                    return None
        except (OSError, IndexError):
            pass
        cgroup = getattr(self.backend, "_cgroup", None)
        oom = cgroup(entry.id).oom_kills() if cgroup is not None else 0
        if oom:
            return f"killed by the OOM killer ({oom} kill(s) at memory_mb={entry.limits.get('memory_mb')})"
        return "its init process was killed or exited (the memory controller recorded no kill)"

    def check_inits(self) -> list[str]:
        """Move sandboxes whose init died to state ``error`` with the reason and reclaim their resources now."""
        failed = []
        for entry in list(self.entries.values()):
            if entry.state == "error" or not entry.pid:
                continue
            reason = self._dead_init(entry)
            if reason is None:
                continue
            log.warning("sandbox %s died: %s", entry.id, reason)
            with self.lock:
                sb = self._runtime.pop(entry.id, None)
                link = self._links.pop(entry.id, None)
            if link is not None:
                link.close()
            try:
                (sb or Sandbox(entry.id, backend=self.backend)).destroy()
            except errors.SandboxError as e:
                log.warning("reclaiming dead sandbox %s: %s", entry.id, e)
            # published only once reclaimed: a client that sees `error` finds no record, cgroup or mount left
            with self.lock:
                entry.state, entry.error = "error", reason
                self._save()
            failed.append(entry.id)
        return failed

    def start_reaper(self, period_s: float = 0.5) -> None:
        def loop() -> None:
            while not self._stop.wait(period_s):
                self.check_inits()
                now = time.time()
                # a paused sandbox's clock stands still (as on E2B) until its lifetime cap
                due = [e.id for e in list(self.entries.values())
                       if (e.end_at <= now and e.state != "paused") or e.started_at + MAX_LIFETIME_S <= now]
                for sid in due:
                    log.info("sandbox %s reached its timeout; killing it", sid)
                    try:
                        self.kill(sid)
                    except HTTPError:
                        pass

        self._reaper = threading.Thread(target=loop, name="agentenv-reaper", daemon=True)
        self._reaper.start()

    def stop(self, *, kill_all: bool = False) -> None:
        """Stop the reaper; with `kill_all` also kill every sandbox and delete every snapshot (else they stay
        alive for the next server to adopt)."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        with self.lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        if kill_all:
            for sid in list(self.entries):
                self.kill(sid)
            for snap_id in list(self.snapshots):
                with self.lock:
                    self.snapshots.pop(snap_id, None)
                    self._save()
                try:
                    self.backend.destroy(snap_id)
                except errors.SandboxError as e:
                    log.warning("deleting snapshot %s: %s", snap_id, e)
            # the image seeds go too, unless another user of the data directory still has sandboxes there
            if not any(i.kind in ("sandbox", "snapshot") for i in self.backend.list()):
                self.backend.gc(everything=True)
        self.state.close()
