"""Directory watches for the in-sandbox envd agent: one inotify instance for all of them, a polling scan where
inotify is missing.

Stdlib only and self-contained like `agentenv.server.agent`: the host sends this file's source ahead of the
agent's and the agent's boot program loads it as module ``agentenv_envd_watch`` (see
`agentenv.server.agents`). The agent lives in the sandbox's mount namespace, so its inotify watches sit on the
sandbox's overlay mount and see every change made through it (all of the sandbox's writes).

Why one instance: inotify instances are a per-user resource (``fs.inotify.max_user_instances``, 128 by
default) charged to the host user that owns the sandbox's user namespace, so all sandboxes of a host share
them; an instance per watch ran out after ~128 watches host-wide. A `WatchHub` (one per agent, i.e. per
sandbox) holds a single instance; each `DirWatch` adds its inotify watches to it and one reader thread
dispatches events by watch descriptor. The kernel gives one descriptor per inode and instance, so two
watches of one directory share it: the hub counts the watches per descriptor and removes it with the last.
What limits the number of watches is then ``fs.inotify.max_user_watches`` (directories watched).

Events follow E2B's envd (Go fsnotify): a name relative to the watched directory and one of ``create``
(``IN_CREATE``, ``IN_MOVED_TO``), ``write`` (``IN_MODIFY``), ``chmod`` (``IN_ATTRIB``), ``remove``
(``IN_DELETE``) and ``rename`` (``IN_MOVED_FROM``: the old name), as ``EVENT_TYPE_*`` strings. A recursive
watch adds a watch for each directory that appears below the root and reports what that directory already
holds when its watch is added as ``create`` events (a tree made by ``mkdir -p a/b && touch a/b/f`` faster than
the watch follows is still reported in full).

Where inotify cannot be had (no ``inotify_init1`` in the sandbox's libc, or the instance limit reached), a new
watch is polled instead: the hub's thread scans its tree every `POLL_INTERVAL_S` and diffs (mtime, size, mode,
inode) signatures. A hub without an instance tries again at each new watch, so once an instance is free again
later watches use inotify (watches already polled stay polled).
"""

from __future__ import annotations

import os
import select
import stat
import struct
import threading
import time

POLL_INTERVAL_S = 0.05
"""Scan period of the polling fallback, in seconds."""
CLOSE_WAIT_S = 2.0
"""How long `WatchHub.close` waits for its thread to end, in seconds."""
MAX_PENDING = 10000
"""Events kept per watch that nobody reads; older ones are dropped first."""

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_ONLYDIR
EVENT = struct.Struct("iIII")
"""``struct inotify_event`` without its name: wd, mask, cookie, name length (the name follows, NUL-padded)."""
KINDS = ((IN_CREATE | IN_MOVED_TO, "EVENT_TYPE_CREATE"), (IN_MODIFY, "EVENT_TYPE_WRITE"),
         (IN_ATTRIB, "EVENT_TYPE_CHMOD"), (IN_DELETE, "EVENT_TYPE_REMOVE"), (IN_MOVED_FROM, "EVENT_TYPE_RENAME"))

_libc = None


def _inotify_libc():
    global _libc
    if _libc is None:
        import ctypes

        try:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.inotify_init1.argtypes = [ctypes.c_int]
        _libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    return _libc


