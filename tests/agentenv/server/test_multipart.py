"""Multipart uploads to ``/files`` in the shapes a client may send (one part, several, an epilogue, no final
CRLF, a ``path`` parameter), each large enough that the parser's scan runs over real file data; and a client
that leaves mid-upload."""

from __future__ import annotations

import http.client
import os
import socket
import time
from urllib.parse import urlsplit

import pytest

BOUNDARY = "k3b0undary"
BIG = (256 << 10) + 12345  # a quarter MB and an odd remainder


def _part(name: str, data: bytes) -> bytes:
    return (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"


def _headers(sandbox, length: int) -> dict:
    return {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sandbox._envd_access_token, "Content-Length": str(length),
            "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def _post(server, sandbox, body: bytes, query: str = ""):
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/files" + query, body, _headers(sandbox, len(body)))
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def _read(sandbox, path: str) -> bytes:
    return bytes(sandbox.files.read(path, format="bytes"))


# each case: parts (name, size) and the bytes after the closing delimiter
CASES = [
    pytest.param([("one.bin", BIG)], b"\r\n", id="one-part"),
    pytest.param([("a.bin", BIG), ("b.bin", BIG - 7)], b"\r\n", id="two-parts"),
    pytest.param([("big.bin", BIG), ("small.bin", 5)], b"\r\n", id="big-then-small"),
    pytest.param([("epi.bin", BIG)], b"\r\nan epilogue the RFC allows\r\n", id="epilogue"),
    pytest.param([("nocrlf.bin", BIG)], b"", id="no-final-crlf"),
]


@pytest.mark.parametrize("parts, tail", CASES)
def test_multipart_shapes_write_exactly_their_parts(server, e2b_sandbox, parts, tail):
    blobs = {f"/tmp/up/{name}": os.urandom(size) for name, size in parts}
    body = b"".join(_part(path, data) for path, data in blobs.items()) + f"--{BOUNDARY}--".encode() + tail
    status, data = _post(server, e2b_sandbox, body)
    assert status == 200, data
    for path, blob in blobs.items():
        assert _read(e2b_sandbox, path) == blob


def test_path_parameter_names_the_file_and_rejects_several_parts(server, e2b_sandbox):
    blob = os.urandom(BIG)
    body = _part("ignored", blob) + f"--{BOUNDARY}--\r\n".encode()
    assert _post(server, e2b_sandbox, body, "?path=/tmp/up/by-query.bin")[0] == 200
    assert _read(e2b_sandbox, "/tmp/up/by-query.bin") == blob
    two = _part("x", blob) + _part("y", b"y") + f"--{BOUNDARY}--\r\n".encode()
    status, data = _post(server, e2b_sandbox, two, "?path=/tmp/up/two.bin")
    assert status == 400 and b"several" in data


def test_a_directory_target_is_refused_and_the_connection_serves_on(server, e2b_sandbox):
    e2b_sandbox.files.make_dir("/tmp/up/dir")
    body = _part("/tmp/up/dir", os.urandom(BIG)) + f"--{BOUNDARY}--\r\n".encode()
    status, data = _post(server, e2b_sandbox, body)
    assert status == 400 and b"directory" in data
    assert e2b_sandbox.commands.run("echo ok").stdout == "ok\n"


def test_a_client_that_leaves_mid_upload_writes_nothing(server, e2b_sandbox):
    blob = os.urandom(BIG)
    body = _part("/tmp/up/cut.bin", blob) + f"--{BOUNDARY}--\r\n".encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in _headers(e2b_sandbox, len(body)).items())
    u = urlsplit(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(f"POST /files HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body[: len(body) // 2])
        time.sleep(0.2)  # the server is waiting for the rest of the body
    time.sleep(0.3)
    assert not e2b_sandbox.files.exists("/tmp/up/cut.bin")
    e2b_sandbox.files.write("/tmp/up/after.bin", blob)  # the server and the agent still serve
    assert _read(e2b_sandbox, "/tmp/up/after.bin") == blob
