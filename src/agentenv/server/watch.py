"""Directory watches for the in-sandbox envd agent: inotify through ctypes, a polling scan where it is missing.

Stdlib only and self-contained like `agentenv.server.agent`: the host sends this file's source ahead of the
agent's and the agent's boot program loads it as module ``agentenv_envd_watch`` (see
`agentenv.server.agents`). The agent lives in the sandbox's mount namespace, so its inotify watches sit on the
sandbox's overlay mount and see every change made through it (all of the sandbox's writes).

Events follow E2B's envd (Go fsnotify): a name relative to the watched directory and one of ``create``
(``IN_CREATE``, ``IN_MOVED_TO``), ``write`` (``IN_MODIFY``), ``chmod`` (``IN_ATTRIB``), ``remove``
(``IN_DELETE``) and ``rename`` (``IN_MOVED_FROM``: the old name), as ``EVENT_TYPE_*`` strings. A recursive
watch adds a watch for each directory that appears below the root and reports what that directory already
holds when its watch is added as ``create`` events (a tree made by ``mkdir -p a/b && touch a/b/f`` faster than
the watch follows is still reported in full).

Where inotify cannot be had (no ``inotify_init1`` in the sandbox's libc, or the host's per-user instance limit
``fs.inotify.max_user_instances`` reached), `DirWatch` falls back to scanning the tree every
`POLL_INTERVAL_S` and diffing (mtime, size, mode, inode) signatures.
"""

from __future__ import annotations

import os
import stat
import struct

POLL_INTERVAL_S = 0.05
"""Scan period of the polling fallback, in seconds."""

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
WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
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


class DirWatch:
    """Changes below one directory, as E2B filesystem events.

    Args:
        root: absolute path of an existing directory.
        recursive: also watch every directory below `root`, including ones created later.
        use_inotify: False forces the polling scan (tests of the fallback).

    Attributes:
        fd: the inotify descriptor to wait on with select/poll (readable when events are queued); -1 while
            polling.
        interval: None with inotify; the polling period in seconds otherwise (call `events` that often).
    """

    def __init__(self, root: str, recursive: bool, *, use_inotify: bool = True):
        self.root = root.rstrip("/") or "/"
        self.recursive = recursive
        self.fd = -1
        self.interval: float | None = None
        self._paths: dict[int, str] = {}
        """wd -> directory path relative to the root ("" for the root)."""
        self._pending: list[tuple[str, str]] = []
        self._state: dict[str, tuple] = {}
        if use_inotify:
            try:
                self.fd = _check(_inotify_libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
            except (OSError, AttributeError):  # no inotify here, or the instance limit is reached
                self.fd = -1
        if self.fd >= 0:
            try:
                self._add("", IN_ONLYDIR)
                if recursive:
                    self._add_below("", report=False)
            except OSError:
                self.close()
                raise
        else:
            self.interval = POLL_INTERVAL_S
            self._state = self._scan()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def events(self) -> list[tuple[str, str]]:
        """What changed since the last call, as ``(name relative to the root, EVENT_TYPE_*)`` (never blocks)."""
        if self.fd < 0:
            new = self._scan()
            out = _diff(self._state, new)
            self._state = new
            return out
        out, self._pending = self._pending, []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            self._parse(data, out)

    # ---- inotify -------------------------------------------------------------------------------------------
    def _full(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _add(self, rel: str, extra: int = 0) -> None:
        path = os.fsencode(self._full(rel))
        wd = _check(_inotify_libc().inotify_add_watch(self.fd, path, WATCH_MASK | extra), f"watch {self._full(rel)}")
        self._paths[wd] = rel  # a directory moved within the tree keeps its wd: the path is updated here

    def _add_below(self, rel: str, report: bool) -> None:
        """Watch every directory below `rel`; with `report`, queue a create event for each entry found."""
        try:
            names = os.listdir(self._full(rel))
        except OSError:
            return
        for name in names:
            child = os.path.join(rel, name) if rel else name
            if report:
                self._pending.append((child, "EVENT_TYPE_CREATE"))
            try:
                is_dir = stat.S_ISDIR(os.lstat(self._full(child)).st_mode)
            except OSError:
                continue
            if is_dir:
                try:
                    self._add(child, IN_ONLYDIR)
                except OSError:
                    continue  # removed meanwhile, or not readable
                self._add_below(child, report)

    def _forget_below(self, rel: str) -> None:
        """Stop watching `rel` and what lies below it (it left the tree)."""
        prefix = rel + "/"
        for wd, path in list(self._paths.items()):
            if path == rel or path.startswith(prefix):
                _inotify_libc().inotify_rm_watch(self.fd, wd)
                del self._paths[wd]

    def _parse(self, data: bytes, out: list[tuple[str, str]]) -> None:
        pos = 0
        while pos + EVENT.size <= len(data):
            wd, mask, _, length = EVENT.unpack_from(data, pos)
            name = os.fsdecode(data[pos + EVENT.size : pos + EVENT.size + length].rstrip(b"\0"))
            pos += EVENT.size + length
            if mask & (IN_IGNORED | IN_DELETE_SELF):  # a watched directory is gone (its parent reported it)
                self._paths.pop(wd, None)
                continue
            base = self._paths.get(wd)
            if base is None or mask & IN_Q_OVERFLOW or not name:
                continue
            rel = os.path.join(base, name) if base else name
            for bit, kind in KINDS:
                if mask & bit:
                    out.append((rel, kind))
            if self.recursive and mask & IN_ISDIR:
                if mask & (IN_CREATE | IN_MOVED_TO):
                    try:
                        self._add(rel, IN_ONLYDIR)
                    except OSError:
                        continue
                    self._add_below(rel, report=bool(mask & IN_CREATE))
                    out.extend(self._pending)
                    self._pending = []
                elif mask & IN_MOVED_FROM:
                    self._forget_below(rel)

    # ---- polling fallback ----------------------------------------------------------------------------------
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
