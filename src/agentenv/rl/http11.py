"""A minimal keep-alive HTTP/1.1 client connection for `agentenv.rl.remote.RemoteProvider`.

Why not `http.client`: every RL step is one small JSON request, and `http.client` builds the request from
per-header calls and parses each response head with the email parser. On the 2-core dev VM that was about a
third of the client's CPU per step (py-spy, 256 environments through the server). This connection sends the
head and body in one write and reads a response head into a dict.

It speaks only what the AgentEnv server answers: a status line, headers, and a body framed by
``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the connection.

Example::

    conn = Connection("127.0.0.1", 3000, timeout_s=60)
    status, headers, body = conn.request("GET", "/health", None, {"X-API-Key": key})
    conn.close()
"""

from __future__ import annotations

import socket

MAX_HEAD_LINE = 65536
"""Longest status or header line accepted, in bytes."""
MAX_HEAD_LINES = 100
"""Most header lines accepted in one response."""


class ProtocolError(ConnectionError):
    """The server's answer is not HTTP/1.x as this client reads it (the connection is unusable after it)."""


class Connection:
    """One TCP connection to `host`:`port`, reused for requests until either side closes it.

    Args:
        host, port: the server.
        timeout_s: socket timeout of connect and of each read or write, in seconds (`request` may change it).
    """

    def __init__(self, host: str, port: int, *, timeout_s: float):
        self.host, self.port = host, port
        self._host_header = f"Host: {host}:{port}\r\n".encode("latin-1")
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rfile = self._sock.makefile("rb")
        self.will_close = False
        """True once the server said it closes this connection after the last response."""

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str], *,
                timeout_s: float | None = None) -> tuple[int, dict[str, str], bytes]:
        """Send one request and read its whole response.

        Args:
            method, path: request line (`path` already percent-encoded).
            body: request body (None: none, no Content-Length sent).
            headers: extra request headers.
            timeout_s: socket timeout for this request, in seconds (None: keep the current one).

        Returns:
            ``(status, headers, body)``; header names are lower-case.

        Raises:
            ProtocolError: a malformed or truncated response.
            OSError: the connection failed (including `TimeoutError`).
        """
        if timeout_s is not None:
            self._sock.settimeout(timeout_s)
        head = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), self._host_header]
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
        if body is not None:
            head.append(b"Content-Length: %d\r\n" % len(body))
        head.append(b"\r\n")
        if body:
            head.append(body)
        self._sock.sendall(b"".join(head))
        return self._response(method)

    def _line(self) -> bytes:
        line = self._rfile.readline(MAX_HEAD_LINE + 1)
        if not line:
            raise ProtocolError(f"server {self.host}:{self.port} closed the connection before its answer")
        if len(line) > MAX_HEAD_LINE:
            raise ProtocolError("response line too long")
        return line

    def _response(self, method: str) -> tuple[int, dict[str, str], bytes]:
        status_line = self._line().decode("latin-1").split(None, 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") or not status_line[1].isdigit():
            raise ProtocolError(f"malformed status line {' '.join(status_line)[:100]!r}")
        version, status = status_line[0], int(status_line[1])
        headers: dict[str, str] = {}
        for _ in range(MAX_HEAD_LINES + 1):
            line = self._line()
            if line in (b"\r\n", b"\n"):
                break
            name, colon, value = line.decode("latin-1").partition(":")
            if not colon:
                raise ProtocolError(f"malformed header line {line[:100]!r}")
            headers.setdefault(name.strip().lower(), value.strip())
        else:
            raise ProtocolError(f"more than {MAX_HEAD_LINES} header lines")
        connection = headers.get("connection", "").lower()
        self.will_close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, headers, b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return status, headers, self._chunked()
        if "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError as e:
                raise ProtocolError(f"bad Content-Length {headers['content-length']!r}") from e
            body = self._rfile.read(length)
            if len(body) != length:
                raise ProtocolError(f"response body cut at {len(body)} of {length} bytes")
            return status, headers, body
        self.will_close = True  # framed by the end of the connection
        return status, headers, self._rfile.read()

    def _chunked(self) -> bytes:
        parts = []
        while True:
            try:
                size = int(self._line().split(b";")[0].strip(), 16)
            except ValueError as e:
                raise ProtocolError("malformed chunk size") from e
            if size == 0:
                while self._line() not in (b"\r\n", b"\n"):  # trailers
                    pass
                return b"".join(parts)
            data = self._rfile.read(size + 2)
            if len(data) != size + 2:
                raise ProtocolError("response chunk cut short")
            parts.append(data[:size])

    def close(self) -> None:
        self._rfile.close()
        self._sock.close()
