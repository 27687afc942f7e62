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

NS_SANDBOX = sc.CLONE_NEWNS | sc.CLONE_NEWPID | sc.CLONE_NEWNET | sc.CLONE_NEWUTS | sc.CLONE_NEWIPC | sc.CLONE_NEWCGROUP
OUTPUT_CAP = 16 << 20
MAX_READ = 256 << 20
"""Largest file `files.read` returns (the tool server holds it in memory); larger ones are refused."""
FORK_OWNER_UID = 65533
"""Owner (in our user namespace) of each forked child's user namespace; no process of ours runs as it."""
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_AGENT_FILTER = seccomp.build_filter(seccomp.AGENT_DENY, block_namespace_clone=True)
_BASE_FILTER = seccomp.build_filter(seccomp.BASE_DENY)


class RequestError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


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


class ToolServer:
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
            for key, _ in sel.select(timeout):
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

    def _finish_move(self) -> None:
        """After answering a fork: read the host's ``move`` (our new root) on that connection and enter it.

        Nothing of ours runs meanwhile (agents were killed for the fork, and no other request is read
        first), so every request after a fork or snapshot sees the new writable layer. If the move does
        not come or fails, we stop serving for good rather than write to the sealed layer.
        """
        conn, usr_bind = self._pending_move
        self._pending_move = None
        start = time.perf_counter()
        fds: list[int] = []
        try:
            try:
                req, _, fds = protocol.recv_msg(conn)
            except (protocol.ConnectionClosed, OSError):
                # the host is gone before sending our new root: undo the fork (its children die, we stay on
                # our layer, which nothing else reads then)
                self._roll_back_fork()
                return
            if req.get("op") != "move" or len(fds) != 1:
                raise RequestError("invalid", f"expected the move after a fork, got {req.get('op')!r}")
            rootfs.enter_root(fds[0], usr_bind=usr_bind, hostname=None)
            self._settle_fork("moved")
            self.kernels.after_move()
        except BaseException:
            # still on the sealed layer, which the forks and snapshots now read: never write to it again
            self.broken = True
            self._expire(self._sel)
        finally:
            for fd in fds:
                os.close(fd)
        self.last_move_ms = (time.perf_counter() - start) * 1e3

    def _settle_fork(self, outcome: str) -> None:
        fork_id, _ = self._fork
        self._fork = None
        if fork_id:
            self.fork_outcomes[fork_id] = outcome
            while len(self.fork_outcomes) > 64:
                self.fork_outcomes.pop(next(iter(self.fork_outcomes)))

    def _roll_back_fork(self) -> None:
        """Kill the children of the fork in progress (each is pid 1 of its namespaces: all of it dies)."""
        _, pids = self._fork
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self._settle_fork("rolled_back")

    def op_fork_outcome(self, conn, req, blob, fds):
        """What became of fork `fork_id`: ``done`` (answered), ``moved`` (answered and moved onto the new
        layer), ``rolled_back`` (the host vanished first: its children were killed) or ``unknown``."""
        return {"outcome": self.fork_outcomes.get(str(req.get("fork_id")), "unknown")}, b""

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
        self.kill_agents()
        return {}, b""

    def op_fork(self, conn, req, blob, fds):
        """Fork one sandbox per entry of `children`, then (if `rebase`) move onto a new writable layer.

        fds: per child its root mount (unless the child's ``own_root`` is false) and its listening socket;
        with `rebase`, the host sends our own new root in a ``move`` frame after our answer (it builds
        that root while we clone). Children are cloned before the parent moves, so a child without its own
        root (a snapshot: it never serves agents, only forks) keeps the sealed root it was cloned in, and no
        agent of the parent runs meanwhile to change it. We answer once every child is ready (or failed:
        ``failed``) and move right after answering (`_finish_move`), before any further request; the
        reply's ``previous_move_ms`` is how long the last move took.
        """
        rebase = bool(req.get("rebase"))
        children = req["children"]
        clock = [time.perf_counter()]
        phases = {}

        def mark(name: str) -> None:
            now = time.perf_counter()
            phases[name] = (now - clock[0]) * 1e3
            clock[0] = now

        started: list[tuple[int, int, dict]] = []
        channels: list = []
        namespaces: list[list[int]] = []
        try:
            self.shell.dump_state()
            self.shell.close()
            if rebase:
                self.kill_agents()
            mark("shell_ms")
            channels = self.kernels.channels_for(len(children))
            at = 0
            for index, child in enumerate(children):
                root_fd = None
                if child.get("own_root", True):
                    root_fd = fds[at]
                    at += 1
                listen_fd = fds[at]
                at += 1
                started.append(self._clone_child(index, child, root_fd, listen_fd, req["usr_bind"], conn, fds,
                                                 [r for _, r, _ in started], channels, namespaces))
            mark("children_ms")
            pids = [pid for pid, _, _ in started]
            self._fork = (req.get("fork_id"), pids)
            failures = []
            while started:
                failures.append(self._await_child(*started.pop(0)))
            mark("ready_ms")
            for index, child in enumerate(children):
                carried = self.kernels.carry(channels[index], namespaces[index], child.get("memory_bytes"),
                                             child.get("nproc"))
                for kernel_pid in carried:  # the host moves it into the child's cgroup
                    protocol.send_msg(conn, {"ev": "kernel", "index": index}, creds_pid=kernel_pid)
            channels = []
            mark("kernels_ms")
            phases["previous_move_ms"] = self.last_move_ms
            phases["last_child"] = getattr(self, "last_child_phases", {})
            if rebase:
                self._pending_move = (conn, bool(req["usr_bind"]))
        finally:
            for fd in fds:
                os.close(fd)
            for _, r_ready, _ in started:
                os.close(r_ready)
            for pairs in channels:
                for _, ours, theirs in pairs:
                    ours.close()
                    theirs.close()
            for ns_fds in namespaces:
                for fd in ns_fds:
                    os.close(fd)
        # we move after answering (if asked to): failed children are reported, not raised, so the host knows
        failed = [f"child {children[i]['id']} failed: {f}" for i, f in enumerate(failures) if f]
        return {"pids": pids, "phases": phases, "failed": failed}, b""

    def _clone_child(self, index, child, root_fd, listen_fd, usr_bind, conn, all_fds, siblings, channels,
                     namespaces) -> tuple:
        """Clone one child into fresh namespaces, write its id maps, name it to the host.

        Returns:
            ``(pid, ready_fd, timings)``; `_await_child` reads the child's readiness from ``ready_fd``.
        """
        r_map, w_map = os.pipe()
        r_ready, w_ready = os.pipe()
        t0 = time.perf_counter()
        pid = -1
        try:
            # the child must be dumpable while we write its uid map (else its /proc files belong to the host's
            # root); otherwise tool servers stay non-dumpable, so agents cannot open /proc/1/mem or /proc/1/fd
            # the child's user namespace is owned by FORK_OWNER_UID, not by our root, so its processes count
            # against that user's RLIMIT_NPROC here (the kernel charges every process up the namespace chain to
            # each namespace's owner): a fork bomb in the child leaves our agents their own share
            os.setresuid(-1, FORK_OWNER_UID, -1)  # effective caps drop; permitted stay (uid and saved uid are 0)
            sc.prctl(sc.PR_SET_DUMPABLE, 1)
            try:
                pid = sc.fork_into_namespaces(sc.CLONE_NEWUSER | NS_SANDBOX)
            finally:
                if pid != 0:
                    os.setresuid(-1, 0, -1)  # effective caps back from the permitted set
                    sc.prctl(sc.PR_SET_DUMPABLE, 1)
        except OSError as e:
            sc.prctl(sc.PR_SET_DUMPABLE, 0)
            os.close(r_map)
            os.close(w_map)
            os.close(r_ready)
            os.close(w_ready)
            if e.errno in (errno.ENOSPC, errno.EUSERS):
                raise RequestError("invalid", "fork depth limit: forked sandboxes nest their user and pid "
                                   "namespaces (at most 32 levels); fork from an earlier generation instead") from e
            raise
        if pid == 0:  # child: pid 1 of fresh user, mount, pid, net, uts, ipc and cgroup namespaces
            code = 1
            try:
                t1 = time.perf_counter()
                os.close(w_map)
                os.close(r_ready)
                for fd in siblings:  # earlier siblings' readiness pipes
                    os.close(fd)
                for ns_fds in namespaces:
                    for fd in ns_fds:
                        os.close(fd)
                if os.read(r_map, 1) != b"m":
                    os._exit(1)
                os.setresuid(0, 0, 0)  # root of our namespace (we were cloned as FORK_OWNER_UID, see above)
                sc.prctl(sc.PR_SET_DUMPABLE, 0)
                t2 = time.perf_counter()
                if root_fd is not None:
                    rootfs.enter_root(root_fd, usr_bind=usr_bind, hostname=child["id"][:63])
                else:  # the parent's /proc shows the parent's pid namespace; ours is needed to map our children
                    sc.mount("proc", "/proc", "proc", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC)
                t3 = time.perf_counter()
                if root_fd is not None:
                    rootfs.loopback_up()
                t4 = time.perf_counter()
                listener = socket.socket(fileno=listen_fd)
                for fd in all_fds:
                    if fd != listen_fd:
                        os.close(fd)
                conn.close()
                self.listener.close()
                for c in self.conns:
                    c.close()
                self.conns = []
                self.spawner.forget()  # the parent's launcher is not ours (nor visible) in the new pid namespace
                self.spawner.nproc = child.get("nproc")
                self.kernels.enter_child(index, channels)
                self.kernels.memory_bytes = child.get("memory_bytes")
                self.kernels.nproc = child.get("nproc")
                self.id = child["id"]
                self.deadline = child.get("deadline")
                self.listener = listener
                self.own_pidns = os.readlink("/proc/self/ns/pid")
                self.retired = False
                # child_ms: from before the clone until the child runs (page tables, namespaces, scheduling)
                phases = {"child_ms": (t1 - t0) * 1e3, "map_ms": (t2 - t1) * 1e3, "root_ms": (t3 - t2) * 1e3,
                          "lo_ms": (t4 - t3) * 1e3, "setup_ms": (time.perf_counter() - t4) * 1e3}
                os.write(w_ready, b"r" + json.dumps(phases).encode())
                os.close(w_ready)
                self.serve()
            except BaseException as e:  # report to the parent; never return into its loop
                try:
                    os.write(w_ready, f"E{type(e).__name__}: {e}".encode()[:4000])
                except OSError:
                    pass
            os._exit(code)
        t_clone = time.perf_counter()
        os.close(r_map)
        os.close(w_ready)
        try:
            for name, line in (("uid_map", "0 0 65536\n"), ("gid_map", "0 0 65536\n")):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(line)
            # our kernels join the child's namespaces later, by these (opened while the child is dumpable)
            namespaces.append(kernels.open_namespaces(pid) if channels[index] else [])
            sc.prctl(sc.PR_SET_DUMPABLE, 0)
            os.write(w_map, b"m")
            # tell the host the child's pid now (translated by the kernel), so it can move the child into its
            # cgroup while the child mounts its root
            protocol.send_msg(conn, {"ev": "child", "index": index}, creds_pid=pid)
        except BaseException:
            os.close(r_ready)
            raise
        finally:
            os.close(w_map)
        t_sent = time.perf_counter()
        return pid, r_ready, {"clone_ms": (t_clone - t0) * 1e3, "maps_ms": (t_sent - t_clone) * 1e3, "sent": t_sent}

    def _await_child(self, pid: int, r_ready: int, timings: dict) -> str:
        """Wait for a cloned child to serve (closes `r_ready`); returns its error message, or "" when ready."""
        try:
            status = os.read(r_ready, 4096)
        finally:
            os.close(r_ready)
        if status[:1] != b"r":
            return status[1:].decode(errors="replace") or f"child {pid} exited during setup"
        sent = timings.pop("sent")
        self.last_child_phases = {**json.loads(status[1:] or b"{}"), **timings,
                                  "wait_ms": (time.perf_counter() - sent) * 1e3}
        return ""

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
