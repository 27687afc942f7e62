"""The data directory: layers, images and sandbox records, all under one root (`AGENTENV_HOME`).

```
<home>/layers/<id>/diff      a layer's files; image layers live on disk and are named by content hash,
<home>/layers/<id>/work      writable layers are mounts of their own ext4 of the quota's size (see
                             `agentenv.runtime.disk`), or tmpfs mounts of that size when asked to live in
                             memory (the mount is the quota; sealing one for a snapshot or fork just stops
                             writing to it)
<home>/disks/tpl-<bytes>.img the formatted empty filesystem a writable layer of that size is copied from
<home>/images/<name>.json    {"layers": [top first], "usr_bind": bool, "template": snapshot id or null}
<home>/sandboxes/<id>.json   one record per live tool server (sandbox, snapshot, seed or retired)
<home>/sandboxes/<id>.sock   its listening socket
<home>/forks/<fork id>.json  a fork in progress: who runs it, the parent's record before it, the children
<home>/lock                  flock for every change to the above; holds a counter of record changes
```
A layer is referenced by the records and images that list it and is removed when none does.
Every record change (under the lock) first bumps the counter in the lock file, so a process holding the lock
can reuse the records it read earlier while the counter has not moved (`all_records` under the lock reads the
directory once, not on every call of a destroy).
Files inside layers are owned by the unprivileged host uid range the sandboxes' root maps to.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentenv.runtime import syscalls as sc
from agentenv.runtime.disk import LayerDisks

log = logging.getLogger(__name__)

HOST_UID = 100_000
"""First host uid (and gid) of the range a sandbox's uids 0..65535 map to."""
UID_RANGE = 65_536
DEFAULT_HOME = "/var/lib/agentenv"


def default_home() -> Path:
    """`$AGENTENV_HOME`, else /var/lib/agentenv."""
    return Path(os.environ.get("AGENTENV_HOME") or DEFAULT_HOME)


@dataclass
class Record:
    """What the host keeps about one tool server."""

    id: str
    kind: str
    """``sandbox``, ``snapshot``, ``seed`` or ``retired``."""
    image: str
    pid: int
    start_time: int
    """Start time of `pid` in clock ticks after boot (guards against pid reuse)."""
    parent: str | None
    lowers: list[str]
    """Read-only layer ids, top first."""
    upper: str
    """Writable layer id."""
    usr_bind: bool
    limits: dict = field(default_factory=dict)
    created: float = 0.0
    expires_at: float | None = None
    net: dict | None = None
    """``{"slot": n}`` when the sandbox has egress (see `agentenv.runtime.egress`), else None."""
    owner: str | None = None
    """`NamespaceBackend.owner` of the runtime that made it (a server's state directory), if set."""


