"""The embedded default backend: Linux namespaces, overlayfs layers, cgroups and seccomp on this host.

Shape (see DESIGN.md §4): every sandbox is a tool server that is pid 1 of its own pid namespace, inside
its own user namespace (uid 0 maps to the unprivileged host range at `store.HOST_UID`), mount, net, uts,
ipc and cgroup namespaces, rooted in an overlayfs stack of read-only layers plus one writable layer (its own
ext4 of the disk quota's size, see `agentenv.runtime.disk`; a tmpfs with `Limits.disk_in_memory`).

* `create(image)` forks the image's *seed* (a pristine tool server started once per image) into a new
  sandbox, so it costs a fork, not an interpreter start.
* `fork(n)` seals the sandbox's writable layer as a read-only layer (no copy), moves the parent onto a fresh
  writable layer over it, and forks the tool server n times, each child over its own fresh layer.
* `snapshot()` is a fork whose child keeps the sealed root it was cloned in and serves nothing but forks
  (no agents run in it, so its state cannot change); `restore()` forks it.

Forked pid and user namespaces nest inside their parent's, so a tool server stays alive (``retired``) while
sandboxes forked from it live, and its record goes when the last one is destroyed.

The class is assembled from mixins: `seeding` (images' seeds), `forking` (the fork protocol with the tool
server, under a journal), `recovery` (`gc` and finishing forks whose runtime died); this module keeps the
public operations and the release of sandboxes.
"""

from __future__ import annotations

import logging
import os
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from agentenv import errors
from agentenv.limits import Limits
from agentenv.protocol import SandboxInfo
from agentenv.runtime import cgroups, egress, rootfs
from agentenv.runtime.backend import Backend
from agentenv.runtime.client import Connection
from agentenv.runtime.forking import Forking
from agentenv.runtime.recovery import Recovery
from agentenv.runtime.seeding import HOST_PYTHON, SEED_LIMITS, Seeds
from agentenv.runtime.store import Record, Store, default_home, proc_start_time

__all__ = ["SEED_LIMITS", "NamespaceBackend"]

log = logging.getLogger(__name__)

MAX_FORK_PER_CALL = 64


