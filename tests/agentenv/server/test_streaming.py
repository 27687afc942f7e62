"""Streaming under stress: a slow reader gets backpressure (bounded buffers), a vanished reader leaks nothing."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

from agentenv.server import connect


def _rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _start_stream(server, sandbox, cmd: str) -> socket.socket:
    u = urlsplit(server.url)
    sock = socket.create_connection((u.hostname, u.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = connect.envelope({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}})
    head = (f"POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\n"
            f"E2b-Sandbox-Id: {sandbox.sandbox_id}\r\nX-Access-Token: {sandbox._envd_access_token}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def _running(sandbox) -> list[int]:
    return [p.pid for p in sandbox.commands.list()]


def test_slow_reader_backpressures_the_process(server, e2b_sandbox):
    rss_before = _rss_kb(server.proc.pid)
    sock = _start_stream(server, e2b_sandbox, "head -c 300000000 /dev/zero")  # 300 MB of output
    try:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # unread, the stream stalls: the process must block, not be buffered into memory
        assert len(_running(e2b_sandbox)) == 1
        assert _rss_kb(server.proc.pid) - rss_before < 64 * 1024
    finally:
        sock.close()
    deadline = time.monotonic() + 30  # the reader left: output is dropped, so the process runs to its end
    while _running(e2b_sandbox) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(e2b_sandbox) == []


def test_reader_that_disconnects_mid_stream_frees_the_stream(server, e2b_sandbox):
    sock = _start_stream(server, e2b_sandbox, "echo first; sleep 0.5; echo second")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    time.sleep(1.0)
    assert _running(e2b_sandbox) == []  # it finished on its own; nothing waits for the vanished reader
    assert e2b_sandbox.commands.run("echo next").stdout == "next\n"


def test_stream_error_arrives_in_end_stream_envelope(server, e2b_sandbox):
    u = urlsplit(server.url)
    sock = socket.create_connection((u.hostname, u.port))
    body = connect.envelope({"process": {"pid": 999999}})
    sock.sendall((f"POST /process.Process/Connect HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\n"
                  f"E2b-Sandbox-Id: {e2b_sandbox.sandbox_id}\r\nX-Access-Token: {e2b_sandbox._envd_access_token}"
                  f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    size_line, _, payload = rest.partition(b"\r\n")
    envelope = payload[: int(size_line, 16)]
    flags, n = connect.ENVELOPE.unpack_from(envelope)
    assert flags == connect.FLAG_END_STREAM
    assert json.loads(envelope[connect.ENVELOPE.size:])["error"]["code"] == "not_found"


def test_idle_stream_sends_keepalives(monkeypatch, tmp_path):
    """A process that prints nothing for longer than the keep-alive interval still shows signs of life."""
    from e2b import Sandbox

    from agentenv.runtime.local import NamespaceBackend
    from agentenv.server import Server, envd

    monkeypatch.setattr(envd, "KEEPALIVE_S", 0.2)
    home = tmp_path / "home"
    server = Server(port=0, state_dir=tmp_path / "state", home=home).start()  # in-process: the patch applies
    try:
        key, _ = server.keys.create("keepalive")
        sb = Sandbox.create(api_key=key, api_url=server.url, sandbox_url=server.url)
        sock = _start_stream(server, sb, "sleep 1.2; echo done")
        data = b""
        while b"\r\n0\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        sock.close()
        assert data.count(b'"keepalive"') >= 3
        assert b"ZG9uZQo=" in data  # base64 of "done\n", after the keep-alives
    finally:
        server.stop(kill_all=True)
        NamespaceBackend(home).gc(everything=True)
