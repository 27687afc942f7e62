"""A connection to one sandbox's tool server: send a request frame, collect events, map failures."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from agentenv import errors, protocol

REQUEST_MARGIN_S = 30.0
#: Seconds a tool server has to answer `Connection.peer_pid`.
WHOAMI_TIMEOUT_S = 5.0
"""How much longer than a request's own timeout the host waits for the reply before giving up."""


class Connection:
    """One unix-socket connection; requests on it are serialised by a lock.

    Args:
        path: the tool server's listening socket.
        sandbox_id: used in error messages.
    """

    def __init__(self, path: Path | str, sandbox_id: str):
        self.sandbox_id = sandbox_id
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.connect(str(path))
        except OSError as e:
            self._sock.close()
            raise errors.SandboxGoneError(f"sandbox {sandbox_id} is not running ({e.strerror})") from e

    def peer_pid(self) -> int:
        """Host pid of the tool server.

        SO_PEERCRED would name whoever called listen() (the host made the socket), so the tool server sends
        its pid as SCM_CREDENTIALS, which the kernel checks and translates into our pid namespace.
        """
        with self._lock:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            # a socket whose server never accepts (its sandbox was never cloned) must not hang the caller
            self._sock.settimeout(WHOAMI_TIMEOUT_S)
            try:
                protocol.send_msg(self._sock, {"op": "whoami"})
                size = struct.calcsize("3i")
                data, ancdata, _, _ = self._sock.recvmsg(1, socket.CMSG_SPACE(size))
            except OSError as e:  # socket.timeout included
                self.close()
                raise errors.SandboxGoneError(f"sandbox {self.sandbox_id} is gone: {e or 'no answer'}") from e
            self._sock.settimeout(None)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                return struct.unpack("3i", payload[:size])[0]
        raise errors.SandboxError(f"sandbox {self.sandbox_id} did not send its credentials")

    def request(
        self,
        obj: dict,
        blob: bytes = b"",
        *,
        fds: list[int] | tuple[int, ...] = (),
        timeout_s: float | None = None,
        on_event: Callable[[str, bytes], None] | None = None,
        on_child: Callable[[dict, int | None], None] | None = None,
    ) -> tuple[dict, bytes]:
        """Send `obj` (+ `blob`, `fds`) and wait for the final reply.

        Args:
            timeout_s: the request's own timeout in seconds; the host waits that plus `REQUEST_MARGIN_S`.
            on_event: called with ``("out" | "err", chunk)`` for streamed output frames.
            on_child: called with ``(event, host_pid)`` for each ``{"ev": "child"}`` frame of a fork, and each
                ``{"ev": "kernel"}`` frame (a Python kernel carried into that child) (the pid comes as
                SCM_CREDENTIALS; SO_PASSCRED is on for the request).

        Raises:
            SandboxGoneError: the tool server went away.
            SandboxError: (or a subclass) the request failed inside the sandbox.
        """
        with self._lock:
            self._sock.settimeout(None if timeout_s is None else timeout_s + REQUEST_MARGIN_S)
            if on_child is not None:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            try:
                protocol.send_msg(self._sock, obj, blob, fds)
                while True:
                    reply, out, got, pid = protocol.recv_msg_creds(self._sock)
                    for fd in got:
                        socket.close(fd)
                    if reply.get("ev") in ("child", "kernel"):
                        if on_child is not None:
                            on_child(reply, pid)
                        continue
                    if "ev" in reply:
                        if on_event is not None:
                            on_event(reply["ev"], out)
                        continue
                    break
            except TimeoutError as e:
                self.close()
                raise errors.SandboxTimeoutError(
                    f"sandbox {self.sandbox_id} did not answer {obj.get('op')!r} in time; connection closed"
                ) from e
            except (protocol.ConnectionClosed, ConnectionError, OSError) as e:
                self.close()
                raise errors.SandboxGoneError(
                    f"sandbox {self.sandbox_id} is gone (destroyed, expired or killed, e.g. by OOM): {e}"
                ) from e
        if not reply.get("ok"):
            raise errors.from_reply(reply)
        return reply, out

    def send(self, obj: dict, *, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send one frame that gets no reply (the `move` that follows a fork's answer)."""
        with self._lock:
            try:
                protocol.send_msg(self._sock, obj, b"", fds)
            except OSError as e:
                self.close()
                raise errors.SandboxGoneError(f"sandbox {self.sandbox_id} is gone: {e}") from e

    def close(self) -> None:
        self._sock.close()
