"""The in-sandbox tool server: pid 1 of a sandbox, serving the host runtime over a unix socket.

Run by the host's `/usr/bin/python3 -I -S` (stdlib only, imported before the pivot so nothing is loaded
from the sandbox afterwards). It keeps the Python kernels (a process per interpreter context, `kernels`) and
the bash session, runs commands under the agent seccomp filter with no_new_privs, serves file operations,
and implements fork as a zygote: it `fork()`s, and each child enters a fresh user, mount, pid, net, uts, ipc
and cgroup namespace over a new writable layer the host prepared; each live kernel then puts a copy of itself
into the child, so the child starts with the parent's interpreter state and filesystem and nothing is copied
but what each side later changes.

Bootstrap (first start on the host): argv[1] is a JSON config; fd `sync_fd` talks to the host while it
writes our uid/gid maps; fd `listen_fd` is our listening socket.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import shutil
import signal
import socket
import stat
import struct
import sys
import time

from agentenv import protocol
from agentenv.runtime import kernels, rootfs, seccomp, sessions, spawner
from agentenv.runtime import syscalls as sc
from agentenv.runtime.fileio import read_regular
from agentenv.runtime.zygote import NS_SANDBOX, RequestError, Zygote

OUTPUT_CAP = 16 << 20
MAX_READ = 256 << 20
"""Largest file `files.read` returns (the tool server holds it in memory); larger ones are refused."""
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_AGENT_FILTER = seccomp.build_filter(seccomp.AGENT_DENY, block_namespace_clone=True)
_BASE_FILTER = seccomp.build_filter(seccomp.BASE_DENY)


def _agent_setup() -> None:
    """Runs once in the command launcher: default OOM score, agent filter, no_new_privs (inherited by commands)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("0")
    except OSError:
        pass
    seccomp.install(_AGENT_FILTER, no_new_privs=True)


def _os_error(error: OSError, what: str) -> RequestError:
    kinds = {errno.ENOENT: "not_found", errno.EEXIST: "exists", errno.EACCES: "permission", errno.EPERM: "permission",
             errno.EISDIR: "is_directory", errno.ENOTDIR: "invalid", errno.ENOSPC: "invalid"}
    kind = kinds.get(error.errno, "internal")
    return RequestError(kind, f"{what}: {error.strerror}")


