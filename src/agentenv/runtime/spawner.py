"""The command launcher of a sandbox: a helper process that already wears the agent seccomp filter.

Installing a filter per command needs `preexec_fn`, which makes Python fork the whole tool server and run
Python code in the child before exec (several ms here). Instead the tool server forks one helper per
sandbox, lazily; the helper sets no_new_privs, the agent filter and the default OOM score once, and starts
each command with a plain (vfork-fast) `subprocess.Popen`, so every command inherits the filter. The tool
server creates the pipes and passes the child's ends over a socketpair (SCM_RIGHTS); the helper answers
with the pid, and later with the exit status (it is the parent, watching pidfds). Stdlib only.
"""

from __future__ import annotations

import os
import resource
import selectors
import socket
import subprocess

from agentenv import protocol

_ERRORS = {FileNotFoundError: "not_found", PermissionError: "permission", NotADirectoryError: "not_found"}


class SpawnError(OSError):
    """The helper could not start the command (`kind`: not_found, permission or internal)."""

    def __init__(self, kind: str, message: str, cwd_missing: bool):
        super().__init__(message)
        self.kind = kind
        self.cwd_missing = cwd_missing


class Spawned:
    """A running command: `pid`, pipes `stdin`/`stdout`/`stderr` (file objects or None), `wait()`."""

    def __init__(self, spawner: Spawner, pid: int, stdin, stdout, stderr):
        self._spawner = spawner
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._spawner.wait_exit(self.pid)
        return self.returncode


class Spawner:
    """The tool server's side: starts the helper on first use and talks to it.

    Args:
        setup: runs in the helper before it serves (installs the filter and no_new_privs).
    """

    def __init__(self, setup):
        self._setup = setup
        self._sock: socket.socket | None = None
        self._pid: int | None = None
        self._exits: dict[int, int] = {}
        self.nproc: int | None = None
        """Soft RLIMIT_NPROC of each command (None: inherited), so the sandbox's pids limit keeps headroom for
        the tool server and agent when a command forks without bound (`nproc_for`)."""

    def _ensure(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.dup2(theirs.fileno(), 3)
                os.closerange(4, 1 << 16)  # nothing of the tool server (listener, connections) stays open here
                self._setup()
                _serve(socket.socket(fileno=3))
            except BaseException:
                code = 1
            os._exit(code)
        theirs.close()
        self._sock, self._pid = ours, pid
        return ours

    def spawn(self, argv: list[str], *, stdin_pipe: bool, env: dict, cwd: str) -> Spawned:
        sock = self._ensure()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin_pipe else (os.open("/dev/null", os.O_RDONLY), -1)
        try:
            protocol.send_msg(sock, {"argv": argv, "env": env, "cwd": cwd, "nproc": self.nproc},
                              fds=[in_r, out_w, err_w])
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        reply = self._next_reply()
        if "pid" not in reply:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            raise SpawnError(reply.get("kind", "internal"), reply.get("message", "spawn failed"),
                             bool(reply.get("cwd_missing")))
        stdin = os.fdopen(in_w, "wb") if in_w >= 0 else None
        return Spawned(self, reply["pid"], stdin, os.fdopen(out_r, "rb", buffering=0),
                       os.fdopen(err_r, "rb", buffering=0))

    def _next_reply(self) -> dict:
        assert self._sock is not None
        while True:
            msg, _, fds = protocol.recv_msg(self._sock)
            for fd in fds:
                os.close(fd)
            if "exit" in msg:
                self._exits[msg["exit"]] = msg["code"]
                continue
            return msg

    def wait_exit(self, pid: int) -> int:
        while pid not in self._exits:
            if self._sock is None:
                return -9  # the helper was killed (fork/kill_agents), and its children with it
            try:
                msg, _, _ = protocol.recv_msg(self._sock)
            except (protocol.ConnectionClosed, OSError):
                self.forget()
                return -9
            if "exit" in msg:
                self._exits[msg["exit"]] = msg["code"]
        return self._exits.pop(pid)

    def forget(self) -> None:
        """Drop the helper (after it was killed, or in a forked child where it is not ours)."""
        if self._sock is not None:
            self._sock.close()
        self._sock, self._pid = None, None
        self._exits.clear()


def _serve(sock: socket.socket) -> None:
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                try:
                    req, _, fds = protocol.recv_msg(sock)
                except (protocol.ConnectionClosed, OSError):
                    return
                reply = _start(req, fds, sel)
                protocol.send_msg(sock, reply)
            else:
                proc = key.data
                sel.unregister(key.fileobj)
                os.close(key.fileobj)
                protocol.send_msg(sock, {"exit": proc.pid, "code": proc.wait()})


def _start(req: dict, fds: list[int], sel: selectors.BaseSelector) -> dict:
    try:
        proc = _popen_limited(req, fds)
    except OSError as e:
        kind = next((k for cls, k in _ERRORS.items() if isinstance(e, cls)), "internal")
        return {"kind": kind, "message": f"{req['argv'][0]!r}: {e.strerror}",
                "cwd_missing": not os.path.isdir(req["cwd"])}
    finally:
        for fd in fds:
            os.close(fd)
    sel.register(os.pidfd_open(proc.pid), selectors.EVENT_READ, proc)
    return {"pid": proc.pid}


def _popen_limited(req: dict, fds: list[int]) -> subprocess.Popen:
    """Start the command with soft RLIMIT_NPROC `req["nproc"]`, inherited at the fork (the launcher lowers its
    own soft limit around it). When the commands' share is used up, that fork fails: the command then starts
    with the launcher's limit, lowered right after (a command that forks in its first instants may get some
    children past the share; the pids cgroup still bounds them)."""
    nproc = req.get("nproc")
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)

    def popen() -> subprocess.Popen:
        return subprocess.Popen(req["argv"], stdin=fds[0], stdout=fds[1], stderr=fds[2], env=req["env"],
                                cwd=req["cwd"], start_new_session=True, close_fds=True)

    if nproc is None:
        return popen()
    resource.setrlimit(resource.RLIMIT_NPROC, (min(nproc, hard), hard))
    try:
        return popen()
    except BlockingIOError:  # the share is full (a fork bomb): start it on the headroom, limited at once
        pass
    finally:
        resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
    proc = popen()
    limit_nproc(proc.pid, nproc)
    return proc


PIDS_HEADROOM_MIN = 4


def nproc_for(pids: int) -> int:
    """The per-uid process limit for commands in a sandbox of `pids` processes: an eighth (at least
    `PIDS_HEADROOM_MIN`) stays for the tool server, the launcher and the envd agent."""
    return max(1, pids - max(PIDS_HEADROOM_MIN, pids // 8))


def limit_nproc(pid: int, nproc: int | None) -> None:
    """Set the soft RLIMIT_NPROC of the just-started `pid` (the hard limit stays, so the agent may restore its
    own). Set right after the (vfork) start, before the command's program has run any code of its own;
    best effort, the pids cgroup is the hard bound."""
    if nproc is None:
        return
    try:
        resource.prlimit(pid, resource.RLIMIT_NPROC, (nproc, resource.prlimit(pid, resource.RLIMIT_NPROC)[1]))
    except (ProcessLookupError, PermissionError, ValueError):
        pass
