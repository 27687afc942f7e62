"""Host side of the in-sandbox envd agent (`agentenv.server.agent`): start it, reach it, talk to it.

The agent listens on the sandbox's own loopback. The host reaches it by creating the socket inside the
sandbox's network namespace: the calling thread joins that namespace with setns(2), creates the socket, and
returns to its own namespace at once (a socket keeps the namespace it was created in; setns of a network
namespace affects only the calling thread). Connections are pooled per sandbox for unary calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket
import stat
import threading
from pathlib import Path

from agentenv.server import agent as wire

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
AGENT_PYTHON = "/usr/bin/python3"
START_TIMEOUT_S = 20.0
POOL_SIZE = 64
MAX_BLOB = 1 << 30
"""Largest payload accepted from an agent (a file read), in bytes: the agent shares its sandbox with untrusted code."""
_libc: ctypes.CDLL | None = None
_AGENT_SOURCE: bytes | None = None


class AgentError(Exception):
    """The agent failed a request; `code` is a Connect error code (``not_found``, ``internal``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class AgentUnavailable(AgentError):
    """The agent cannot be reached (sandbox gone, paused, or the agent failed to start)."""

    def __init__(self, message: str):
        super().__init__("unavailable", message)


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if _libc.setns(ctypes.c_int(fd), ctypes.c_int(CLONE_NEWNET)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(net): {os.strerror(err)}")


def _agent_source() -> bytes:
    """What the boot program reads on stdin: each helper module as its length (10 digits) and source (the file
    reader, then the watches; both run in one module namespace), then the agent's source."""
    global _AGENT_SOURCE
    if _AGENT_SOURCE is None:
        from agentenv.runtime import fileio
        from agentenv.server import watch

        parts = [Path(m.__file__).read_bytes() for m in (fileio, watch)]
        _AGENT_SOURCE = b"".join(b"%010d" % len(p) + p for p in parts) + Path(wire.__file__).read_bytes()
    return _AGENT_SOURCE


def socket_in_netns(pid: int) -> socket.socket:
    """A TCP socket created in the network namespace of host process `pid` (not yet connected)."""
    target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        finally:
            _setns(own)  # never leave a server thread in a sandbox's namespace
    finally:
        os.close(target)
        os.close(own)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


SYS_OPENAT2 = 437
"""openat2(2) on x86_64 and aarch64 alike."""
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_regular_in_sandbox(pid: int, path: str) -> tuple[int, int] | None:
    """Open the regular file at absolute `path` as the sandbox of host process `pid` sees it, from the host.

    Resolution is confined to the sandbox's root (``RESOLVE_IN_ROOT``: ``..`` and absolute symlinks stop
    there) inside its mount namespace (through ``/proc/<pid>/root``), and no magic link (``/proc/*/fd``,
    ``/proc/*/root``) is followed, so a sandbox cannot point the server outside itself. Only a regular file
    is opened for reading (device nodes and FIFOs are looked at by ``O_PATH`` alone). The server then
    sends it with sendfile(2) instead of copying it through the agent.

    Returns:
        ``(fd, size in bytes)`` (the caller closes `fd`), or None when the fast path does not apply (not a
        regular file, missing, no openat2); the agent then answers, with its own errors.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(root), os.fsencode(path), ctypes.byref(how),
                           ctypes.c_size_t(ctypes.sizeof(how)))
    finally:
        os.close(root)
    if fd < 0:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > wire.MAX_READ:
            return None
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC), st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)


class AgentLink:
    """Connections to one sandbox's agent.

    Args:
        sandbox: the runtime `agentenv.Sandbox` (used to start the agent through the tool server).
        pid: host pid of the sandbox's tool server (any process in the sandbox's network namespace).
    """

    def __init__(self, sandbox, pid: int):
        self.sandbox = sandbox
        self.pid = pid
        self._pool: list[socket.socket] = []
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self.ended_by: str | None = None
        """Set by `retire`: the operation (``fork``, ``snapshot``) that ends every process of the sandbox."""

    def _dial(self) -> socket.socket:
        sock = socket_in_netns(self.pid)
        try:
            sock.connect(("127.0.0.1", wire.PORT))
        except OSError:
            sock.close()
            raise
        return sock

    def open(self) -> socket.socket:
        """A fresh connection, starting the agent first if it does not answer."""
        try:
            return self._dial()
        except FileNotFoundError as e:
            raise AgentUnavailable(f"sandbox {self.sandbox.id} is gone") from e
        except ConnectionRefusedError:
            pass
        with self._start_lock:
            try:
                return self._dial()
            except ConnectionRefusedError:
                self._start()
            try:
                return self._dial()
            except OSError as e:
                raise AgentUnavailable(f"envd agent of sandbox {self.sandbox.id} does not answer: {e}") from e

    def _start(self) -> None:
        from agentenv import errors

        boot = ("import sys, types; src = sys.stdin.buffer.read(); i = 0\n"
                "m = sys.modules['agentenv_envd_watch'] = types.ModuleType('agentenv_envd_watch')\n"
                "for name in ('fileio', 'watch'):\n"
                "    n = int(src[i:i + 10]); exec(compile(src[i + 10:i + 10 + n], 'agentenv-envd-' + name, 'exec'), "
                "m.__dict__); i += 10 + n\n"
                "exec(compile(src[i:], 'agentenv-envd-agent', 'exec'), {'__name__': 'agentenv_envd_agent'})")
        try:
            result = self.sandbox.commands.run([AGENT_PYTHON, "-I", "-S", "-c", boot], stdin=_agent_source(),
                                               timeout=START_TIMEOUT_S)
        except errors.SandboxError as e:
            raise AgentUnavailable(f"could not start the envd agent in sandbox {self.sandbox.id}: {e}") from e
        if result.exit_code != 0:
            raise AgentUnavailable(f"envd agent of sandbox {self.sandbox.id} failed to start "
                                   f"(exit {result.exit_code}): {result.stderr[-2000:]}")
        log.debug("started envd agent in %s", self.sandbox.id)

    def acquire(self) -> socket.socket:
        """A pooled idle connection, or a new one."""
        with self._lock:
            if self._pool:
                return self._pool.pop()
        return self.open()

    def release(self, sock: socket.socket) -> None:
        """Return a connection whose last request ended cleanly (its final frame was read)."""
        with self._lock:
            if len(self._pool) < POOL_SIZE:
                self._pool.append(sock)
                return
        sock.close()

    def call(self, req: dict, blob: bytes = b"") -> tuple[dict, bytes]:
        """One unary request on a pooled connection.

        Raises:
            AgentError: the agent refused the request.
            AgentUnavailable: the agent cannot be reached.
        """
        for attempt in range(2):
            sock = self.acquire()
            try:
                wire.send(sock, req, blob)
                reply, out = wire.recv(sock, MAX_BLOB)
                break
            except (EOFError, OSError) as e:
                sock.close()  # a pooled connection the agent dropped (e.g. restarted after a fork): retry fresh
                if attempt == 1:
                    raise AgentUnavailable(f"envd agent of sandbox {self.sandbox.id} went away: {e}") from e
        self.release(sock)
        if not reply.get("ok"):
            raise AgentError(str(reply.get("code", "internal")), str(reply.get("message", "request failed")))
        return reply, out

    def retire(self, reason: str) -> None:
        """The runtime is about to kill every process in the sandbox, the agent included (`reason`: ``fork`` or
        ``snapshot``): streams still open on this link report their process as killed, not as a lost sandbox."""
        self.ended_by = reason
        self.close()

    def close(self) -> None:
        with self._lock:
            for sock in self._pool:
                sock.close()
            self._pool.clear()