class ToolServer(Zygote):
    def __init__(self, listener: socket.socket, sandbox_id: str, ttl_deadline: float | None):
        self.listener = listener
        self.id = sandbox_id
        self.deadline = ttl_deadline
        self.kernels = kernels.Kernels()
        self.spawner = spawner.Spawner(_agent_setup)
        self.shell = sessions.ShellSession(self.spawn)
        self.conns: list[socket.socket] = []
        self.own_pidns = os.readlink("/proc/self/ns/pid")
        self.retired = False
        self.broken = False
        self._sel: selectors.BaseSelector | None = None
        self._pending_move: tuple[socket.socket, bool] | None = None
        self.last_move_ms = 0.0
        self._fork: tuple[str | None, list[int]] | None = None
        self.fork_outcomes: dict[str, str] = {}
        """What became of recent forks, by the host's fork id: ``done``, ``moved`` or ``rolled_back``."""

    def spawn(self, argv: list[str], *, stdin_pipe: bool = False, env: dict | None = None, cwd: str | None = None):
        """Start a command through the launcher (agent seccomp filter, no_new_privs, own session)."""
        base = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
        return self.spawner.spawn(argv, stdin_pipe=stdin_pipe, env={**base, **(env or {})}, cwd=cwd or "/root")

    # ---- process bookkeeping -------------------------------------------------------------------------
    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.kernels.note_exit(pid, status)

    def _own_processes(self) -> list[int]:
        """Pids of this sandbox's processes other than us (not those of forked sandboxes nested below)."""
        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or name == "1":
                continue
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == self.own_pidns:
                    pids.append(int(name))
            except OSError:
                continue
        return pids

    def _nested_alive(self) -> bool:
        return any(n.isdigit() and n != "1" for n in os.listdir("/proc")) and not self._own_only()

    def _own_only(self) -> bool:
        return len(self._own_processes()) == sum(1 for n in os.listdir("/proc") if n.isdigit() and n != "1")

    def kill_agents(self, *, kernels_too: bool = False) -> None:
        """Kill every process of this sandbox but us (and the Python kernels, unless `kernels_too`)."""
        self.shell.close()
        self.spawner.forget()
        keep = set()
        if kernels_too:
            self.kernels.stop_all()
        else:
            keep = self.kernels.pids()
        for _ in range(100):
            pids = [pid for pid in self._own_processes() if pid not in keep]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.001)
            self._reap()

    # ---- serving --------------------------------------------------------------------------------------
    def serve(self) -> None:
        sel = self._sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        while True:
            timeout = 1.0 if self.deadline is None else max(0.0, min(1.0, self.deadline - time.time()))
            events = sel.select(timeout)
            # what died while we waited holds its pid (pids cgroup, RLIMIT_NPROC) until reaped: free it before a
            # request that may need a new process (an agent that just killed its processes at the pids limit)
            self._reap()
            for key, _ in events:
                if key.data is None:
                    conn, _ = self.listener.accept()
                    conn.set_inheritable(False)
                    sel.register(conn, selectors.EVENT_READ, conn)
                    self.conns.append(conn)
                    continue
                conn = key.data
                try:
                    self.handle(conn)
                except (protocol.ConnectionClosed, ConnectionError, OSError):
                    sel.unregister(conn)
                    self.conns.remove(conn)
                    conn.close()
            self._reap()
            if self.deadline is not None and time.time() >= self.deadline and not self.retired:
                self._expire(sel)
            if self.retired and self._own_only():
                os._exit(0)  # nothing nested below us any more

    def _expire(self, sel: selectors.BaseSelector) -> None:
        """TTL passed: stop serving and kill our processes; stay only while forked sandboxes nest below us."""
        self.retired = True
        self.kill_agents(kernels_too=True)
        sel.unregister(self.listener)
        self.listener.close()

    def handle(self, conn: socket.socket) -> None:
        if self.broken:  # see _finish_move: drop every connection
            raise ConnectionError("this sandbox stopped serving")
        req, blob, fds = protocol.recv_msg(conn)
        op = req.get("op", "")
        if op == "whoami":  # one byte with our pid as SCM_CREDENTIALS (the kernel translates it for the host)
            creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
            conn.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
            return
        try:
            method = getattr(self, f"op_{op}", None)
            if method is None:
                raise RequestError("invalid", f"unknown op {op!r}")
            reply, out_blob = method(conn, req, blob, fds)
            try:
                protocol.send_msg(conn, {"ok": True, **reply}, out_blob)
            except OSError:
                if self._fork is not None:  # the host is gone mid-fork: nobody knows these children
                    self._pending_move = None
                    self._roll_back_fork()
                raise
        except RequestError as e:
            protocol.send_msg(conn, {"ok": False, "error": e.kind, "message": str(e)})
        except OSError as e:
            protocol.send_msg(conn, {"ok": False, "error": _os_error(e, op).kind, "message": f"{op}: {e}"})
        except Exception as e:  # keep serving; the host sees the fault
            protocol.send_msg(conn, {"ok": False, "error": "internal", "message": f"{op}: {type(e).__name__}: {e}"})
        finally:
            if op != "fork":
                for fd in fds:
                    os.close(fd)
            if self._pending_move is not None:
                self._finish_move()
            elif self._fork is not None:
                self._settle_fork("done")

    def op_ping(self, conn, req, blob, fds):
        return {"id": self.id, "pid": os.getpid()}, b""

    def op_exec(self, conn, req, blob, fds):
        argv = req.get("argv") or ["/bin/sh", "-c", req["cmd"]]
        timeout_s = req.get("timeout")
        cap = int(req.get("max_output") or OUTPUT_CAP)
        stream = bool(req.get("stream"))
        start = time.monotonic()
        try:
            proc = self.spawn(argv, stdin_pipe=bool(blob), env=req.get("env"), cwd=req.get("cwd"))
        except spawner.SpawnError as e:
            if e.cwd_missing:
                raise RequestError("not_found", f"cwd {req.get('cwd')!r} does not exist in the sandbox") from e
            if e.kind in ("not_found", "permission"):
                raise RequestError("command", f"command not found or not executable: {argv[0]!r}") from e
            raise RequestError("internal", str(e)) from e
        if blob:
            try:
                proc.stdin.write(blob)
            except BrokenPipeError:
                pass
            proc.stdin.close()
        bufs = {"out": bytearray(), "err": bytearray()}
        sizes = {"out": 0, "err": 0}
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        deadline = None if timeout_s is None else start + timeout_s
        timed_out = False
        open_streams = 2
        while open_streams:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                timed_out = True
                break
            for key, _ in sel.select(wait):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                sizes[key.data] += len(chunk)
                room = cap - len(bufs[key.data])
                if room > 0:
                    bufs[key.data] += chunk[:room]
                if stream and room > 0:
                    protocol.send_msg(conn, {"ev": key.data}, chunk[:room])
        sel.close()
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        if timed_out:
            raise RequestError("timeout", f"command ran past its timeout of {timeout_s} s and was killed")
        exit_code = code if code >= 0 else 128 - code
        reply = {
            "exit_code": exit_code,
            "duration_ms": (time.monotonic() - start) * 1e3,
            "truncated": any(sizes[k] > cap for k in sizes),
        }
        if not stream:
            reply["stdout"] = bytes(bufs["out"]).decode(errors="replace")
            reply["stderr"] = bytes(bufs["err"]).decode(errors="replace")
        return reply, b""

    def op_shell(self, conn, req, blob, fds):
        start = time.monotonic()
        result = self.shell.run(req["cmd"], req.get("timeout"), int(req.get("max_output") or OUTPUT_CAP))
        if result.get("timeout"):
            raise RequestError("timeout", f"shell command ran past its timeout of {req.get('timeout')} s; "
                                          "the shell session was restarted and its state lost")
        return {**result, "duration_ms": (time.monotonic() - start) * 1e3}, b""

    def op_python(self, conn, req, blob, fds):
        cid = str(req.get("context") or kernels.DEFAULT)
        try:
            return self.kernels.run(cid, req["code"], req.get("timeout"), req.get("env")), b""
        except KeyError:
            raise RequestError("not_found", f"no interpreter context {cid!r}") from None

    def op_context_create(self, conn, req, blob, fds):
        self.kernels.create(str(req["context"]), req.get("cwd"))
        return {}, b""

    def op_context_list(self, conn, req, blob, fds):
        return {"contexts": [{"id": cid, "cwd": cwd} for cid, cwd in self.kernels.contexts.items()]}, b""

    def op_context_restart(self, conn, req, blob, fds):
        if not self.kernels.restart(str(req["context"])):
            raise RequestError("not_found", f"no interpreter context {req['context']!r}")
        return {}, b""

    def op_context_remove(self, conn, req, blob, fds):
        if not self.kernels.drop(str(req["context"])):
            raise RequestError("not_found", f"no interpreter context {req['context']!r}")
        return {}, b""

    # ---- files ----------------------------------------------------------------------------------------
    def op_read(self, conn, req, blob, fds):
        path = req["path"]
        if os.path.isdir(path):
            raise RequestError("is_directory", f"{path!r} is a directory")
        try:
            return {}, read_regular(path, MAX_READ)
        except ValueError as e:
            raise RequestError("invalid", str(e)) from e

    def op_write(self, conn, req, blob, fds):
        path = req["path"]
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        with open(path, "wb") as f:
            f.write(blob)
        if req.get("mode") is not None:
            os.chmod(path, int(req["mode"]))
        return {"size": len(blob)}, b""

    def op_list(self, conn, req, blob, fds):
        path = req["path"]
        entries = []
        with os.scandir(path) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                kind = ("symlink" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode)
                        else "file" if stat.S_ISREG(st.st_mode) else "other")
                entries.append({"name": entry.name, "path": os.path.join(path, entry.name), "type": kind,
                                "size": st.st_size, "mode": stat.S_IMODE(st.st_mode)})
        return {"entries": sorted(entries, key=lambda e: e["name"])}, b""

    def op_stat(self, conn, req, blob, fds):
        try:
            st = os.stat(req["path"], follow_symlinks=False)
        except FileNotFoundError:
            return {"exists": False}, b""
        return {"exists": True, "size": st.st_size, "mode": stat.S_IMODE(st.st_mode),
                "is_dir": stat.S_ISDIR(st.st_mode)}, b""

    def op_remove(self, conn, req, blob, fds):
        path = req["path"]
        if os.path.isdir(path) and not os.path.islink(path):
            if not req.get("recursive"):
                os.rmdir(path)
            else:
                shutil.rmtree(path)
        else:
            os.unlink(path)
        return {}, b""

    def op_mkdir(self, conn, req, blob, fds):
        os.makedirs(req["path"], exist_ok=True)
        return {}, b""

    # ---- lifecycle ------------------------------------------------------------------------------------
    def op_kill_agents(self, conn, req, blob, fds):
        """The host retires us (destroyed while forks of ours live): nothing of ours runs any more."""
        self.kill_agents(kernels_too=True)
        return {}, b""

    def op_shutdown(self, conn, req, blob, fds):
        protocol.send_msg(conn, {"ok": True})
        os._exit(0)


def bootstrap(config: dict) -> None:
    """First start on the host: namespaces, uid map via the host, pivot, then serve as pid 1."""
    sync = socket.socket(fileno=config["sync_fd"])
    sc.unshare(sc.CLONE_NEWUSER | NS_SANDBOX)
    sync.sendall(b"u")
    if sync.recv(1) != b"m":
        os._exit(1)
    # become the mapped root: our credentials still carry host uid 0, which is unmapped in the new namespace
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)  # (this also cleared "dumpable": the tool server stays non-dumpable, see _fork_child)
    if os.fork() != 0:
        os._exit(0)
    try:
        rootfs.enter_root(config["root_fd"], usr_bind=config["usr_bind"], hostname=config["id"][:63])
        rootfs.loopback_up()
        seccomp.install(_BASE_FILTER, no_new_privs=False)
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        server = ToolServer(socket.socket(fileno=config["listen_fd"]), config["id"], config.get("deadline"))
        sync.sendall(b"r")
        sync.close()
    except BaseException as e:
        sync.sendall(f"E{type(e).__name__}: {e}".encode()[:4000])
        os._exit(1)
    server.serve()


if __name__ == "__main__":
    bootstrap(json.loads(sys.argv[1]))