def proc_start_time(pid: int) -> int | None:
    """Start time of a host pid (field 22 of /proc/<pid>/stat), or None if it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])

MAX_NAME = 128
"""Longest image or template name (a file name under images/, with room for the suffix)."""


class Store:
    """Files and mounts under one data directory.

    Args:
        home: the data directory (created if missing).
    """

    def __init__(self, home: Path):
        self.home = Path(home)
        self.layers = self.home / "layers"
        self.images = self.home / "images"
        self.records = self.home / "sandboxes"
        self.forks = self.home / "forks"
        for d in (self.layers, self.images, self.records, self.forks):
            d.mkdir(parents=True, exist_ok=True)
        self.disks = LayerDisks(self.home / "disks", HOST_UID)
        self._thread_lock = threading.RLock()
        self._lock_fd: int | None = None
        self._depth = 0
        self._generation = 0  # the lock file's change counter, as read when the lock was taken or bumped since
        self._cache: dict[str, str] | None = None  # record id -> JSON text, valid at generation `_cache_generation`
        self._cache_generation = -1

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive across threads and processes (re-entrant within a thread)."""
        with self._thread_lock:
            if self._depth == 0:
                self._lock_fd = os.open(self.home / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                raw = os.pread(self._lock_fd, 8, 0)
                self._generation = int.from_bytes(raw, "little") if len(raw) == 8 else 0
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._lock_fd is not None:
                    os.close(self._lock_fd)
                    self._lock_fd = None

    # ---- layers ---------------------------------------------------------------------------------------
    def diff(self, layer: str) -> Path:
        return self.layers / layer / "diff"

    def work(self, layer: str) -> Path:
        return self.layers / layer / "work"

    def new_writable_layer(self, quota_bytes: int, *, in_memory: bool = False) -> str:
        """A fresh layer with `quota_bytes` of room and empty `diff` and `work`, owned by the sandbox root.

        On its own ext4 (disk-backed, its page cache reclaimable) unless `in_memory`: then a tmpfs, whose
        files are charged to the memory cgroup of whoever writes them.

        Raises:
            DiskUnavailable: a disk-backed layer was asked for and this host cannot make one.
        """
        layer = "w" + os.urandom(8).hex()
        path = self.layers / layer
        path.mkdir()
        try:
            if not in_memory:
                self.disks.mount(path, quota_bytes)
                return layer
            sc.mount("tmpfs", str(path), "tmpfs", sc.MS_NOSUID | sc.MS_NODEV,
                     f"size={quota_bytes},mode=0755,uid={HOST_UID},gid={HOST_UID}")
            for sub in ("diff", "work"):
                (path / sub).mkdir()
                os.chown(path / sub, HOST_UID, HOST_UID)
        except BaseException:
            self.remove_layer(layer)
            raise
        return layer

    def is_empty(self, layer: str) -> bool:
        with os.scandir(self.diff(layer)) as it:
            return next(it, None) is None

    def remove_layer(self, layer: str) -> None:
        """Unmount (lazily) and delete a layer; a writable layer goes without walking its files.

        The mount leaves the mount table at once; the filesystem's teardown (an ext4's, and its loop device's
        release: tens of ms on a loaded host) runs on a background thread (see `drain_releases`).
        """
        path = self.layers / layer
        if os.path.ismount(path):
            held = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                sc.umount(str(path), sc.MNT_DETACH)
            finally:
                _RELEASER.release(held)
        if path.exists():
            try:
                path.rmdir()
            except OSError:
                import shutil

                shutil.rmtree(path, ignore_errors=True)

    def layer_ids(self) -> list[str]:
        return sorted(p.name for p in self.layers.iterdir() if p.is_dir())

    # ---- images ---------------------------------------------------------------------------------------
    def image_path(self, name: str) -> Path:
        if not name or "/" in name or name.startswith(".") or "\0" in name or len(name) > MAX_NAME:
            raise ValueError(f"image must be a plain name of at most {MAX_NAME} characters, got {name[:80]!r}")
        return self.images / f"{name}.json"

    def load_image(self, name: str) -> dict | None:
        try:
            return json.loads(self.image_path(name).read_text())
        except FileNotFoundError:
            return None

    def save_image(self, name: str, manifest: dict) -> None:
        _atomic_write(self.image_path(name), json.dumps(manifest, indent=1))

    def image_names(self) -> list[str]:
        return sorted(p.stem for p in self.images.glob("*.json"))

    # ---- records --------------------------------------------------------------------------------------
    def sock(self, sid: str) -> Path:
        return self.records / f"{sid}.sock"

    def _changing(self, sid: str, text: str | None) -> None:
        """Bump the lock file's change counter (before the change is made: a writer killed in between only
        costs the others a re-read) and keep this process's record cache in step. Needs the lock."""
        fresh = self._cache is not None and self._cache_generation == self._generation
        self._generation += 1
        os.pwrite(self._lock_fd, self._generation.to_bytes(8, "little"), 0)
        if fresh:
            if text is None:
                self._cache.pop(sid, None)
            else:
                self._cache[sid] = text
            self._cache_generation = self._generation

    def write_record(self, rec: Record) -> None:
        text = json.dumps(asdict(rec))
        with self.locked():
            self._changing(rec.id, text)
            _atomic_write(self.records / f"{rec.id}.json", text)

    def read_record(self, sid: str) -> Record | None:
        if not sid or "/" in sid or sid.startswith("."):
            return None
        try:
            return Record(**json.loads((self.records / f"{sid}.json").read_text()))
        except FileNotFoundError:
            return None

    def remove_dead_writes(self) -> int:
        """Delete the temporary files of record writes whose writer was killed mid-write; returns how many."""
        removed = 0
        for tmp in [*self.records.glob(".*.tmp"), *self.forks.glob(".*.tmp")]:  # .<name>.<pid>.<thread>.tmp
            pid = tmp.name.split(".")[-3]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                tmp.unlink(missing_ok=True)
                removed += 1
        return removed

    def delete_record(self, sid: str) -> None:
        with self.locked():
            self._changing(sid, None)
            for path in (self.records / f"{sid}.json", self.sock(sid)):
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass

    def all_records(self) -> list[Record]:
        """Every record (fresh objects: callers may change them). Under the lock, the directory is read only
        when a record changed since this process last read it (the lock file's counter moved)."""
        with self._thread_lock:
            locked = self._depth > 0
            if locked and self._cache is not None and self._cache_generation == self._generation:
                texts = list(self._cache.items())
            else:
                texts = []
                with os.scandir(self.records) as entries:
                    for entry in entries:
                        if entry.name.endswith(".json") and not entry.name.startswith("."):
                            try:
                                with open(entry.path) as f:
                                    texts.append((entry.name[:-5], f.read()))
                            except FileNotFoundError:
                                continue
                if locked:
                    self._cache, self._cache_generation = dict(texts), self._generation
        out = []
        for _, text in texts:
            try:
                out.append(Record(**json.loads(text)))
            except (json.JSONDecodeError, TypeError):
                continue
        return out

    # ---- forks in progress ----------------------------------------------------------------------------
    def begin_fork(self, fork_id: str, parent: Record, child_ids: list[str]) -> Path:
        """Note a fork before anything of it exists, so a runtime killed midway leaves a trail to undo it.

        Returns:
            The note's path (delete it when the fork is done or undone).
        """
        me = os.getpid()
        note = {"fork_id": fork_id, "writer": [me, proc_start_time(me)], "parent": asdict(parent),
                "children": list(child_ids)}
        path = self.forks / f"{fork_id}.json"
        _atomic_write(path, json.dumps(note))
        return path

    def pending_forks(self) -> list[tuple[str, bool, Record, list[str]]]:
        """Noted forks: (fork id, whether its writer still runs, parent record before it, child ids)."""
        out = []
        for path in self.forks.glob("*.json"):
            try:
                note = json.loads(path.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            pid, start = note["writer"]
            out.append((note["fork_id"], proc_start_time(pid) == start, Record(**note["parent"]),
                        note["children"]))
        return out

    def end_fork(self, fork_id: str) -> None:
        (self.forks / f"{fork_id}.json").unlink(missing_ok=True)

    def referenced_layers(self) -> set[str]:
        refs: set[str] = set()
        for rec in self.all_records():
            refs.update(rec.lowers)
            refs.add(rec.upper)
        for name in self.image_names():
            manifest = self.load_image(name) or {}
            refs.update(manifest.get("layers", []))
        return refs


class _Releaser:
    """Closes, on one background thread, fds that hold detached mounts: the last close tears the filesystem down."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._fds: list[int] = []
        self._busy = False
        self._thread: threading.Thread | None = None

    def release(self, fd: int) -> None:
        with self._cond:
            self._fds.append(fd)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agentenv-layer-release", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._fds:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait()
                fd = self._fds.pop()
                self._busy = True
            os.close(fd)

    def drain(self, timeout_s: float = 60.0) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._fds and not self._busy, timeout_s)


_RELEASER = _Releaser()


def drain_releases(timeout_s: float = 60.0) -> None:
    """Wait until the filesystems of removed layers are torn down (their loop devices released)."""
    _RELEASER.drain(timeout_s)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
