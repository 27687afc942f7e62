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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from agentenv import errors
from agentenv.limits import Limits
from agentenv.protocol import SandboxInfo
from agentenv.runtime import cgroups, egress, images, rootfs, spawner
from agentenv.runtime.backend import Backend
from agentenv.runtime.client import Connection
from agentenv.runtime.store import HOST_UID, UID_RANGE, Record, Store, default_home, drain_releases, proc_start_time

log = logging.getLogger(__name__)

# A new sandbox is cloned inside its seed's cgroup and moved to its own right after; what the kernel charged
# meanwhile (page tables, namespace objects: about 1 MB a sandbox here) stays on the seed's memory cgroup for
# the sandbox's lifetime, so the seed gets no memory limit: an OOM kill there would take every sandbox along
# (their pid namespaces nest in the seed's).
SEED_LIMITS = Limits(memory_mb=1 << 20, pids=4096, cpus=0, disk_mb=16, disk_in_memory=True)
SEED_START_TIMEOUT_S = 20.0
SNAPSHOT_LAYER_BYTES = 1 << 20
"""Writable layer of a snapshot's tool server: it serves only forks, so nothing is written there."""
MAX_FORK_PER_CALL = 64
HOST_PYTHON = "/usr/bin/python3"
_SRC = str(Path(__file__).resolve().parents[2])
_BOOT = "import sys; sys.path.insert(0, {src!r}); from agentenv.runtime.toolserver import bootstrap; import json; " \
        "bootstrap(json.loads(sys.argv[1]))"


def _new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(6).hex()}"


