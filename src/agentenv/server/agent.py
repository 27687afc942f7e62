"""The in-sandbox envd agent: processes, filesystem and watches for the E2B-compatible server.

Why it exists: the runtime's tool server answers one request at a time and runs commands to completion, but
E2B's process service needs long-running processes that other requests can feed (stdin), signal, list and
re-attach to while files are read and written. The server therefore starts this agent once per sandbox
*through* the tool server (so it lives inside the sandbox: its namespaces, cgroup, seccomp filter and
no_new_privs) and talks to it over TCP on the sandbox's own loopback (the host joins the sandbox's network
namespace only to create the socket; see `agentenv.server.agents`).

Stdlib only: the host sends this file's source on the agent's stdin, preceded by `agentenv.server.watch`
(nothing is written into the sandbox), and runs it with the sandbox's ``python3 -I -S``. PTY sessions need
the sandbox's own devpts (mounted by `agentenv.runtime.rootfs`).

Wire format (both ways): a frame is an 8-byte header (`!II`: JSON length, blob length), a UTF-8 JSON object,
then the blob (file contents, stdin, output chunks). A request carries `op`; a unary reply carries `ok` and,
on failure, `code` (a Connect error code) and `message`. Streaming ops (`start`, `connect`, `watch`) send
event frames (`ev`) and end with one frame carrying `ok`.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import queue
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

try:  # in the sandbox the boot program loads `agentenv.runtime.fileio` and `agentenv.server.watch` under this name
    import agentenv_envd_watch as watching

    read_regular = watching.read_regular
except ImportError:
    from agentenv.runtime.fileio import read_regular
    from agentenv.server import watch as watching

HEADER = struct.Struct("!II")
PORT = 49983
MAX_JSON = 16 << 20
MAX_READ = 1 << 30
"""Largest file `read` serves (the host refuses larger frames anyway)."""
SUB_QUEUE = 64
"""Chunks buffered per subscriber before the process's reader blocks (backpressure on the process)."""
WATCH_KEEPALIVE_S = 10.0
"""Idle seconds after which a watch stream sends a keep-alive frame."""
CHUNK = 65536
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Fault(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def send(sock: socket.socket, obj: dict, blob: bytes = b"") -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    head = HEADER.pack(len(body), len(blob)) + body
    if len(blob) < 65536:
        sock.sendall(head + blob)
    else:
        sock.sendall(head)
        sock.sendall(blob)


def _exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed")
        got += k
    return buf


def recv(sock: socket.socket, max_blob: int = 1 << 62) -> tuple[dict, bytearray | bytes]:
    """One frame. The host passes `max_blob`: what a sandbox sends must not make the host allocate freely.

    The blob comes back as the `bytearray` it was received into (copying a 1 MB file into `bytes` once more
    cost ~0.1 ms per transfer).
    """
    json_len, blob_len = HEADER.unpack(_exact(sock, HEADER.size))
    if json_len > MAX_JSON or blob_len > max_blob:
        raise EOFError(f"frame too large ({json_len} + {blob_len} bytes)")
    obj = json.loads(_exact(sock, json_len))
    return obj, (_exact(sock, blob_len) if blob_len else b"")


# ---- users and paths ----------------------------------------------------------------------------------------
DEFAULT_USER = "user"
"""E2B's default user: its home (/home/user) is the working directory and where relative paths resolve."""


def home_of(user: str | None) -> str:
    user = user or DEFAULT_USER
    if user == "root":
        return "/root"
    try:
        return pwd.getpwnam(user).pw_dir
    except KeyError:
        home = f"/home/{os.path.basename(user)}"
        os.makedirs(home, exist_ok=True)
        return home


def resolve(path: str, user: str | None) -> str:
    if not isinstance(path, str) or not path:
        raise Fault("invalid_argument", "path must be a non-empty string")
    if path.startswith("~"):
        path = home_of(user) + path[1:]
    if not path.startswith("/"):
        path = os.path.join(home_of(user), path)
    return os.path.normpath(path)


def _name(table, ident: int) -> str:
    try:
        return table(ident)[0]
    except KeyError:
        return str(ident)


def entry_info(path: str) -> dict:
    st = os.lstat(path)
    is_link = stat.S_ISLNK(st.st_mode)
    target = None
    if is_link:
        target = os.readlink(path)
        try:
            st = os.stat(path)
        except OSError:
            pass
    kind = "FILE_TYPE_DIRECTORY" if stat.S_ISDIR(st.st_mode) else "FILE_TYPE_FILE"
    modified = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(st.st_mtime)) + f".{int(st.st_mtime_ns % 10**9):09d}Z"
    info = {
        "name": os.path.basename(path) or "/",
        "type": kind,
        "path": path,
        "size": str(st.st_size),
        "mode": stat.S_IMODE(st.st_mode) | (0o20000000000 if stat.S_ISDIR(st.st_mode) else 0),
        "permissions": stat.filemode(st.st_mode),
        "owner": _name(pwd.getpwuid, st.st_uid),
        "group": _name(grp.getgrgid, st.st_gid),
        "modifiedTime": modified,
        "isSymlink": is_link,
    }
    if target is not None:
        info["symlinkTarget"] = target
    metadata = read_metadata(path)
    if metadata:
        info["metadata"] = metadata
    return info


