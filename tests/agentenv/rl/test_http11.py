"""The RL layer's keep-alive HTTP/1.1 connection against the server's real HTTP layer and a raw socket."""

from __future__ import annotations

import socket
import threading

import pytest

from agentenv.rl.http11 import Connection, ProtocolError
from agentenv.server.httpd import HTTPServer


class App:
    """Answers by route: JSON with Content-Length, a chunked stream, 204, or a close."""

    def handle(self, h) -> None:
        if h.route == "/json":
            h.send_json(200, {"echo": h.body().decode(), "key": h.headers.get("x-api-key")})
        elif h.route == "/stream":
            h.start_chunked(200, "text/plain")
            for part in (b"ab", b"", b"cde"):
                h.write_chunk(part)
            h.end_chunked()
        elif h.route == "/empty":
            h.send_empty(204)
        elif h.route == "/close":
            h.close_connection = True
            h.send_json(404, {"code": 404, "message": "gone"}, {"Connection": "close"})


@pytest.fixture
def port():
    server = HTTPServer(("127.0.0.1", 0), App())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_requests_reuse_one_connection(port):
    conn = Connection("127.0.0.1", port, timeout_s=10)
    try:
        for i in range(3):
            status, headers, body = conn.request("POST", "/json", b"x%d" % i, {"X-API-Key": "k"})
            assert status == 200 and headers["content-type"] == "application/json"
            assert body == b'{"echo":"x%d","key":"k"}' % i and not conn.will_close
        assert conn.request("GET", "/stream", None, {})[2] == b"abcde"
        status, _, body = conn.request("DELETE", "/empty", None, {})
        assert (status, body) == (204, b"")
        status, _, body = conn.request("GET", "/close", None, {})
        assert status == 404 and b"gone" in body and conn.will_close
    finally:
        conn.close()


@pytest.mark.parametrize("answer", [
    b"garbage\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
    b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"",
], ids=["status-line", "cut-body", "header-line", "chunk-size", "closed"])
def test_malformed_answers_raise_protocol_error(answer):
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        sock, _ = listener.accept()
        sock.recv(65536)
        sock.sendall(answer)
        sock.close()

    threading.Thread(target=serve, daemon=True).start()
    conn = Connection("127.0.0.1", listener.getsockname()[1], timeout_s=10)
    try:
        with pytest.raises(ProtocolError):
            conn.request("GET", "/", None, {})
    finally:
        conn.close()
        listener.close()
