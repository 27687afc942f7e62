"""The wire protocol between the host runtime and the in-sandbox tool server, and the result types.

Stdlib only: the tool server imports this module before it pivots into the sandbox root.

A frame is a 12-byte header (`!IQ`: JSON length, blob length), a UTF-8 JSON object, then an optional binary
blob (file contents, stdin, output chunks). File descriptors ride along with the header as SCM_RIGHTS
(layer directories and listening sockets on fork). Requests carry `op`; replies carry `ok` and, on failure,
`error` (one of `ERROR_KINDS`) and `message`. A streamed exec sends `{"ev": "out"|"err"}` frames with the
chunk as blob before its final reply.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from dataclasses import asdict, dataclass, field

HEADER = struct.Struct("!IQ")
MAX_FDS = 250
MAX_JSON = 64 << 20

ERROR_KINDS = ("not_found", "invalid", "timeout", "exists", "permission", "is_directory", "internal", "command")
"""Failure kinds a reply may carry; the SDK maps each to one exception class."""


class ConnectionClosed(EOFError):
    """The peer closed the connection (for a tool server: the sandbox is gone)."""


def send_msg(sock: socket.socket, obj: dict, blob: bytes = b"", fds: list[int] | tuple[int, ...] = (),
             creds_pid: int | None = None) -> None:
    """Send one frame: header (+ `fds`, or + SCM_CREDENTIALS naming `creds_pid`), JSON `obj`, then `blob`.

    The kernel checks `creds_pid` (our own, or any pid of a pid namespace we administer) and translates it
    into the receiver's pid namespace; the receiver needs SO_PASSCRED.
    """
    body = json.dumps(obj, separators=(",", ":")).encode()
    head = HEADER.pack(len(body), len(blob))
    if creds_pid is not None:
        creds = struct.pack("3i", creds_pid, os.getuid(), os.getgid())
        sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
        sock.sendall(body)
    elif fds:
        if len(fds) > MAX_FDS:
            raise ValueError(f"fds: at most {MAX_FDS} descriptors per frame, got {len(fds)}")
        socket.send_fds(sock, [head], list(fds))
        sock.sendall(body)
    else:
        sock.sendall(head + body)
    if blob:
        sock.sendall(blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionClosed(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> tuple[dict, bytes, list[int]]:
    """Receive one frame.

    Returns:
        `(obj, blob, fds)`; the caller owns (and must close) the received `fds`.
    """
    obj, blob, fds, _ = recv_msg_creds(sock)
    return obj, blob, fds


_CREDS = struct.Struct("3i")


def recv_msg_creds(sock: socket.socket) -> tuple[dict, bytes, list[int], int | None]:
    """`recv_msg` that also returns the pid of an SCM_CREDENTIALS message (None without one)."""
    space = socket.CMSG_SPACE(MAX_FDS * 4) + socket.CMSG_SPACE(_CREDS.size)
    data, ancdata, _flags, _addr = sock.recvmsg(HEADER.size, space)
    fds: list[int] = []
    pid = None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds += list(struct.unpack(f"{usable // 4}i", payload[:usable]))
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = _CREDS.unpack(payload[: _CREDS.size])[0]
    try:
        if not data:
            raise ConnectionClosed("connection closed")
        if len(data) < HEADER.size:
            data += _recv_exact(sock, HEADER.size - len(data))
        json_len, blob_len = HEADER.unpack(data)
        if json_len > MAX_JSON:
            raise ValueError(f"frame JSON of {json_len} bytes exceeds {MAX_JSON}")
        obj = json.loads(_recv_exact(sock, json_len)) if json_len else {}
        blob = _recv_exact(sock, blob_len) if blob_len else b""
    except BaseException:
        # a frame that never arrives whole (its sender died mid-send) must not keep the descriptors it carried
        for fd in fds:
            os.close(fd)
        raise
    return obj, blob, fds, pid


@dataclass
class CommandResult:
    """Outcome of a finished command (`Sandbox.exec`, `Sandbox.shell.run`)."""

    exit_code: int
    """Exit status; a command killed by signal N reports 128 + N."""
    stdout: str
    """Captured standard output (decoded as UTF-8, invalid bytes replaced)."""
    stderr: str
    """Captured standard error."""
    duration_ms: float = 0.0
    """Wall time inside the sandbox, in milliseconds."""
    truncated: bool = False
    """True when output beyond `max_output` bytes was dropped."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class PythonResult:
    """Outcome of code run in the persistent interpreter (`Sandbox.python.run`)."""

    stdout: str
    stderr: str
    value: str | None = None
    """`repr` of the last expression, if the code ended with one."""
    error: str | None = None
    """Exception type name when the code raised (traceback in `traceback`)."""
    traceback: str = ""


@dataclass
class EntryInfo:
    """One directory entry inside a sandbox (`Sandbox.files.list`)."""

    name: str
    path: str
    type: str
    """``file``, ``dir``, ``symlink`` or ``other``."""
    size: int
    mode: int


@dataclass
class SandboxInfo:
    """What the runtime records about a sandbox or snapshot (`agentenv ls`)."""

    id: str
    kind: str
    """``sandbox``, ``snapshot``, ``seed`` (per-image zygote) or ``retired`` (kept for its forks)."""
    image: str
    pid: int
    parent: str | None
    created: float
    expires_at: float | None
    layers: list[str] = field(default_factory=list)
    alive: bool = True

    def to_dict(self) -> dict:
        return asdict(self)