METADATA_XATTR = "user.e2b."
"""Prefix of the extended attributes that hold a file's user metadata (envd 0.6.2: ``files.write(metadata=)``)."""


def read_metadata(path: str) -> dict:
    """A file's user metadata: its ``user.e2b.*`` extended attributes, by key (set by uploads or out of band)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:  # no xattrs on this filesystem, or gone
        return {}
    out = {}
    for name in names:
        if name.startswith(METADATA_XATTR):
            try:
                out[name[len(METADATA_XATTR):]] = os.getxattr(path, name, follow_symlinks=False).decode(
                    "ascii", "replace")
            except OSError:
                continue
    return out


def _os_fault(e: OSError, what: str) -> Fault:
    import errno

    codes = {errno.ENOENT: "not_found", errno.EEXIST: "already_exists", errno.EACCES: "permission_denied",
             errno.EPERM: "permission_denied", errno.ENOTDIR: "invalid_argument", errno.EISDIR: "invalid_argument",
             errno.ENOTEMPTY: "failed_precondition", errno.ENOSPC: "resource_exhausted",
             errno.EOPNOTSUPP: "failed_precondition"}  # e.g. metadata (xattrs) on a filesystem without them
    return Fault(codes.get(e.errno, "internal"), f"{what}: {e.strerror}")


# ---- processes -----------------------------------------------------------------------------------------------
PTY_EXIT_CHECK_MS = 200
"""How often a PTY's pump checks whether its process ended while a background child still holds the terminal."""


def _set_size(fd: int, size: dict) -> None:
    import fcntl
    import termios

    rows, cols = int(size["rows"]), int(size["cols"])  # checked by the host (envd._pty_size)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_terminal() -> None:
    """In the child, after setsid: make its stdin (the PTY's slave) the controlling terminal."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _spawn_on_pty(argv: list, env: dict, cwd: str, size: dict) -> tuple[subprocess.Popen, int]:
    """Start `argv` as the session leader of a new PTY of `size` ({rows, cols}); returns it and the master fd."""
    try:
        master, slave = os.openpty()
    except OSError as e:
        raise Fault("failed_precondition", f"no PTY available in this sandbox: {e.strerror}") from e
    try:
        _set_size(slave, size)
        # preexec_fn costs the vfork fast path; PTY sessions are rare next to commands
        popen = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                 start_new_session=True, close_fds=True, preexec_fn=_take_terminal)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return popen, master


def _write_all(proc: Process, data: bytes) -> None:
    """Write PTY input to the master side; the caller holds `proc.stdin_lock`."""
    if proc.master < 0:
        raise Fault("not_found", f"process {proc.pid} already exited")
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(proc.master, view):]
        except OSError as e:
            raise Fault("failed_precondition", f"PTY of process {proc.pid} no longer reads input: {e}") from e


class Process:
    """A running process, its output fanned out to subscribers, each with a bounded queue."""

    def __init__(self, popen: subprocess.Popen, config: dict, tag: str | None, master: int | None = None):
        self.popen = popen
        self.master = master
        """The PTY's master side (None: the process has pipes)."""
        self.pid = popen.pid
        self.config = config
        self.tag = tag
        self.lock = threading.Lock()
        self.subs: list[queue.Queue] = []
        self.end: dict | None = None
        self.stdin_lock = threading.Lock()

    def subscribe(self) -> queue.Queue:
        q: queue.Queue = queue.Queue(SUB_QUEUE)
        with self.lock:
            if self.end is not None:
                q.put(("end", self.end))
            else:
                self.subs.append(q)
        return q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self.lock:
            if q in self.subs:
                self.subs.remove(q)
        while True:  # unblock a reader waiting on this queue
            try:
                q.get_nowait()
            except queue.Empty:
                break

    def publish(self, item: tuple) -> None:
        with self.lock:
            subs = list(self.subs)
        for q in subs:
            while True:
                try:
                    q.put(item, timeout=0.5)
                    break
                except queue.Full:
                    with self.lock:
                        if q not in self.subs:
                            break  # the subscriber left while we waited


