"""Python kernels: one process per interpreter context, so a crash ends that context, not the sandbox.

Stdlib only (runs in the tool server). A kernel is a `fork()` of the tool server that runs a
`sessions.PythonSession` and answers on a socketpair (fd 3 in the kernel). Contexts are named; ``default``
always exists. A context's kernel starts on its first run; when it dies (a segfault, ``os._exit``, an OOM
kill, a kill) the run returns error ``DeadKernelError`` saying how it ended, and the next run starts a fresh
kernel. The tool server, its commands and the other contexts live on.

A sandbox fork carries every live kernel: once the tool server has cloned a child sandbox, each kernel
forks, the copy joins the child's namespaces (`setns` on namespace files the tool server opened while the
child was still dumpable: its init is not, so a pidfd or /proc would be refused later) and forks once more
to land in the child's pid namespace (the intermediate exits), then serves the child over a socketpair the
child inherited at its clone. So a forked sandbox starts with the parent's interpreter state,
copy-on-write. The host moves the carried kernel into the child's cgroup (the fork's ``kernel`` events).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import resource
import select
import signal
import socket
import time

from agentenv import protocol
from agentenv.runtime import sessions
from agentenv.runtime import syscalls as sc

DEFAULT = "default"
CHANNEL_FD = 3
HELLO_TIMEOUT_S = 10.0
RUN_GRACE_S = 5.0
"""How long past a run's own timeout (its SIGALRM) the tool server waits before killing the kernel."""
_JOIN = ("user", "mnt", "net", "uts", "ipc", "cgroup", "pid")
"""The namespaces a carried kernel joins, in order (the user namespace first: it grants the rights for the rest)."""
_PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, struct pidfd_info) with the 64-byte first version
_PIDFD_INFO_EXIT = 1 << 3


