"""The HTTP/1.1 layer's own request-head parser (`read_headers`, `Handler.parse_request`), over a real socket."""

from __future__ import annotations

import io
import json
import socket
import threading

import pytest

from agentenv.server.httpd import MAX_HEADERS, HTTPError, HTTPServer, read_headers


class Echo:
    """An app that answers with what it parsed: method, path and three headers."""

    def handle(self, h) -> None:
        h.send_json(200, {"method": h.command, "path": h.route, "id": h.headers.get("e2b-sandbox-id"),
                          "folded": h.headers.get("X-Folded"), "n": len(h.headers), "body": h.body().decode()})


@pytest.fixture
def echo_server():
    server = HTTPServer(("127.0.0.1", 0), Echo())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def exchange(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def test_headers_are_case_insensitive_and_first_value_wins():
    h = read_headers(io.BytesIO(b"Content-Type: a\r\nX-Two: 1\r\nx-two: 2\r\n\r\nbody"))
    assert h.get("content-type") == h["CONTENT-TYPE"] == "a"
    assert h.get("X-TWO") == "1" and h.get_all("x-two") == ["1", "2"]
    assert "x-two" in h and "missing" not in h and h.get("missing", "d") == "d"
    assert h.items() == [("Content-Type", "a"), ("X-Two", "1"), ("x-two", "2")] and len(h) == 3


def test_folded_header_line_joins_the_previous_value():
    h = read_headers(io.BytesIO(b"X-Folded: one\r\n  two\r\n\r\n"))
    assert h.get("x-folded") == "one two"


@pytest.mark.parametrize("raw, status", [
    (b"no colon here\r\n\r\n", 400),
    (b" X-Leading-Space: v\r\n\r\n", 400),
    (b"X-Long: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    (b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n", 431),
    (b"X-Cut: v\r\n", 400),
], ids=["no-colon", "space-before-name", "line-too-long", "too-many", "eof-inside-head"])
def test_malformed_heads_are_refused(raw, status):
    with pytest.raises(HTTPError) as e:
        read_headers(io.BytesIO(raw))
    assert e.value.status == status


def test_request_over_a_socket_keeps_the_connection_alive(echo_server):
    one = b"POST /a HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: sb-1\r\nContent-Length: 2\r\n\r\nhi"
    two = b"GET /b?q=1 HTTP/1.1\r\nHost: x\r\nX-Folded: p\r\n q\r\nConnection: close\r\n\r\n"
    out = exchange(echo_server, one + two)
    assert out.count(b"HTTP/1.1 200") == 2, out
    assert b'"method":"POST","path":"/a","id":"sb-1"' in out and b'"body":"hi"' in out
    assert b'"method":"GET","path":"/b","id":null,"folded":"p q"' in out
    assert b"Date: " in out


@pytest.mark.parametrize("raw, status", [
    (b"GET / HTTP/2.0\r\n\r\n", 505),
    (b"GET /\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nbad header\r\n\r\n", 400),
], ids=["http2", "http09", "bad-header"])
def test_bad_request_heads_get_an_error_status(echo_server, raw, status):
    out = exchange(echo_server, raw)
    assert out.startswith(b"HTTP/1.") and int(out.split()[1]) == status, out[:200]
    body = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert body["code"] == status and body["message"]