class Agent:
    def __init__(self, listener: socket.socket):
        self.listener = listener
        self.procs: dict[int, Process] = {}
        self.lock = threading.Lock()
        self.watchers: dict[str, dict] = {}
        self.hub: watching.WatchHub | None = None
        """Every watch of this sandbox, on one inotify instance (made at the first watch)."""

    def serve(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        try:
            while True:
                req, blob = recv(conn)
                op = req.get("op", "")
                method = getattr(self, "op_" + op, None)
                try:
                    if method is None:
                        raise Fault("unimplemented", f"unknown op {op!r}")
                    reply, out = method(conn, req, blob)
                    if reply is None:
                        continue  # a stream that already sent its final frame
                    send(conn, {"ok": True, **reply}, out)
                except Fault as e:
                    send(conn, {"ok": False, "code": e.code, "message": str(e)})
                except OSError as e:
                    if isinstance(e, (BrokenPipeError, ConnectionResetError)):
                        raise
                    f = _os_fault(e, op)
                    send(conn, {"ok": False, "code": f.code, "message": str(f)})
                except Exception as e:
                    send(conn, {"ok": False, "code": "internal", "message": f"{op}: {type(e).__name__}: {e}"})
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    # ---- process service ---------------------------------------------------------------------------------
    def _find(self, req: dict) -> Process:
        with self.lock:
            if req.get("pid") is not None:
                proc = self.procs.get(int(req["pid"]))
            else:
                proc = next((p for p in self.procs.values() if p.tag is not None and p.tag == req.get("tag")), None)
        if proc is None:
            what = f"pid {req.get('pid')}" if req.get("pid") is not None else f"tag {req.get('tag')!r}"
            raise Fault("not_found", f"process with {what} not found")
        return proc

    def op_ping(self, conn, req, blob):
        return {"pid": os.getpid()}, b""

    def op_start(self, conn, req, blob):
        user = req.get("user")
        home = home_of(user)
        env = {"PATH": DEFAULT_PATH, "HOME": home, "USER": user or DEFAULT_USER, "LANG": "C.UTF-8", "TERM": "xterm"}
        env.update(req.get("base_envs") or {})
        env.update(req.get("envs") or {})
        cwd = resolve(req["cwd"], user) if req.get("cwd") else home
        if not os.path.isdir(cwd):
            raise Fault("invalid_argument", f"cwd {cwd!r} does not exist")
        argv = [req["cmd"], *(req.get("args") or [])]
        master = None
        try:
            if req.get("pty") is not None:
                popen, master = _spawn_on_pty(argv, env, cwd, req["pty"])
            else:
                popen = subprocess.Popen(argv, stdin=subprocess.PIPE if req.get("stdin") else subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                                         start_new_session=True, close_fds=True)
            _limit_child(popen.pid)
        except FileNotFoundError as e:
            raise Fault("not_found", f"command not found: {argv[0]!r}") from e
        except PermissionError as e:
            raise Fault("permission_denied", f"command not executable: {argv[0]!r}") from e
        proc = Process(popen, {"cmd": req["cmd"], "args": req.get("args") or [], "envs": req.get("envs") or {},
                               "cwd": cwd}, req.get("tag"), master)
        with self.lock:
            self.procs[proc.pid] = proc
        try:
            send(conn, {"ev": "start", "pid": proc.pid})
        except OSError:
            conn = None  # the host left already; the process still runs to its end (E2B semantics)
        # pumped inline: no thread or queue hand-off per command (about 0.3 ms of agent CPU per command
        # measured on the 2-core dev VM); subscribers that `connect` later get what follows via `publish`
        if not self._pump(proc, conn):
            raise BrokenPipeError("the host closed the stream of this process")
        return None, b""

    def op_connect(self, conn, req, blob):
        proc = self._find(req)
        q = proc.subscribe()
        send(conn, {"ev": "start", "pid": proc.pid})
        return self._stream(conn, proc, q)

    def _stream(self, conn, proc: Process, q: queue.Queue):
        try:
            while True:
                kind, data = q.get()
                if kind == "end":
                    send(conn, {"ok": True, "ev": "end", **data})
                    return None, b""
                send(conn, {"ev": kind}, data)
        finally:
            proc.unsubscribe(q)

    def _pump(self, proc: Process, primary: socket.socket | None) -> bool:
        """Read both pipes until EOF, send each chunk to `primary` (the starting connection) and publish it to
        later subscribers, then the end event. The process is forgotten once it ended.

        Returns whether `primary` still took the end frame (False: it failed, the connection is dropped).
        A slow `primary` blocks this loop and so the process's writes: backpressure, not buffering.
        """
        import select

        poller = select.poll()
        if proc.master is not None:
            kinds = {proc.master: "pty"}
        else:
            kinds = {proc.popen.stdout.fileno(): "stdout", proc.popen.stderr.fileno(): "stderr"}
        for fd in kinds:
            poller.register(fd, select.POLLIN)
        while kinds:
            ready = poller.poll(PTY_EXIT_CHECK_MS if proc.master is not None else None)
            if not ready and proc.popen.poll() is not None:
                break  # the PTY's process ended while a child it left behind still holds the terminal
            for fd, _ in ready:
                try:
                    chunk = os.read(fd, CHUNK)
                except OSError:  # EIO: the PTY's last slave descriptor closed
                    chunk = b""
                if not chunk:
                    poller.unregister(fd)
                    del kinds[fd]
                    continue
                if primary is not None:
                    try:
                        send(primary, {"ev": kinds[fd]}, chunk)
                    except OSError:
                        primary = None
                if proc.subs:
                    proc.publish((kinds[fd], chunk))
        code = proc.popen.wait()
        if proc.master is not None:
            with proc.stdin_lock:
                os.close(proc.master)
                proc.master = -1  # closed: input and resize now fail as for an ended process
        else:
            proc.popen.stdout.close()
            proc.popen.stderr.close()
        if code >= 0:
            end = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
        else:
            name = {9: "killed", 15: "terminated", 2: "interrupt", 1: "hangup"}.get(-code, f"signal {-code}")
            end = {"exitCode": -1, "exited": False, "status": f"signal: {name}"}
        with self.lock:
            self.procs.pop(proc.pid, None)
        with proc.lock:
            proc.end = end
            subs = list(proc.subs)
        for q in subs:
            try:
                q.put(("end", end), timeout=5.0)
            except queue.Full:
                pass
        if proc.popen.stdin is not None:
            try:
                proc.popen.stdin.close()
            except OSError:
                pass
        if primary is None:
            return False
        try:
            send(primary, {"ok": True, "ev": "end", **end})
        except OSError:
            return False
        return True

    def op_list(self, conn, req, blob):
        with self.lock:
            procs = list(self.procs.values())
        return {"processes": [{"config": p.config, "pid": p.pid, **({"tag": p.tag} if p.tag else {})}
                              for p in procs]}, b""

    def op_input(self, conn, req, blob):
        proc = self._find(req)
        if proc.master is not None:
            with proc.stdin_lock:
                _write_all(proc, blob)
            return {}, b""
        if req.get("pty"):
            raise Fault("failed_precondition", f"process {proc.pid} has no PTY (start it with a pty)")
        if proc.popen.stdin is None or proc.popen.stdin.closed:
            raise Fault("failed_precondition", f"stdin of process {proc.pid} is not open (start it with stdin=True)")
        with proc.stdin_lock:
            try:
                proc.popen.stdin.write(blob)
                proc.popen.stdin.flush()
            except (BrokenPipeError, ValueError) as e:
                raise Fault("failed_precondition", f"process {proc.pid} no longer reads stdin") from e
        return {}, b""

    def op_resize(self, conn, req, blob):
        proc = self._find(req)
        if proc.master is None:
            raise Fault("failed_precondition", f"process {proc.pid} has no PTY to resize")
        with proc.stdin_lock:
            if proc.master < 0:
                raise Fault("not_found", f"process {proc.pid} already exited")
            _set_size(proc.master, req)  # the kernel sends SIGWINCH to the terminal's foreground group
        return {}, b""

    def op_close_stdin(self, conn, req, blob):
        proc = self._find(req)
        with proc.stdin_lock:
            if proc.popen.stdin is not None and not proc.popen.stdin.closed:
                proc.popen.stdin.close()
        return {}, b""

    def op_signal(self, conn, req, blob):
        proc = self._find(req)
        sig = int(req.get("signal") or signal.SIGKILL)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError as e:
                raise Fault("not_found", f"process {proc.pid} already exited") from e
        return {}, b""

    # ---- filesystem service ------------------------------------------------------------------------------
    def op_stat(self, conn, req, blob):
        path = resolve(req["path"], req.get("user"))
        try:
            return {"entry": entry_info(path)}, b""
        except FileNotFoundError as e:
            raise Fault("not_found", f"path {path!r} does not exist") from e

    def op_list_dir(self, conn, req, blob):
        root = resolve(req["path"], req.get("user"))
        depth = int(req.get("depth") or 1)
        if not os.path.exists(root):
            raise Fault("not_found", f"directory {root!r} does not exist")
        if not os.path.isdir(root):
            raise Fault("invalid_argument", f"path {root!r} is not a directory")
        entries = []

        def walk(path: str, level: int) -> None:
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                try:
                    info = entry_info(full)
                except FileNotFoundError:
                    continue
                entries.append(info)
                if level < depth and info["type"] == "FILE_TYPE_DIRECTORY" and not info["isSymlink"]:
                    walk(full, level + 1)

        walk(root, 1)
        return {"entries": entries}, b""

    def op_make_dir(self, conn, req, blob):
        path = resolve(req["path"], req.get("user"))
        if os.path.exists(path):
            raise Fault("already_exists", f"path {path!r} already exists")
        os.makedirs(path)
        return {"entry": entry_info(path)}, b""

    def op_move(self, conn, req, blob):
        src = resolve(req["source"], req.get("user"))
        dst = resolve(req["destination"], req.get("user"))
        if not os.path.lexists(src):
            raise Fault("not_found", f"path {src!r} does not exist")
        os.makedirs(os.path.dirname(dst) or "/", exist_ok=True)
        os.rename(src, dst)
        return {"entry": entry_info(dst)}, b""

    def op_remove(self, conn, req, blob):
        path = resolve(req["path"], req.get("user"))
        if not os.path.lexists(path):
            raise Fault("not_found", f"path {path!r} does not exist")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return {}, b""

    def op_read(self, conn, req, blob):
        path = resolve(req["path"], req.get("user"))
        if os.path.isdir(path):
            raise Fault("invalid_argument", f"path {path!r} is a directory")
        try:
            return {}, read_regular(path, MAX_READ)
        except FileNotFoundError as e:
            raise Fault("not_found", f"file {path!r} does not exist") from e
        except ValueError as e:
            raise Fault("resource_exhausted" if "bytes" in str(e) else "invalid_argument", str(e)) from e

    def op_write(self, conn, req, blob):
        path = resolve(req["path"], req.get("user"))
        if os.path.isdir(path):
            raise Fault("invalid_argument", f"path {path!r} is a directory")
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        with open(path, "wb") as f:
            f.write(blob)
        metadata = req.get("metadata") or {}
        for key, value in metadata.items():  # keys and values were checked by the host (envd._upload_metadata)
            os.setxattr(path, METADATA_XATTR + key, value.encode("ascii"))
        reply = {"name": os.path.basename(path), "type": "file", "path": path}
        if metadata:
            reply["metadata"] = metadata
        return reply, b""

    # ---- watches (inotify, or a polling scan where inotify is unavailable: `agentenv.server.watch`) ----------
    def _check_dir(self, req: dict) -> str:
        root = resolve(req["path"], req.get("user"))
        if not os.path.isdir(root):
            raise Fault("not_found" if not os.path.exists(root) else "invalid_argument",
                        f"path {root!r} is not a directory")
        return root

    @staticmethod
    def _fs_events(w, include_entry: bool) -> list[dict]:
        events = []
        for name, kind in w.events():
            event = {"name": name, "type": kind}
            if include_entry and kind != "EVENT_TYPE_REMOVE":
                try:
                    event["entry"] = entry_info(os.path.join(w.root, name))
                except OSError:
                    pass  # gone again (or renamed away): E2B leaves the entry out
            events.append(event)
        return events

    def _watch(self, req: dict, notify: bool):
        root = self._check_dir(req)
        with self.lock:
            if self.hub is None:
                self.hub = watching.WatchHub()
        return self.hub.watch(root, bool(req.get("recursive")), notify=notify)

    def op_watch(self, conn, req, blob):
        import select

        include = bool(req.get("include_entry"))
        with self._watch(req, notify=True) as w:
            send(conn, {"ev": "start"})
            last_beat = time.monotonic()
            while True:
                ready, _, _ = select.select([conn, w.fd], [], [], WATCH_KEEPALIVE_S)
                if conn in ready and conn.recv(1) == b"":  # the host closes the connection to stop the watch
                    return None, b""
                for event in self._fs_events(w, include):
                    send(conn, {"ev": "fs", **event})
                if time.monotonic() - last_beat > WATCH_KEEPALIVE_S:
                    send(conn, {"ev": "keepalive"})
                    last_beat = time.monotonic()

    def op_watcher_create(self, conn, req, blob):
        """A watcher polled by `watcher_events`: no thread of its own, the hub's thread queues its events (a
        recursive watch adds a new directory's watch as soon as the directory appears)."""
        w = self._watch(req, notify=False)
        wid = os.urandom(8).hex()
        with self.lock:
            self.watchers[wid] = {"watch": w, "include": bool(req.get("include_entry"))}
        return {"watcherId": wid}, b""

    def op_watcher_events(self, conn, req, blob):
        with self.lock:
            watcher = self.watchers.get(req.get("watcher_id", ""))
        if watcher is None:
            raise Fault("not_found", f"watcher {req.get('watcher_id')!r} not found")
        return {"events": self._fs_events(watcher["watch"], watcher["include"])}, b""

    def op_watcher_remove(self, conn, req, blob):
        with self.lock:
            watcher = self.watchers.pop(req.get("watcher_id", ""), None)
        if watcher is None:
            raise Fault("not_found", f"watcher {req.get('watcher_id')!r} not found")
        watcher["watch"].close()
        return {}, b""


def main() -> None:
    """Bind the port, fork into the background (so the launching command returns), then serve."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", PORT))
    except OSError:
        sys.exit(0)  # an agent already serves this sandbox
    listener.listen(1024)
    if os.fork() != 0:
        os._exit(0)
    os.setsid()
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    _keep_headroom()
    Agent(listener).serve()


_CHILD_NPROC: int | None = None


def _keep_headroom() -> None:
    """The launcher gave this agent the commands' soft RLIMIT_NPROC: keep it for the agent's children, and
    lift the agent's own to the hard limit, so a fork bomb in a command leaves the agent room to serve."""
    global _CHILD_NPROC
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != hard:
        _CHILD_NPROC = soft
        resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))


def _limit_child(pid: int) -> None:
    if _CHILD_NPROC is not None:
        try:
            resource.prlimit(pid, resource.RLIMIT_NPROC, (_CHILD_NPROC, resource.RLIM_INFINITY))
        except (ProcessLookupError, PermissionError, ValueError):
            pass


if __name__ in ("__main__", "agentenv_envd_agent"):
    main()