class NamespaceBackend(Seeds, Forking, Recovery, Backend):
    """Sandboxes as namespaced tool servers on this host (needs root).

    Args:
        home: data directory (default `$AGENTENV_HOME` or /var/lib/agentenv).
        cgroup_root: where the cgroup v1 hierarchies are mounted.
        egress_range: private IPv4 range the veths of sandboxes with egress take their /30s from
            (default `egress.EGRESS_RANGE`); give each data directory on one host its own.
    """

    def __init__(self, home: Path | str | None = None, cgroup_root: Path = cgroups.CGROUP_ROOT,
                 egress_range: str = egress.EGRESS_RANGE):
        if os.geteuid() != 0:
            raise errors.SandboxError("the namespace backend needs root (it mounts, maps uids and writes cgroups)")
        if not Path(HOST_PYTHON).exists():
            raise errors.SandboxError(f"{HOST_PYTHON} is missing: the in-sandbox tool server runs with it")
        self.store = Store(Path(home) if home is not None else default_home())
        self.cgroup_root = cgroup_root
        self.cgroup_group = cgroups.group_for(str(self.store.home))
        self.egress = egress.Egress(self.cgroup_group, self.store.home, egress_range)
        self._pending: dict[str, Connection] = {}
        # Moving a task between v1 cgroups waits for an RCU grace period (~7 ms here), so new sandboxes join
        # their cgroups on a worker thread while the host finishes the rest of the fork; every public call
        # settles the moves before it returns, so limits are in force once a sandbox is handed out.
        self._attacher: ThreadPoolExecutor | None = None
        self._attaching: dict[str, Future] = {}
        self.owner: str | None = None
        """Written into the record of every sandbox and snapshot made here: a server sets its state directory,
        so its next run can tell what it made but never recorded (it died in between)."""
        self.last_fork_phases: dict = {}
        """Where the last fork (create, fork, snapshot, restore) spent its time, in ms: host steps + tool server's."""

    # ---- records and connections ---------------------------------------------------------------------
    def _record(self, sid: str, kinds: tuple[str, ...] = ("sandbox",)) -> Record:
        rec = self.store.read_record(sid)
        if rec is None or rec.kind not in kinds:
            what = "snapshot" if kinds == ("snapshot",) else "sandbox"
            raise errors.SandboxNotFoundError(f"no live {what} with id {sid!r} (see `agentenv ls`)")
        return rec

    def _alive(self, rec: Record) -> bool:
        return proc_start_time(rec.pid) == rec.start_time

    def connect(self, sandbox_id: str) -> Connection:
        conn = self._pending.pop(sandbox_id, None)
        if conn is not None:
            return conn
        self._record(sandbox_id)
        return Connection(self.store.sock(sandbox_id), sandbox_id)

    def _worker(self) -> ThreadPoolExecutor:
        if self._attacher is None:
            self._attacher = ThreadPoolExecutor(1, thread_name_prefix="agentenv-cgroup")
        return self._attacher

    def _prepare_later(self, cgs: list[cgroups.Cgroup], limits: cgroups.CgroupLimits) -> None:
        """Before a fork: start the grace period the children's moves will wait for, and create their groups."""
        worker = self._worker()
        worker.submit(cgroups.warm_migration_lock, self.cgroup_root)
        for cg in cgs:
            self._attaching[cg.name] = worker.submit(cg.create, limits)

    def _attach_later(self, cg: cgroups.Cgroup, pid: int, limits: cgroups.CgroupLimits) -> None:
        """Create `cg` with `limits` (unless `_prepare_later` did) and move `pid` into it, on the worker thread."""
        prepared = self._attaching.pop(cg.name, None)

        def attach() -> None:
            if prepared is None:
                cg.create(limits)
            else:
                prepared.result()  # the worker ran it already (one thread, in order); re-raise its error
            cg.add(pid)

        self._attaching[cg.name] = self._worker().submit(attach)

    def _add_later(self, cg: cgroups.Cgroup, pid: int) -> None:
        """Move `pid` into `cg` on the worker thread, after the group's pending creation and moves."""
        before = self._attaching.pop(cg.name, None)

        def add() -> None:
            if before is not None:
                before.result()
            try:
                cg.add(pid)
            except ProcessLookupError:  # that kernel is gone already
                pass

        self._attaching[cg.name] = self._worker().submit(add)

    def settle(self, sandbox_id: str | None = None) -> None:
        """Wait until the cgroup work (creation, moves) of new sandboxes (one, or all) is done."""
        ids = [sandbox_id] if sandbox_id is not None else list(self._attaching)
        for sid in ids:
            future = self._attaching.pop(sid, None)
            if future is not None:
                try:
                    future.result()
                except OSError as e:  # the process is gone already; its reclaim cleans up
                    log.debug("cgroup attach of %s failed: %s", sid, e)

    def _cgroup(self, sid: str) -> cgroups.Cgroup:
        return cgroups.Cgroup(sid, self.cgroup_group, self.cgroup_root)

    def _listener(self, sid: str) -> socket.socket:
        path = self.store.sock(sid)
        if path.exists():
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(64)
        return sock

    def _overlay(self, lowers: list[str] | tuple[str, ...], upper: str) -> int:
        """A detached overlay of layer ids `lowers` (top first) under writable layer `upper`."""
        base = str(self.store.layers)
        return rootfs.overlay_fd([f"{base}/{layer}/diff" for layer in lowers], f"{base}/{upper}/diff",
                                 f"{base}/{upper}/work")

    # ---- fork: the one primitive behind create, fork, snapshot and restore ----------------------------
    # ---- public operations ----------------------------------------------------------------------------
    def create(self, source: str, limits: Limits, *, ttl_s: float | None = None) -> str:
        _check_ttl(ttl_s)
        if source.startswith("snap-"):
            return self.restore(source, limits, ttl_s=ttl_s)
        manifest = self.store.load_image(source)
        if manifest is not None and manifest.get("template"):
            return self.restore(self._template_snapshot(source, manifest), limits, ttl_s=ttl_s)
        with self.store.locked():
            manifest = self._image(source)
            if manifest.get("template"):
                return self.restore(manifest["template"], limits, ttl_s=ttl_s)
            seed = self._seed(source)
            (child,) = self._fork(seed, ["sandbox"], limits, rebase=False, ttl_s=ttl_s, image=source)
            return child.id

    def fork(self, sandbox_id: str, n: int, *, ttl_s: float | None = None) -> list[str]:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096:
            raise ValueError(f"n must be an int in [1, 4096], got {n!r}")
        _check_ttl(ttl_s)
        with self.store.locked():
            parent = self._record(sandbox_id)
            limits = Limits.from_dict(parent.limits)
            ids: list[str] = []
            try:
                while len(ids) < n:
                    k = min(MAX_FORK_PER_CALL, n - len(ids))
                    ids += [c.id for c in self._fork(self._record(sandbox_id), ["sandbox"] * k, limits,
                                                     rebase=True, ttl_s=ttl_s)]
            except BaseException:
                for sid in ids:
                    self.destroy(sid)
                raise
            return ids

    def snapshot(self, sandbox_id: str) -> str:
        with self.store.locked():
            parent = self._record(sandbox_id)
            (snap,) = self._fork(parent, ["snapshot"], Limits.from_dict(parent.limits), rebase=True, ttl_s=None)
            return snap.id

    def restore(self, snapshot_id: str, limits: Limits | None = None, *, ttl_s: float | None = None) -> str:
        _check_ttl(ttl_s)
        with self.store.locked():
            snap = self._record(snapshot_id, ("snapshot",))
            (child,) = self._fork(snap, ["sandbox"], limits or Limits.from_dict(snap.limits), rebase=False,
                                  ttl_s=ttl_s)
            return child.id

    def template(self, name: str, image: str = "host", setup: list[str] | tuple[str, ...] = (),
                 timeout_s: float = 600.0) -> str:
        """Build a template: start `image`, run each `setup` command (must exit 0), seal it as a snapshot.

        `create(name)` then restores that snapshot, so every sandbox starts with the setup done.

        Returns:
            The template's snapshot id.

        Raises:
            SandboxError: a setup command failed (its output is in the message); nothing is left behind.
        """
        base = self._image(image)
        self.store.image_path(name)  # validates the name
        sid = self.create(image, Limits())
        try:
            conn = self.connect(sid)
            try:
                for cmd in setup:
                    reply, _ = conn.request({"op": "exec", "cmd": cmd, "env": None, "cwd": None,
                                             "timeout": timeout_s, "max_output": None}, timeout_s=timeout_s)
                    if reply["exit_code"] != 0:
                        raise errors.SandboxError(f"template {name!r}: {cmd!r} exited with {reply['exit_code']}: "
                                                  f"{(reply['stdout'] + reply['stderr'])[-2000:]}")
            finally:
                conn.close()
            snap = self.snapshot(sid)
        finally:
            try:
                self.destroy(sid)
            except errors.SandboxNotFoundError:
                pass
        self.store.save_image(name, {"name": name, "layers": [], "usr_bind": bool(base.get("usr_bind")),
                                     "template": snap, "from": image, "setup": list(setup)})
        return snap

    def _template_snapshot(self, name: str, manifest: dict) -> str:
        """The live snapshot of template `name`; rebuilt from its image and setup when it is gone (a `gc` with
        ``everything``, a reboot)."""
        snap = manifest["template"]
        rec = self.store.read_record(snap)
        if rec is not None and rec.kind == "snapshot" and self._alive(rec):
            return snap
        log.info("template %s: snapshot %s is gone; rebuilding it from its setup", name, snap)
        return self.template(name, manifest.get("from") or "host", manifest.get("setup") or ())

    def pause(self, sandbox_id: str) -> None:
        self._record(sandbox_id)
        self.settle(sandbox_id)
        self._cgroup(sandbox_id).freeze()

    def resume(self, sandbox_id: str) -> None:
        self._record(sandbox_id)
        self._cgroup(sandbox_id).thaw()

    def destroy(self, sandbox_id: str) -> None:
        with self.store.locked():
            rec = self._record(sandbox_id, ("sandbox", "snapshot"))
            conn = self._pending.pop(sandbox_id, None)
            if conn is not None:
                conn.close()
            self._release(rec)

    def _children(self, sid: str) -> list[Record]:
        return [r for r in self.store.all_records() if r.parent == sid]

    def _release(self, rec: Record) -> None:
        """Destroy `rec`, or retire it while sandboxes forked from it live; then release retired ancestors."""
        while rec is not None:
            if rec.kind == "seed" or self._children(rec.id) and self._alive(rec):
                if rec.kind != "seed" and rec.kind != "retired":
                    self._retire(rec)
                return
            parent = self.store.read_record(rec.parent) if rec.parent else None
            self._reclaim(rec)
            rec = parent if parent is not None and parent.kind == "retired" else None

    def _retire(self, rec: Record) -> None:
        cg = self._cgroup(rec.id)
        cg.thaw()
        try:
            conn = Connection(self.store.sock(rec.id), rec.id)
            try:
                conn.request({"op": "kill_agents"}, timeout_s=10.0)
            finally:
                conn.close()
        except errors.SandboxError as e:
            log.debug("retiring %s: %s", rec.id, e)
        unplugged = rec.net is not None
        if unplugged:  # nothing runs in it any more: its veth, rules and slot go now, not with its last fork
            self.egress.detach(rec.net["slot"])
            rec.net = None
        rec.kind = "retired"
        self.store.write_record(rec)
        self.store.sock(rec.id).unlink(missing_ok=True)
        if unplugged and not any(r.net for r in self.store.all_records()):
            self.egress.teardown()

    def _reclaim(self, rec: Record) -> None:
        """Kill the tool server (all its processes), remove its cgroup, record and unreferenced layers."""
        self.settle(rec.id)
        if rec.net:  # unplug first: no packet of a dying sandbox re-creates conntrack state after the flush
            self.egress.detach(rec.net["slot"])
        self._cgroup(rec.id).destroy()
        self.store.delete_record(rec.id)
        if rec.net and not any(r.net for r in self.store.all_records()):
            self.egress.teardown()
        in_use = self.store.referenced_layers()
        for layer in [rec.upper, *rec.lowers]:
            if layer not in in_use and not layer.startswith("i"):
                self.store.remove_layer(layer)

    def list(self) -> list[SandboxInfo]:
        return [
            SandboxInfo(r.id, r.kind, r.image, r.pid, r.parent, r.created, r.expires_at, [*r.lowers, r.upper],
                        self._alive(r))
            for r in sorted(self.store.all_records(), key=lambda r: r.created)
        ]

def _check_ttl(ttl_s: float | None) -> None:
    if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
        raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")

