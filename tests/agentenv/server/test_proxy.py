"""``E2b-Sandbox-Port`` other than envd's and the interpreter's: HTTP proxied into the sandbox."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit


def _get(server, sandbox, port, path="/", method="GET", body=None, token=None):
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request(method, path, body, {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(port),
                                      "X-Access-Token": token or sandbox._envd_access_token})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def test_http_server_in_the_sandbox_is_reachable(server, e2b_sandbox):
    e2b_sandbox.files.write("/tmp/www/hello.txt", "hello from inside")
    handle = e2b_sandbox.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www",
                                      background=True)
    try:
        deadline = time.monotonic() + 15
        status, data = 502, b""
        while status == 502 and time.monotonic() < deadline:
            status, data = _get(server, e2b_sandbox, 8000, "/hello.txt")
            time.sleep(0.1)
        assert (status, data) == (200, b"hello from inside")
        assert _get(server, e2b_sandbox, 8000, "/missing")[0] == 404
        assert _get(server, e2b_sandbox, 8000, "/hello.txt", method="HEAD") == (200, b"")
        assert _get(server, e2b_sandbox, 8000, "/hello.txt", token="forged")[0] == 403
    finally:
        handle.kill()


def test_closed_port_is_502_and_bad_port_400(server, e2b_sandbox):
    status, data = _get(server, e2b_sandbox, 8123)
    assert status == 502 and b"nothing accepts connections on port 8123" in data
    assert _get(server, e2b_sandbox, "http")[0] == 400