class _Kernel:
    """The tool server's handle on one kernel: its channel, pid (in our pid namespace, once known), pidfd."""

    def __init__(self, sock: socket.socket, pid: int | None, own: bool):
        self.sock = sock
        self.pid = pid
        self.own = own
        """Our child (we started it) or carried over from the parent sandbox (not our child)."""
        self.pidfd = -1
        self.cwd: str | None = None
        self.greeted = False

    def close(self) -> None:
        self.sock.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class Kernels:
    """The contexts of a sandbox and their kernel processes (the tool server's side).

    A new kernel keeps nothing of the tool server open but its channel; it keeps the tool server's seccomp
    filter (not the agents' one: carrying it over a fork needs `setns`), as the in-process interpreter did.
    """

    def __init__(self):
        self.contexts: dict[str, str | None] = {DEFAULT: None}
        """Context id -> its working directory (None: the sandbox's)."""
        self.live: dict[str, _Kernel] = {}
        self.memory_bytes: int | None = None
        self.nproc: int | None = None
        self._exits: dict[int, int] = {}
        self.last_carry_phases: dict = {}
        """Where the last kernel carried into a fork spent its time, in ms (fork, setns, fork into the child)."""

    # ---- contexts -------------------------------------------------------------------------------------
    def create(self, cid: str, cwd: str | None) -> None:
        self.contexts[cid] = cwd

    def drop(self, cid: str) -> bool:
        """Remove context `cid` (``default`` is restarted instead); False if there is none."""
        if cid not in self.contexts:
            return False
        self.stop(cid)
        if cid != DEFAULT:
            del self.contexts[cid]
        return True

    def restart(self, cid: str) -> bool:
        """End the kernel of `cid` (its state is lost; the next run starts afresh); False if no such context."""
        if cid not in self.contexts:
            return False
        self.stop(cid)
        return True

    def stop(self, cid: str) -> None:
        kernel = self.live.pop(cid, None)
        if kernel is None:
            return
        if kernel.pid is not None:
            try:
                os.kill(kernel.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if kernel.own:
                self._wait(kernel.pid, block=True)
        kernel.close()

    def stop_all(self) -> None:
        for cid in list(self.live):
            self.stop(cid)

    def pids(self) -> set[int]:
        """Pids (in our pid namespace) of the live kernels; carried kernels are asked for theirs first."""
        for cid in list(self.live):
            self._hello(cid)
        return {k.pid for k in self.live.values() if k.pid is not None}

    def note_exit(self, pid: int, status: int) -> None:
        """The tool server's reaper got `pid`'s status: keep it if it is one of our kernels."""
        if any(k.own and k.pid == pid for k in self.live.values()):
            self._exits[pid] = status

    # ---- running --------------------------------------------------------------------------------------
    def run(self, cid: str, code: str, timeout_s: float | None, env: dict | None = None) -> dict:
        """Run `code` in context `cid`'s kernel (started if needed); KeyError if there is no such context.

        Returns:
            The session's reply (stdout, stderr, value, error, traceback); error ``DeadKernelError`` when the
            kernel died during the run, ``TimeoutError`` when it had to be killed past its timeout.
        """
        if cid not in self.contexts:
            raise KeyError(cid)
        kernel = self.live.get(cid)
        if kernel is None:
            kernel = self._start(cid)
        how = self._hello(cid)
        if how is not None:
            return _dead(cid, how, during="start")
        kernel.sock.settimeout(None if timeout_s is None else timeout_s + RUN_GRACE_S)
        try:
            protocol.send_msg(kernel.sock, {"op": "run", "code": code, "timeout": timeout_s, "env": env or {}})
            reply, _, _ = protocol.recv_msg(kernel.sock)
        except TimeoutError:
            self.stop(cid)
            return {"stdout": "", "stderr": "", "value": None, "error": "TimeoutError",
                    "traceback": f"the kernel of context {cid!r} did not stop at its timeout of {timeout_s} s and "
                                 "was killed; its state is lost, the next run starts a fresh kernel\n"}
        except (protocol.ConnectionClosed, OSError):
            return _dead(cid, self._ended(cid), during="run")
        finally:
            if cid in self.live:
                kernel.sock.settimeout(None)
        return reply

    def _start(self, cid: str) -> _Kernel:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the kernel
            try:
                os.dup2(theirs.fileno(), CHANNEL_FD)
                os.closerange(CHANNEL_FD + 1, 1 << 16)  # nothing of the tool server stays open here
                _serve(self.contexts[cid], self.memory_bytes, self.nproc)
            finally:
                os._exit(1)
        theirs.close()
        kernel = self.live[cid] = _Kernel(ours, pid, own=True)
        return kernel

    def _hello(self, cid: str) -> str | None:
        """Read the kernel's first frame (its pid) if not yet done; returns how it ended if it is dead."""
        kernel = self.live[cid]
        if kernel.greeted:
            return None
        kernel.sock.settimeout(HELLO_TIMEOUT_S)
        try:
            hello, _, _ = protocol.recv_msg(kernel.sock)
        except (protocol.ConnectionClosed, OSError):
            return self._ended(cid)
        finally:
            if cid in self.live:
                kernel.sock.settimeout(None)
        if hello.get("error"):
            self.stop(cid)
            return hello["error"]
        kernel.greeted = True
        kernel.pid = int(hello["pid"])
        kernel.cwd = hello.get("cwd") or "/"
        if not kernel.own:
            try:
                kernel.pidfd = os.pidfd_open(kernel.pid)
            except OSError:
                pass
        return None

    def _ended(self, cid: str) -> str:
        """The kernel of `cid` closed its channel: make sure it is gone, forget it, say how it ended."""
        kernel = self.live.pop(cid)
        status = None
        if kernel.pid is not None and kernel.own:
            status = self._wait(kernel.pid, block=False, patience_s=1.0)
            if status is None:  # alive but closed its channel (user code closed fd 3): end it
                os.kill(kernel.pid, signal.SIGKILL)
                self._wait(kernel.pid, block=True)
                kernel.close()
                return "it closed its channel to the sandbox and was killed"
        elif kernel.pidfd >= 0:
            status = _pidfd_exit_status(kernel.pidfd)
            if status is None:
                try:
                    os.kill(kernel.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        kernel.close()
        return describe_status(status)

    def _wait(self, pid: int, *, block: bool, patience_s: float = 0.0) -> int | None:
        steps = max(1, int(patience_s / 0.01))
        for _ in range(steps):
            if pid in self._exits:
                return self._exits.pop(pid)
            try:
                got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return self._exits.pop(pid, None)
            if got == pid:
                return status
            select.select([], [], [], 0.01)
        return None

    # ---- carrying kernels over a sandbox fork -----------------------------------------------------------
    def channels_for(self, n: int) -> list[list[tuple[str, socket.socket, socket.socket]]]:
        """Before cloning `n` children: per child, a socketpair per live kernel (the child keeps the first end)."""
        return [[(cid, *socket.socketpair()) for cid in self.live] for _ in range(n)]

    def enter_child(self, index: int, channels: list) -> None:
        """In cloned child `index`: our kernels are the ones the parent's kernels will carry in on `channels`."""
        for kernel in self.live.values():
            kernel.close()
        self.live = {}
        self._exits = {}
        for at, pairs in enumerate(channels):
            for cid, ours, theirs in pairs:
                theirs.close()
                if at == index:
                    self.live[cid] = _Kernel(ours, None, own=False)
                else:
                    ours.close()

    def carry(self, pairs: list, ns_fds: list[int], memory_bytes: int | None, nproc: int | None) -> list[int]:
        """Have each live kernel put a copy of itself into the child sandbox whose namespaces are `ns_fds`.

        Returns:
            The copies' pids in our pid namespace (for the host to move into the child's cgroup). A kernel
            that fails to carry leaves its context in the child with a fresh start (the child sees the
            channel close), never a fault of the fork.
        """
        sent = []
        for cid, ours, theirs in pairs:  # every kernel clones itself at once; the answers are read after
            ours.close()
            kernel = self.live.get(cid)
            try:
                if kernel is not None and self._hello(cid) is None:
                    protocol.send_msg(kernel.sock, {"op": "clone", "memory_bytes": memory_bytes, "nproc": nproc},
                                      fds=[theirs.fileno(), *ns_fds])
                    sent.append(cid)
            except (protocol.ConnectionClosed, OSError):
                self._ended(cid)
            finally:
                theirs.close()
        pids = []
        for cid in sent:
            kernel = self.live.get(cid)
            if kernel is None:
                continue
            kernel.sock.settimeout(HELLO_TIMEOUT_S)
            try:
                reply, _, _ = protocol.recv_msg(kernel.sock)
            except (protocol.ConnectionClosed, OSError):
                self._ended(cid)
                continue
            finally:
                if cid in self.live:
                    kernel.sock.settimeout(None)
            if reply.get("pid"):
                pids.append(int(reply["pid"]))
                self.last_carry_phases = reply.get("phases") or {}
            kernel.cwd = reply.get("cwd") or kernel.cwd
        return pids

    def after_move(self) -> None:
        """We moved onto a new root: kernels whose cwd was not the root re-enter theirs by path."""
        for cid, kernel in list(self.live.items()):
            if kernel.cwd in (None, "/"):
                continue
            try:
                protocol.send_msg(kernel.sock, {"op": "chdir", "path": kernel.cwd})
                protocol.recv_msg(kernel.sock)
            except (protocol.ConnectionClosed, OSError):
                self._ended(cid)


def open_namespaces(pid: int) -> list[int]:
    """Descriptors of process `pid`'s namespaces, in `_JOIN` order (for a later `clone` request)."""
    fds: list[int] = []
    try:
        for name in _JOIN:
            fds.append(os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _dead(cid: str, how: str, *, during: str) -> dict:
    text = (f"the Python kernel of context {cid!r} died during its {during}: {how}. Its state is lost; the sandbox "
            "and its other contexts live on, and the next run in this context starts a fresh kernel\n")
    return {"stdout": "", "stderr": "", "value": None, "error": "DeadKernelError", "traceback": text}


def describe_status(status: int | None) -> str:
    """Words for a wait status: exit code, or signal (SIGKILL: the OOM killer or a kill)."""
    if status is None:
        return "it ended (its exit status is not visible from this sandbox)"
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"it exited with code {code} (os._exit, or the interpreter itself quit)"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return (f"it was killed by {name}: the out-of-memory killer at the sandbox's memory limit, or a kill")
    if -code in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT):
        return f"it crashed with {name} (a fault in native code, e.g. ctypes or a C extension, or os.abort)"
    return f"it was killed by {name}"


class _PidfdInfo(ctypes.Structure):
    _fields_ = [("mask", ctypes.c_uint64), ("cgroupid", ctypes.c_uint64), ("ids", ctypes.c_uint32 * 11),
                ("exit_code", ctypes.c_int32)]


def _pidfd_exit_status(pidfd: int, patience_s: float = 2.0) -> int | None:
    """Wait status of a process that is not our child, from its pidfd (Linux 6.15+; None where unsupported).

    Its parent (the sandbox a kernel was forked from) reaps it; the status shows once it is reaped.
    """
    for _ in range(max(1, int(patience_s / 0.02))):
        info = _PidfdInfo(mask=_PIDFD_INFO_EXIT)
        buf = bytearray(bytes(info))
        try:
            fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
        except OSError:
            pass
        else:
            got = _PidfdInfo.from_buffer(buf)
            if got.mask & _PIDFD_INFO_EXIT:
                return got.exit_code
        select.select([], [], [], 0.02)
    return None


# ---- the kernel process ------------------------------------------------------------------------------
def _serve(cwd: str | None, memory_bytes: int | None, nproc: int | None) -> None:
    """The kernel's loop on fd `CHANNEL_FD`: ``run``, ``clone``, ``chdir``; never returns."""
    sock = socket.socket(fileno=CHANNEL_FD)
    sock.set_inheritable(False)
    session = sessions.PythonSession()
    _settle(session, memory_bytes, nproc)
    error = None
    if cwd:
        try:
            os.makedirs(cwd, exist_ok=True)
            os.chdir(cwd)
        except OSError as e:
            error = f"cannot enter the context's cwd {cwd!r}: {e.strerror}"
    protocol.send_msg(sock, {"pid": os.getpid(), "cwd": _cwd(), "error": error})
    if error:
        os._exit(1)
    _loop(sock, session)


def _settle(session: sessions.PythonSession, memory_bytes: int | None, nproc: int | None) -> None:
    session.memory_bytes = memory_bytes
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # picked before the tool server at the memory limit
            f.write("500")
    except OSError:
        pass
    if nproc:
        _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (min(nproc, hard), hard))


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "/"


def _loop(sock: socket.socket, session: sessions.PythonSession) -> None:
    while True:
        _reap_middles()
        try:
            req, _, fds = protocol.recv_msg(sock)
        except (protocol.ConnectionClosed, OSError):
            os._exit(0)
        op = req.get("op")
        if op != "clone" or len(fds) != 1 + len(_JOIN):
            for fd in fds:
                os.close(fd)
        if op == "run":
            reply = _run(session, req)
        elif op == "clone" and len(fds) == 1 + len(_JOIN):
            reply = _clone(sock, session, req, fds[0], fds[1:])
        elif op == "chdir":
            try:
                os.chdir(req["path"])
            except OSError:
                os.chdir("/")
            reply = {}
        else:
            reply = {"error": f"unknown kernel op {op!r}"}
        protocol.send_msg(sock, reply)


def _run(session: sessions.PythonSession, req: dict) -> dict:
    env = req.get("env") or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return session.run(req["code"], req.get("timeout"))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _clone(sock: socket.socket, session: sessions.PythonSession, req: dict, channel: int, ns_fds: list[int]) -> dict:
    """Put a copy of this kernel into the sandbox whose namespaces are `ns_fds`, serving on `channel`."""
    cwd = _cwd()
    t0 = time.perf_counter()
    r, w = os.pipe()
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))  # the copy is the sandbox's, not this share's
    try:
        middle = os.fork()
    except OSError as e:
        for fd in (r, w, channel, *ns_fds):
            os.close(fd)
        return {"error": f"fork: {e}", "cwd": cwd}
    finally:
        resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
    t1 = time.perf_counter()
    if middle == 0:
        try:
            os.close(r)
            for fd in ns_fds:
                sc.setns(fd, 0)
                os.close(fd)
            t2 = time.perf_counter()
            pid = os.fork()  # into the child sandbox's pid namespace
            if pid == 0:
                os.close(w)
                os.dup2(channel, CHANNEL_FD)
                os.close(channel)
                sock.detach()
                new = socket.socket(fileno=CHANNEL_FD)
                new.set_inheritable(False)
                try:
                    os.chdir(cwd)
                except OSError:
                    os.chdir("/")
                _settle(session, req.get("memory_bytes"), req.get("nproc"))
                protocol.send_msg(new, {"pid": os.getpid(), "cwd": _cwd()})
                _loop(new, session)
            os.write(w, f"{pid} {(t2 - t1) * 1e3:.2f} {(time.perf_counter() - t2) * 1e3:.2f}\n".encode())
        except BaseException as e:
            try:
                os.write(w, f"E{type(e).__name__}: {e}".encode()[:2000])
            except OSError:
                pass
        os._exit(0)
    for fd in (w, channel, *ns_fds):
        os.close(fd)
    out = b""
    while not out.endswith(b"\n") and (chunk := os.read(r, 4096)):  # the pid, before the middle one exits
        out += chunk
    os.close(r)
    _MIDDLES.append(middle)
    if out[:1].isdigit():
        pid, setns_ms, fork_ms = out.split()
        return {"pid": int(pid), "cwd": cwd, "phases": {"fork_ms": (t1 - t0) * 1e3, "setns_ms": float(setns_ms),
                                                        "fork_in_ms": float(fork_ms),
                                                        "total_ms": (time.perf_counter() - t0) * 1e3}}
    return {"error": out[1:].decode(errors="replace") or "the copy did not start", "cwd": cwd}


_MIDDLES: list[int] = []
"""The short-lived middle processes of `_clone` (they exit right after forking the copy), reaped later."""


def _reap_middles() -> None:
    for pid in list(_MIDDLES):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done == pid:
            _MIDDLES.remove(pid)