class NamespaceBackend(Backend):
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

    # ---- seeds ----------------------------------------------------------------------------------------
    def _image(self, name: str) -> dict:
        manifest = self.store.load_image(name)
        if manifest is None and name == "host":
            manifest = images.build_host(self.store)
        if manifest is None:
            known = ", ".join(self.store.image_names()) or "none"
            raise errors.SandboxNotFoundError(
                f"unknown image {name!r} (built: {known}); build one with `agentenv image build NAME --from PATH`"
            )
        return manifest

    def _seed(self, image: str) -> Record:
        sid = f"seed-{image}"
        rec = self.store.read_record(sid)
        if rec is not None and self._alive(rec):
            return rec
        if rec is not None:
            self._reclaim(rec)
        return self._start_seed(sid, image, self._image(image))

    def _start_seed(self, sid: str, image: str, manifest: dict) -> Record:
        upper = self.store.new_writable_layer(SEED_LIMITS.disk_mb << 20, in_memory=SEED_LIMITS.disk_in_memory)
        cg = self._cgroup(sid)
        listener = sync_host = sync_child = proc = None
        root_fd = -1
        try:
            cg.create(cgroups.CgroupLimits(SEED_LIMITS.memory_mb << 20, SEED_LIMITS.pids, SEED_LIMITS.cpus))
            listener = self._listener(sid)
            sync_host, sync_child = socket.socketpair()
            root_fd = self._overlay(manifest["layers"], upper)
            config = {
                "id": sid,
                "root_fd": root_fd,
                "usr_bind": bool(manifest.get("usr_bind")),
                "sync_fd": sync_child.fileno(),
                "listen_fd": listener.fileno(),
            }
            proc = subprocess.Popen(
                [HOST_PYTHON, "-I", "-S", "-c", _BOOT.format(src=_SRC), json.dumps(config)],
                pass_fds=(sync_child.fileno(), listener.fileno(), root_fd),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                preexec_fn=lambda: cg.add(os.getpid()),
                env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
            )
            sync_child.close()
            listener.close()
            sync_host.settimeout(SEED_START_TIMEOUT_S)
            if sync_host.recv(1) != b"u":
                raise errors.SandboxError(f"seed for {image!r} died at start: {proc.stderr.read().decode()[-2000:]}")
            for name in ("uid_map", "gid_map"):
                Path(f"/proc/{proc.pid}/{name}").write_text(f"0 {HOST_UID} {UID_RANGE}\n")
            sync_host.sendall(b"m")
            status = sync_host.recv(4096)
            proc.wait(timeout=SEED_START_TIMEOUT_S)
            if status != b"r":
                raise errors.SandboxError(f"seed for {image!r} failed to start: {status[1:].decode(errors='replace')}")
            conn = Connection(self.store.sock(sid), sid)
            pid = conn.peer_pid()
            conn.close()
            rec = Record(sid, "seed", image, pid, proc_start_time(pid) or 0, None, list(manifest["layers"]), upper,
                         bool(manifest.get("usr_bind")), SEED_LIMITS.to_dict(), time.time(), None)
            self.store.write_record(rec)
            return rec
        except BaseException:
            cg.destroy()
            self.store.remove_layer(upper)
            self.store.delete_record(sid)
            raise
        finally:
            if root_fd >= 0:
                os.close(root_fd)
            for s in (sync_host, sync_child, listener):
                if s is not None:
                    s.close()
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if proc.stderr is not None:
                    proc.stderr.close()

    def _overlay(self, lowers: list[str] | tuple[str, ...], upper: str) -> int:
        """A detached overlay of layer ids `lowers` (top first) under writable layer `upper`."""
        base = str(self.store.layers)
        return rootfs.overlay_fd([f"{base}/{layer}/diff" for layer in lowers], f"{base}/{upper}/diff",
                                 f"{base}/{upper}/work")

    # ---- fork: the one primitive behind create, fork, snapshot and restore ----------------------------
    def _fork(self, parent: Record, kinds: list[str], limits: Limits, *, rebase: bool, ttl_s: float | None,
              image: str | None = None) -> list[Record]:
        ids = [_new_id("snap" if kind == "snapshot" else "sb") for kind in kinds]
        fork_id = os.urandom(8).hex()
        journal = self.store.begin_fork(fork_id, parent, ids)
        try:
            return self._fork_journaled(fork_id, parent, kinds, ids, limits, rebase=rebase, ttl_s=ttl_s, image=image)
        finally:
            journal.unlink(missing_ok=True)

    def _fork_journaled(self, fork_id: str, parent: Record, kinds: list[str], ids: list[str], limits: Limits, *,
                        rebase: bool, ttl_s: float | None, image: str | None) -> list[Record]:
        store = self.store
        clock = _Clock()
        before = dataclasses.replace(parent)
        lowers = list(parent.lowers)
        with_net = limits.network.egress and "sandbox" in kinds
        if with_net:
            self.egress.check()  # before anything is made
        # moving: the parent's writable layer is sealed (becomes the top lower of every child) and the parent
        # moves onto a new one, which the host prepares while the tool server clones (see `move` below)
        moving = rebase and not store.is_empty(parent.upper)
        if moving:
            lowers = [parent.upper, *lowers]
        new_parent_upper: str | None = None
        now = time.time()
        children: list[Record] = []
        listeners: list[socket.socket] = []
        opened: list[int] = []
        conns: dict[str, Connection] = {}
        sent_move = False
        try:
            for kind, cid in zip(kinds, ids):
                if kind == "snapshot":  # runs no agents, so writes nothing: a token tmpfs, not a disk
                    upper = store.new_writable_layer(SNAPSHOT_LAYER_BYTES, in_memory=True)
                else:
                    upper = store.new_writable_layer(limits.disk_mb << 20, in_memory=limits.disk_in_memory)
                children.append(Record(cid, kind, image or parent.image, 0, 0, parent.id, lowers, upper,
                                       parent.usr_bind, limits.to_dict(), now,
                                       None if ttl_s is None else now + ttl_s, owner=self.owner))
                listeners.append(self._listener(cid))
            cg_limits = cgroups.CgroupLimits(limits.memory_mb << 20, limits.pids, limits.cpus)
            self._prepare_later([self._cgroup(c.id) for c in children], cg_limits)
            clock.mark("layers_ms")

            def root(upper: str) -> int:
                fd = self._overlay(lowers, upper)
                opened.append(fd)
                return fd

            # a snapshot cloned before its parent moves off the sealed layer stays in the sealed root
            own_root = [c.kind == "sandbox" or not moving for c in children]
            fds: list[int] = []
            for child, listener, own in zip(children, listeners, own_root):
                fds += [root(child.upper), listener.fileno()] if own else [listener.fileno()]
            clock.mark("overlays_ms")
            move_fd = -1

            def prepare_move() -> None:
                nonlocal new_parent_upper, move_fd
                new_parent_upper = store.new_writable_layer(int(parent.limits.get("disk_mb", 1024)) << 20,
                                                            in_memory=bool(parent.limits.get("disk_in_memory")))
                move_fd = root(new_parent_upper)
                # written now, reverted below if the tool server does not answer the fork
                store.write_record(dataclasses.replace(parent, lowers=lowers, upper=new_parent_upper))

            conn = Connection(store.sock(parent.id), parent.id)
            try:
                # the host's bookkeeping runs here, while the tool server sets its children up
                def on_child(event: dict, pid: int | None) -> None:
                    child = children[int(event["index"])]
                    if pid is None:
                        raise errors.SandboxError(f"fork of {parent.id}: no pid for child {child.id}")
                    if event["ev"] == "kernel":  # a Python kernel carried into the child: into its cgroup too
                        self._add_later(self._cgroup(child.id), pid)
                        return
                    child.pid = pid
                    child.start_time = proc_start_time(pid) or 0
                    self._attach_later(self._cgroup(child.id), pid, cg_limits)
                    store.write_record(child)
                    conns[child.id] = Connection(store.sock(child.id), child.id)
                    if moving and new_parent_upper is None:
                        prepare_move()

                reply, _ = conn.request({"op": "fork", "fork_id": fork_id, "rebase": moving,
                                         "usr_bind": parent.usr_bind,
                                         "children": [{"id": c.id, "deadline": c.expires_at, "own_root": own,
                                                       "nproc": spawner.nproc_for(limits.pids),
                                                       "memory_bytes": limits.memory_mb << 20}
                                                      for c, own in zip(children, own_root)]},
                                        fds=fds, timeout_s=30.0, on_child=on_child)
                if moving:
                    if new_parent_upper is None:
                        prepare_move()
                    # the tool server reads this before any other request and moves onto the new layer; without
                    # it (we fail or die first) it kills the children and stays where it is
                    conn.send({"op": "move"}, fds=[move_fd])
                    sent_move = True
            finally:
                conn.close()
            clock.mark("request_ms")
            if moving:
                parent.lowers, parent.upper = lowers, new_parent_upper
            if reply.get("failed"):  # the parent moves, but some children did not come up
                raise errors.SandboxError(f"fork of {parent.id}: {'; '.join(reply['failed'])}")
            used = {r.net["slot"] for r in store.all_records() if r.net} if with_net else set()
            for child in children:
                cconn = conns.pop(child.id, None) or Connection(store.sock(child.id), child.id)
                if not child.pid:  # a tool server that sent no child event: ask the child itself
                    child.pid = cconn.peer_pid()
                    child.start_time = proc_start_time(child.pid) or 0
                    self._attach_later(self._cgroup(child.id), child.pid, cg_limits)
                    store.write_record(child)
                if with_net and child.kind == "sandbox":
                    slot = self.egress.allocate(used)
                    used.add(slot.index)
                    child.net = {"slot": slot.index}
                    store.write_record(child)  # before the veth exists, so gc finds the slot if we die
                    self.egress.attach(slot, child.pid, limits.network)
                if child.kind == "sandbox":
                    self._pending[child.id] = cconn
                else:
                    cconn.close()
            clock.mark("records_ms")
            for child in children:
                self.settle(child.id)
            clock.mark("settle_ms")
            self.last_fork_phases = {**clock.phases, "tool_server": reply.get("phases")}
            log.debug("fork of %s (%d lower layers): %s", parent.id, len(lowers), self.last_fork_phases)
        except BaseException:
            for cconn in conns.values():
                cconn.close()
            for child in children:  # children handed to _pending before a later child failed (egress, settle)
                pending = self._pending.pop(child.id, None)
                if pending is not None:
                    pending.close()
                self._reclaim(child)
            if new_parent_upper is not None and not sent_move:
                store.write_record(before)  # the parent did not move: its record as before the fork
                store.remove_layer(new_parent_upper)
            raise
        finally:
            for fd in opened:
                os.close(fd)
            for listener in listeners:
                listener.close()
        return children

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

    def gc(self, *, everything: bool = False) -> dict:
        """Reclaim dead, expired and orphaned state; with `everything`, stop every sandbox and seed too.

        Returns:
            Counts of what was removed: ``records``, ``cgroups``, ``layers``, ``network`` (egress slots).
        """
        removed = {"records": 0, "cgroups": 0, "layers": 0}
        self.settle()
        with self.store.locked():
            removed["forks"] = self._recover_forks()
            for conn in self._pending.values():
                conn.close()
            self._pending.clear()
            now = time.time()
            records = self.store.all_records()
            for rec in sorted(records, key=lambda r: -r.created):
                if self.store.read_record(rec.id) is None:
                    continue  # released with a child above
                expired = rec.kind == "sandbox" and rec.expires_at is not None and rec.expires_at <= now
                if everything or not self._alive(rec):
                    # a dead pid 1 took every sandbox forked below it along; the records go too
                    self._reclaim(rec)
                    removed["records"] += 1
                elif expired or (rec.kind == "retired" and not self._children(rec.id)):
                    self._release(rec)
                    removed["records"] += 1
            self.store.remove_dead_writes()  # a runtime killed inside write_record
            live = {r.id for r in self.store.all_records()}
            for names in cgroups.leftover_groups(self.cgroup_group, self.cgroup_root).values():
                for name in names:
                    if name not in live:
                        self._cgroup(name).destroy()
                        removed["cgroups"] += 1
            in_use = self.store.referenced_layers()
            for layer in self.store.layer_ids():
                if layer not in in_use and (not layer.startswith("i") or layer.startswith(".")):
                    self.store.remove_layer(layer)
                    removed["layers"] += 1
            removed["network"] = self.egress.reconcile({r.net["slot"] for r in self.store.all_records() if r.net})
            for sock in self.store.records.glob("*.sock"):
                if sock.stem not in live:
                    sock.unlink(missing_ok=True)
            drain_releases()  # removed layers' filesystems torn down, their loop devices released
            if not live:
                for controller in cgroups.CONTROLLERS:
                    try:
                        (self.cgroup_root / controller / self.cgroup_group).rmdir()
                    except OSError:  # absent, or a sandbox appeared meanwhile
                        pass
        return removed


    def _recover_forks(self) -> int:
        """Finish or undo the forks whose runtime died midway (see `Store.begin_fork`); returns how many.

        The parent's tool server knows the outcome: ``done``/``moved`` (it answered, and moved onto its new
        layer when asked): the children stay, joined to their cgroups now if the dead runtime had not done it
        yet. Anything else (it killed the children when the runtime vanished, never got the request, or is
        dead itself): the children's records go and the parent's record is put back as before the fork.
        """
        recovered = 0
        for fork_id, writer_alive, parent, child_ids in self.store.pending_forks():
            if writer_alive:
                continue
            live = self.store.read_record(parent.id)
            outcome = "unknown"
            if live is not None and live.kind != "retired" and self._alive(live):
                try:
                    conn = Connection(self.store.sock(parent.id), parent.id)
                    try:
                        outcome = conn.request({"op": "fork_outcome", "fork_id": fork_id}, timeout_s=10.0)[0]["outcome"]
                    finally:
                        conn.close()
                except errors.SandboxError as e:
                    log.warning("fork %s of %s: asking the parent failed: %s", fork_id, parent.id, e)
            for cid in child_ids:
                rec = self.store.read_record(cid)
                if rec is None:
                    self._kill_unrecorded(cid)
                elif outcome in ("done", "moved") and self._alive(rec):
                    cg = self._cgroup(cid)
                    lim = Limits.from_dict(rec.limits)
                    cg.create(cgroups.CgroupLimits(lim.memory_mb << 20, lim.pids, lim.cpus))
                    cg.add(rec.pid)
                else:
                    self._reclaim(rec)
            if outcome not in ("done", "moved") and live is not None and live.upper != parent.upper:
                self.store.write_record(dataclasses.replace(live, lowers=parent.lowers, upper=parent.upper))
            self.store.end_fork(fork_id)
            log.info("fork %s of %s, cut short by its runtime's death: %s", fork_id, parent.id,
                     "kept" if outcome in ("done", "moved") else "undone")
            recovered += 1
        return recovered

    def _kill_unrecorded(self, sid: str) -> None:
        """Kill a tool server that has a socket but no record (cloned, then its runtime died)."""
        path = self.store.sock(sid)
        if not path.exists():
            return
        try:
            conn = Connection(path, sid)
            try:
                os.kill(conn.peer_pid(), 9)
            finally:
                conn.close()
        except (errors.SandboxError, OSError):  # gone meanwhile
            pass
        path.unlink(missing_ok=True)


class _Clock:
    """Milliseconds between successive `mark` calls."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round((now - self._last) * 1e3, 3)
        self._last = now


def _check_ttl(ttl_s: float | None) -> None:
    if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
        raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")