def _check(result: int, what: str) -> int:
    if result < 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class WatchHub:
    """Every `DirWatch` of one process, fed by one background thread over one inotify instance (and a scan loop
    for watches made while no instance could be had).

    Args:
        use_inotify: False forces the polling scan (tests of the fallback).

    Attributes:
        fd: the shared inotify descriptor; -1 while the hub has none.
    """

    def __init__(self, *, use_inotify: bool = True):
        self.use_inotify = use_inotify
        self.fd = -1
        self.lock = threading.RLock()
        """Held while events are dispatched and while watches change (a dispatch may add watches)."""
        self._subs: dict[int, dict[DirWatch, str]] = {}
        """wd -> {watch: directory path relative to that watch's root ("" for its root)}."""
        self._watches: set[DirWatch] = set()
        self._polled: set[DirWatch] = set()
        self._closed = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        """Wakes the thread's select: on close, and when its descriptors or its scan period change."""
        self._thread: threading.Thread | None = None
        self._open_instance()

    @property
    def interval(self) -> float | None:
        """None while new watches use inotify; the polling period in seconds otherwise."""
        return None if self.fd >= 0 else POLL_INTERVAL_S

    def _open_instance(self) -> bool:
        if self.fd < 0 and self.use_inotify:
            try:
                self.fd = _check(_inotify_libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
                return True
            except (OSError, AttributeError):  # no inotify here, or the instance limit is reached
                self.fd = -1
        return False

    def watch(self, root: str, recursive: bool, *, notify: bool = False) -> DirWatch:
        """Start watching `root` (an existing directory; with `recursive`, all below it too).

        Args:
            root: absolute path of the directory.
            recursive: also watch every directory below `root`, including ones created later.
            notify: give the watch a descriptor (`DirWatch.fd`) that becomes readable when events are queued.

        Raises:
            OSError: `root` cannot be watched (missing, not a directory, or the watch limit is reached).
        """
        w = DirWatch(self, root, recursive, notify)
        with self.lock:
            if self._closed.is_set():
                raise OSError(9, "the watch hub is closed")
            wake = self._open_instance()  # the thread must select on the new instance
            try:
                if self.fd >= 0:
                    self._add(w, "")
                    if recursive:
                        w._add_below("", report=False)
                else:
                    w._state = w._scan()
                    self._polled.add(w)
                    wake = True  # the thread may be waiting without a timeout
            except OSError:
                w.close()
                raise
            self._watches.add(w)
            if wake:
                self._wake()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="watch-hub", daemon=True)
                self._thread.start()
        return w

    def count(self) -> int:
        """How many watches are open."""
        with self.lock:
            return len(self._watches)

    def close(self) -> None:
        """Close every watch, end the thread and close the inotify instance."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        with self.lock:
            for w in list(self._watches):
                w.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_WAIT_S)
        with self.lock:
            for fd in (self.fd, self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self.fd = self._wake_r = self._wake_w = -1

    def __enter__(self) -> WatchHub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- descriptors shared by watches -------------------------------------------------------------------
    def _add(self, w: DirWatch, rel: str) -> None:
        path = w.full(rel)
        wd = _check(_inotify_libc().inotify_add_watch(self.fd, os.fsencode(path), WATCH_MASK), f"watch {path}")
        self._subs.setdefault(wd, {})[w] = rel  # a directory moved within the tree keeps its wd: rel is updated
        w._wds.add(wd)

    def _drop(self, w: DirWatch, wd: int) -> None:
        subs = self._subs.get(wd)
        w._wds.discard(wd)
        if subs is None or subs.pop(w, None) is None or subs:
            return
        del self._subs[wd]
        if self.fd >= 0:
            _inotify_libc().inotify_rm_watch(self.fd, wd)

    def _forget(self, w: DirWatch) -> None:
        with self.lock:
            for wd in list(w._wds):
                self._drop(w, wd)
            self._watches.discard(w)
            self._polled.discard(w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # full: the thread has wake-ups pending anyway

    # ---- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_scan = time.monotonic() + POLL_INTERVAL_S
        while not self._closed.is_set():
            with self.lock:
                fds = [self._wake_r] + ([self.fd] if self.fd >= 0 else [])
                polling = bool(self._polled)
            timeout = max(0.0, next_scan - time.monotonic()) if polling else None
            try:
                ready, _, _ = select.select(fds, [], [], timeout)
                if self._closed.is_set():
                    return
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                with self.lock:
                    if self.fd >= 0 and self.fd in ready:
                        try:
                            self._dispatch(os.read(self.fd, 65536))
                        except BlockingIOError:
                            pass
                    if self._polled and time.monotonic() >= next_scan:
                        for w in list(self._polled):
                            w._poll()
                        next_scan = time.monotonic() + POLL_INTERVAL_S
                    elif not self._polled:
                        next_scan = time.monotonic() + POLL_INTERVAL_S
            except (OSError, ValueError):  # closed under us
                return

    def _dispatch(self, data: bytes) -> None:
        pos = 0
        touched: set[DirWatch] = set()
        while pos + EVENT.size <= len(data):
            wd, mask, _, length = EVENT.unpack_from(data, pos)
            name = os.fsdecode(data[pos + EVENT.size : pos + EVENT.size + length].rstrip(b"\0"))
            pos += EVENT.size + length
            if mask & (IN_IGNORED | IN_DELETE_SELF):  # a watched directory is gone (its parent reported it)
                for w in self._subs.pop(wd, {}):
                    w._wds.discard(wd)
                continue
            if mask & IN_Q_OVERFLOW or not name:
                continue
            for w, base in list(self._subs.get(wd, {}).items()):
                w._event(base, name, mask)
                touched.add(w)
        for w in touched:
            w._wake()


class DirWatch:
    """Changes below one directory, as E2B filesystem events; made by `WatchHub.watch`.

    Attributes:
        root: the watched directory.
        fd: with ``notify``, a descriptor that is readable while events are queued (wait on it with select);
            -1 otherwise.
    """

    def __init__(self, hub: WatchHub, root: str, recursive: bool, notify: bool):
        self.hub = hub
        self.root = root.rstrip("/") or "/"
        self.recursive = recursive
        self.fd = -1
        self._wake_w = -1
        if notify:
            self.fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wds: set[int] = set()
        self._pending: list[tuple[str, str]] = []
        self._state: dict[str, tuple] = {}
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.hub._forget(self)
        for fd in (self.fd, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self.fd = self._wake_w = -1

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def events(self) -> list[tuple[str, str]]:
        """What changed since the last call, as ``(name relative to the root, EVENT_TYPE_*)`` (never blocks)."""
        with self.hub.lock:
            out, self._pending = self._pending, []
            if self.fd >= 0:
                try:
                    while os.read(self.fd, 4096):
                        pass
                except BlockingIOError:
                    pass
        return out

    def full(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _queue(self, rel: str, kind: str) -> None:
        self._pending.append((rel, kind))
        if len(self._pending) > MAX_PENDING:
            del self._pending[:-MAX_PENDING]

    def _wake(self) -> None:
        if self._wake_w >= 0 and self._pending:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: it is readable already

    # ---- inotify (called by the hub with its lock held) --------------------------------------------------
    def _add_below(self, rel: str, report: bool) -> None:
        """Watch every directory below `rel`; with `report`, queue a create event for each entry found."""
        try:
            names = os.listdir(self.full(rel))
        except OSError:
            return
        for name in names:
            child = os.path.join(rel, name) if rel else name
            if report:
                self._queue(child, "EVENT_TYPE_CREATE")
            try:
                is_dir = stat.S_ISDIR(os.lstat(self.full(child)).st_mode)
            except OSError:
                continue
            if is_dir:
                try:
                    self.hub._add(self, child)
                except OSError:
                    continue  # removed meanwhile, or not readable
                self._add_below(child, report)

    def _forget_below(self, rel: str) -> None:
        """Stop watching `rel` and what lies below it (it left the tree)."""
        prefix = rel + "/"
        for wd in list(self._wds):
            path = self.hub._subs.get(wd, {}).get(self)
            if path is not None and (path == rel or path.startswith(prefix)):
                self.hub._drop(self, wd)

    def _event(self, base: str, name: str, mask: int) -> None:
        rel = os.path.join(base, name) if base else name
        for bit, kind in KINDS:
            if mask & bit:
                self._queue(rel, kind)
        if self.recursive and mask & IN_ISDIR:
            if mask & (IN_CREATE | IN_MOVED_TO):
                try:
                    self.hub._add(self, rel)
                except OSError:
                    return
                self._add_below(rel, report=bool(mask & IN_CREATE))
            elif mask & IN_MOVED_FROM:
                self._forget_below(rel)

    # ---- polling fallback --------------------------------------------------------------------------------
    def _poll(self) -> None:
        new = self._scan()
        for event in _diff(self._state, new):
            self._queue(*event)
        self._state = new
        self._wake()

    def _scan(self) -> dict[str, tuple]:
        seen: dict[str, tuple] = {}

        def walk(path: str, rel: str) -> None:
            try:
                names = os.listdir(path)
            except OSError:
                return
            for name in names:
                full = os.path.join(path, name)
                child = os.path.join(rel, name) if rel else name
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                seen[child] = (st.st_mtime_ns, st.st_size, st.st_mode, st.st_ino)
                if self.recursive and stat.S_ISDIR(st.st_mode):
                    walk(full, child)

        walk(self.root, "")
        return seen


def _diff(before: dict[str, tuple], after: dict[str, tuple]) -> list[tuple[str, str]]:
    events = []
    for name, sig in after.items():
        old = before.get(name)
        if old is None:
            events.append((name, "EVENT_TYPE_CREATE"))
            continue
        if old[0] != sig[0] or old[1] != sig[1]:
            events.append((name, "EVENT_TYPE_WRITE"))
        if old[2] != sig[2]:
            events.append((name, "EVENT_TYPE_CHMOD"))
    events.extend((name, "EVENT_TYPE_REMOVE") for name in before if name not in after)
    return events
