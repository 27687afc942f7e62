"""Malformed requests found by hand and by fuzzing: each gets a 4xx JSON error naming the field, never a 500."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest

from tests.agentenv.server.test_auth_errors import call, key_headers


def raw_request(server, request: bytes) -> tuple[int, dict]:
    """Send `request` as is on a fresh connection; the status and JSON body of the answer."""
    u = urlsplit(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("template", ["../../etc", "/etc", "a/b", "..", "x" * 300, "seed-host\x00"])
def test_bad_template_id_is_a_4xx_naming_the_field(server, template):
    status, body = call(server, "POST", "/sandboxes", {"templateID": template}, key_headers(server))
    assert 400 <= status < 500, body
    assert "templateID" in body["message"] and "Traceback" not in body["message"]


def test_negative_content_length_is_a_400(server):
    key = server.api_key.encode()
    status, body = raw_request(server, b"POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: " + key +
                               b"\r\nContent-Type: application/json\r\nContent-Length: -5\r\n\r\n{}")
    assert status == 400, body
    assert "Content-Length" in body["message"]


def test_plain_json_process_start_is_a_4xx_naming_content_type(server, e2b_sandbox):
    u = urlsplit(server.url)
    import http.client

    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/process.Process/Start", json.dumps({"process": {"cmd": "/bin/true"}}).encode(),
                 {"Content-Type": "application/json", "E2b-Sandbox-Id": e2b_sandbox.sandbox_id,
                  "X-Access-Token": e2b_sandbox._envd_access_token or "", "X-API-Key": server.api_key})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert 400 <= resp.status < 500, body
    assert "Content-Type" in body["message"]
    assert e2b_sandbox.commands.run("echo alive").stdout == "alive\n"


@pytest.mark.parametrize("body", [
    {"action": {"type": "bash", "command": "true"}, "timeout": 0.0},
    {"action": {"type": "bash", "command": "true"}, "timeout": -1e16},
    {"action": {"type": "bash", "command": "true"}, "timeout": "5"},
    {"action": {"type": "bash", "command": True}},
    {"action": {"type": "python", "code": None}},
    {"action": {"type": "bash", "command": "true"}, "reward_cmd": ["echo", "1"]},
], ids=["timeout-0", "timeout-negative", "timeout-str", "command-bool", "code-null", "reward-list"])
def test_bad_step_is_a_400_naming_the_field(server, e2b_sandbox, body):
    sid = e2b_sandbox.sandbox_id
    status, answer = call(server, "POST", f"/agentenv/v1/sandboxes/{sid}/step", body, key_headers(server))
    assert status == 400, answer
    assert any(name in answer["message"] for name in ("timeout", "command", "code", "reward_cmd")), answer
