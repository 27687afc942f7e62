"""A small HTTP/1.1 server on the stdlib: keep-alive, chunked request bodies, streamed chunked responses.

One thread per connection (`ThreadingHTTPServer`); a slow client blocks only its own thread, and a streamed
response is written as it is produced, so a slow reader slows its producer (backpressure) and nothing is
buffered without bound. Every failure becomes a JSON error; no traceback ever reaches a client.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

MAX_BODY = 64 << 20
"""Largest request body read into memory (file uploads included), in bytes."""
MAX_JSON_BODY = 4 << 20
"""Largest JSON request body (control plane and RPC), in bytes."""
MAX_HELD = 64 << 10
"""Bytes of a streamed response held back to coalesce writes."""
MAX_DRAIN = 256 << 20
"""Oversized bodies up to this size are read and dropped before the 413; larger ones close the connection."""
MAX_HEADER_LINE = 65536
"""Longest request line or header line, in bytes (the stdlib's limit)."""
MAX_HEADERS = 100
"""Most header lines in one request (the stdlib's limit)."""


class Headers:
    """Request headers: case-insensitive `get` (first value wins, as `email.message.Message`), `items`.

    The stdlib builds an `email.message.Message` per request through the email parser; on the dev VM that
    and its linear, case-folding `get` were about a quarter of the server's CPU per ``commands.run``.
    """

    __slots__ = ("_items", "_first")

    def __init__(self, items: list[tuple[str, str]]):
        self._items = items
        self._first: dict[str, str] = {}
        for name, value in items:
            self._first.setdefault(name.lower(), value)

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._first.get(name.lower(), default)

    def __getitem__(self, name: str) -> str | None:
        return self._first.get(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._first

    def get_all(self, name: str, failobj: list[str] | None = None) -> list[str] | None:
        key = name.lower()
        found = [v for k, v in self._items if k.lower() == key]
        return found or failobj

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)

    def keys(self) -> list[str]:
        return [k for k, _ in self._items]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._items)


def read_headers(rfile) -> Headers:
    """Header lines up to the blank line (obsolete line folding joins a continuation to the previous value).

    Raises:
        HTTPError: 431 for a line over `MAX_HEADER_LINE` bytes or more than `MAX_HEADERS` lines, 400 for a
            line without a colon or a connection that ends inside the head.
    """
    items: list[tuple[str, str]] = []
    while True:
        line = rfile.readline(MAX_HEADER_LINE + 1)
        if len(line) > MAX_HEADER_LINE:
            raise HTTPError(431, "header line too long")
        if line in (b"\r\n", b"\n"):
            return Headers(items)
        if not line:
            raise HTTPError(400, "connection closed inside the request head")
        if len(items) >= MAX_HEADERS:
            raise HTTPError(431, f"more than {MAX_HEADERS} header lines")
        text = line.decode("iso-8859-1").rstrip("\r\n")
        if text[0] in " \t" and items:
            name, value = items[-1]
            items[-1] = (name, f"{value} {text.strip()}")
            continue
        name, colon, value = text.partition(":")
        if not colon or not name or name != name.strip():
            raise HTTPError(400, f"malformed header line {text[:100]!r}")
        items.append((name, value.strip()))


class HTTPError(Exception):
    """An error answered as ``{"code": status, "message": ...}`` (E2B's error shape)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Handler(BaseHTTPRequestHandler):
    """Reads one request, hands it to ``server.app.handle(self)``, keeps the connection for the next."""

    protocol_version = "HTTP/1.1"
    server_version = "agentenv"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s " + format, self.address_string(), *args)

    _date: tuple[int, str] = (0, "")

    def date_time_string(self, timestamp: float | None = None) -> str:
        """The ``Date`` header, formatted once per second (formatting it was ~8% of the server's CPU)."""
        if timestamp is not None:
            return formatdate(timestamp, usegmt=True)
        now = int(time.time())
        cached = Handler._date
        if cached[0] != now:
            cached = Handler._date = (now, formatdate(now, usegmt=True))
        return cached[1]

    def parse_request(self) -> bool:
        """The request line and headers (as the stdlib's, with `read_headers` for the email parser)."""
        self.command = None
        self.request_version = version = self.default_request_version
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        try:
            if len(words) != 3:
                raise HTTPError(400, f"bad request line {self.requestline[:100]!r}")
            command, path, version = words
            if version not in ("HTTP/1.0", "HTTP/1.1"):
                raise HTTPError(505, f"HTTP version {version[:20]!r} is not served (HTTP/1.1 is)")
            self.command, self.path, self.request_version = command, path, version
            if self.path.startswith("//"):  # as the stdlib (gh-87389): never read as a scheme-less absolute URI
                self.path = "/" + self.path.lstrip("/")
            self.headers = read_headers(self.rfile)
        except HTTPError as e:
            if words:
                self.request_version = "HTTP/1.0"  # we serve no HTTP/0.9: the answer carries a status line
                self.started = False
                self._fail(e.status, e.message)
            return False
        conntype = self.headers.get("Connection", "").lower()
        self.close_connection = version == "HTTP/1.0" and conntype != "keep-alive" or conntype == "close"
        if self.headers.get("Expect", "").lower() == "100-continue" and version == "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        self.route = url.path
        self.query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        self._body: bytes | None = None
        self.started = False
        try:
            self.server.app.handle(self)
        except HTTPError as e:
            self._fail(e.status, e.message)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception:
            log.exception("unhandled error in %s %s", self.command, self.route)
            self._fail(500, "internal server error (logged on the server)")
        if self._body is None and not self.close_connection:
            self._drain()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _dispatch

    def _fail(self, status: int, message: str) -> None:
        if self.started:  # too late for a status line: cut the connection so the client sees the failure
            self.close_connection = True
            return
        try:
            self.send_json(status, {"code": status, "message": message})
        except OSError:
            self.close_connection = True

    # ---- request body ------------------------------------------------------------------------------------
    def body(self, limit: int = MAX_BODY) -> bytes:
        """The whole request body (Content-Length or chunked), at most `limit` bytes, else 413."""
        if self._body is not None:
            return self._body
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = b"".join(self.iter_body(limit))
            self._body = data
            return data
        length = self._content_length()
        if length > limit:
            if length <= MAX_DRAIN:  # read and drop it, so the client gets the 413 instead of a broken pipe
                left = length
                while left > 0:
                    got = self.rfile.read(min(left, 1 << 20))
                    if not got:
                        break
                    left -= len(got)
                self._body = b""
            else:
                self.close_connection = True  # the unread body would be taken for the next request
            raise HTTPError(413, f"request body of {length} bytes exceeds {limit} bytes")
        self._body = self.rfile.read(length) if length else b""
        return self._body

    def iter_body(self, limit: int = MAX_BODY):
        """The request body piece by piece as it arrives (for client streams); at most `limit` bytes."""
        if self._body is not None:
            yield self._body
            return
        self._body = b""  # consumed here, nothing left to drain
        total = 0
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(1024)
                try:
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                except ValueError as e:
                    self.close_connection = True
                    raise HTTPError(400, "malformed chunked request body") from e
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                total += size
                if total > limit:
                    self.close_connection = True
                    raise HTTPError(413, f"request body exceeds {limit} bytes")
                data = self.rfile.read(size)
                self.rfile.readline(1024)
                yield data
        else:
            left = self._content_length()
            if left > limit:
                self.close_connection = True
                raise HTTPError(413, f"request body of {left} bytes exceeds {limit} bytes")
            while left > 0:
                data = self.rfile.read1(min(left, 65536))
                if not data:
                    self.close_connection = True
                    return
                left -= len(data)
                yield data

    def _content_length(self) -> int:
        """The Content-Length header as a byte count (absent: 0); 400 unless it is one non-negative integer."""
        raw = self.headers.get("Content-Length") or "0"
        if not raw.strip().isdigit():
            self.close_connection = True  # where the body ends is unknown
            raise HTTPError(400, f"Content-Length must be a non-negative integer, got {raw[:40]!r}")
        return int(raw)

    def _drain(self) -> None:
        try:
            self.body()
        except HTTPError:
            self.close_connection = True

    def json_body(self) -> dict:
        """The body as a JSON object (empty body: ``{}``); 400 on bad JSON, 413 when too large."""
        raw = self.body(MAX_JSON_BODY)
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HTTPError(400, f"request body is not valid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return obj

    # ---- responses ---------------------------------------------------------------------------------------
    def send_bytes(self, status: int, data: bytes, content_type: str = "application/octet-stream",
                   headers: dict[str, str] | None = None) -> None:
        self.started = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self._headers_buffer.append(b"\r\n")
        if data and self.command != "HEAD" and len(data) <= MAX_HELD:  # head and a small body in one write
            self._headers_buffer.append(data)
            data = b""
        self.flush_headers()
        if data and self.command != "HEAD":
            self.wfile.write(data)

    def send_file(self, status: int, fd: int, size: int, content_type: str = "application/octet-stream") -> None:
        """`size` bytes of the open file `fd` from offset 0, with sendfile(2) (no copy through Python)."""
        self.started = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        self.wfile.flush()
        if self.command == "HEAD":
            return
        offset = 0
        while offset < size:
            sent = os.sendfile(self.connection.fileno(), fd, offset, size - offset)
            if sent == 0:  # the file shrank under us: the length is promised, so the connection must end
                self.close_connection = True
                raise ConnectionError(f"file ended at {offset} of {size} bytes")
            offset += sent

    def send_json(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(obj, separators=(",", ":")).encode(), "application/json", headers)

    def send_empty(self, status: int = 204) -> None:
        self.started = True
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def start_chunked(self, status: int, content_type: str, *, hold: bool = False) -> None:
        """Begin a streamed response; follow with `write_chunk` calls and one `end_chunked`.

        `hold` keeps the head in memory until the first chunk, so both leave in one write.
        """
        self.started = True
        self._pending = b""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        if hold:
            self._headers_buffer.append(b"\r\n")
            self._pending = b"".join(self._headers_buffer)
            self._headers_buffer = []
        else:
            self.end_headers()
            self.wfile.flush()

    def write_chunk(self, data: bytes, *, hold: bool = False) -> None:
        """Send one chunk; with `hold`, keep it to leave with the next write (fewer syscalls, same order).

        At most `MAX_HELD` bytes are held, so a stream that always has more to send still flows (and a slow
        reader still blocks the writer: backpressure).
        """
        if not data:
            return
        piece = self._pending + b"%x\r\n%b\r\n" % (len(data), data)
        if hold and len(piece) < MAX_HELD:
            self._pending = piece
            return
        self._pending = b""
        self.wfile.write(piece)
        self.wfile.flush()

    def end_chunked(self) -> None:
        self.wfile.write(self._pending + b"0\r\n\r\n")
        self._pending = b""
        self.wfile.flush()


class HTTPServer(ThreadingHTTPServer):
    """A threaded server bound to `app` (anything with ``handle(handler)``)."""

    daemon_threads = True
    request_queue_size = 1024
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], app):
        self.app = app
        super().__init__(address, Handler)
