"""Auth, quotas and malformed requests: E2B-shaped errors (``{"code", "message"}``), never a traceback."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from urllib.parse import urlsplit

import pytest


def call(server, method, path, body=None, headers=None, raw=None):
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, (json.loads(payload) if payload else None)


def key_headers(server):
    return {"X-API-Key": server.api_key}


def assert_e2b_error(status, body, expected):
    assert status == expected, body
    assert set(body) == {"code", "message"} and body["code"] == expected and body["message"]
    assert "Traceback" not in body["message"]


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "e2b_wrong"}, {"Authorization": "Bearer nope"}],
                         ids=["missing", "unknown", "bad-bearer"])
def test_control_plane_needs_a_valid_key(server, headers):
    assert_e2b_error(*call(server, "GET", "/v2/sandboxes", headers=headers), 401)


def test_revoked_key_is_refused(server):
    out = subprocess.run([sys.executable, "-m", "agentenv.server", "keys", "--state-dir", str(server.state_dir),
                          "create", "short-lived"], capture_output=True, text=True, check=True)
    key = json.loads(out.stdout)["api_key"]
    assert call(server, "GET", "/sandboxes", headers={"X-API-Key": key})[0] == 200
    subprocess.run([sys.executable, "-m", "agentenv.server", "keys", "--state-dir", str(server.state_dir),
                    "revoke", key], capture_output=True, check=True)
    assert_e2b_error(*call(server, "GET", "/sandboxes", headers={"X-API-Key": key}), 401)


def test_other_keys_sandbox_is_forbidden(server, e2b_sandbox):
    out = subprocess.run([sys.executable, "-m", "agentenv.server", "keys", "--state-dir", str(server.state_dir),
                          "create", "intruder"], capture_output=True, text=True, check=True)
    other = {"X-API-Key": json.loads(out.stdout)["api_key"]}
    sid = e2b_sandbox.sandbox_id
    assert_e2b_error(*call(server, "DELETE", f"/sandboxes/{sid}", headers=other), 403)
    assert_e2b_error(*call(server, "GET", f"/sandboxes/{sid}", headers=other), 403)
    assert sid not in [s["sandboxID"] for s in call(server, "GET", "/sandboxes", headers=other)[1]]


def test_wrong_access_token_for_sandbox_traffic(server, e2b_sandbox):
    base = {"E2b-Sandbox-Id": e2b_sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    assert_e2b_error(*call(server, "GET", "/files?path=/etc/hostname", headers=base), 401)
    assert_e2b_error(*call(server, "GET", "/files?path=/etc/hostname",
                           headers={**base, "X-Access-Token": "forged"}), 403)


def test_unknown_sandbox_is_404_on_the_control_plane(server):
    assert_e2b_error(*call(server, "GET", "/sandboxes/sb-000000000000", headers=key_headers(server)), 404)
    assert_e2b_error(*call(server, "POST", "/sandboxes/sb-000000000000/pause", {}, key_headers(server)), 404)


def test_pause_twice_is_409(server, e2b_sandbox):
    path = f"/sandboxes/{e2b_sandbox.sandbox_id}/pause"
    assert call(server, "POST", path, {}, key_headers(server))[0] == 204
    assert_e2b_error(*call(server, "POST", path, {}, key_headers(server)), 409)
    assert call(server, "POST", f"/sandboxes/{e2b_sandbox.sandbox_id}/resume", {}, key_headers(server))[0] == 201


def test_quota_of_live_sandboxes_is_429(server):
    out = subprocess.run([sys.executable, "-m", "agentenv.server", "keys", "--state-dir", str(server.state_dir),
                          "create", "tiny", "--max-sandboxes", "1"], capture_output=True, text=True, check=True)
    headers = {"X-API-Key": json.loads(out.stdout)["api_key"]}
    status, first = call(server, "POST", "/v2/sandboxes", {"templateID": "base"}, headers)
    assert status == 201
    try:
        assert_e2b_error(*call(server, "POST", "/v2/sandboxes", {"templateID": "base"}, headers), 429)
    finally:
        assert call(server, "DELETE", f"/sandboxes/{first['sandboxID']}", headers=headers)[0] == 204
    status, second = call(server, "POST", "/v2/sandboxes", {"templateID": "base"}, headers)
    assert status == 201
    call(server, "DELETE", f"/sandboxes/{second['sandboxID']}", headers=headers)


@pytest.mark.parametrize("raw,expected", [
    (b"{not json", 400), (b"[1, 2]", 400), (b'{"templateID": "base", "timeout": -5}', 400),
    (b'{"templateID": "base", "metadata": {"a": 1}}', 400), (b'{"templateID": 7}', 400),
], ids=["bad-json", "not-object", "negative-timeout", "metadata-types", "template-type"])
def test_bad_create_bodies_are_400(server, raw, expected):
    assert_e2b_error(*call(server, "POST", "/v2/sandboxes", headers=key_headers(server), raw=raw), expected)


def test_oversized_body_is_413(server):
    raw = b'{"templateID": "' + b"x" * (5 << 20) + b'"}'
    assert_e2b_error(*call(server, "POST", "/v2/sandboxes", headers=key_headers(server), raw=raw), 413)


def test_unknown_route_is_404_and_bad_method_405(server):
    assert_e2b_error(*call(server, "GET", "/nope", headers=key_headers(server)), 404)
    assert_e2b_error(*call(server, "PUT", "/v2/sandboxes", headers=key_headers(server), raw=b"{}"), 405)


def test_connect_rpc_errors_use_connect_codes(server, e2b_sandbox):
    headers = {"E2b-Sandbox-Id": e2b_sandbox.sandbox_id, "X-Access-Token": e2b_sandbox._envd_access_token}
    status, body = call(server, "POST", "/filesystem.Filesystem/Stat", {"path": "/nope"}, headers)
    assert status == 404 and body["code"] == "not_found"
    status, body = call(server, "POST", "/filesystem.Filesystem/Stat", headers=headers, raw=b"{oops")
    assert status == 400 and body["code"] == "invalid_argument"
    status, body = call(server, "POST", "/process.Process/Update", {}, headers)  # a resize without a size
    assert status == 400 and body["code"] == "invalid_argument"
    status, body = call(server, "POST", "/process.Process/Rename", {}, headers)
    assert status == 501 and body["code"] == "unimplemented"


def test_sdk_maps_auth_failure(e2b_env):
    from e2b import AuthenticationException, Sandbox

    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_not_a_key")


def test_concurrent_creates_cannot_overrun_the_quota(server):
    from concurrent.futures import ThreadPoolExecutor

    out = subprocess.run([sys.executable, "-m", "agentenv.server", "keys", "--state-dir", str(server.state_dir),
                          "create", "racer", "--max-sandboxes", "2"], capture_output=True, text=True, check=True)
    headers = {"X-API-Key": json.loads(out.stdout)["api_key"]}
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: call(server, "POST", "/v2/sandboxes", {"templateID": "base"}, headers),
                                range(6)))
    made = [body["sandboxID"] for status, body in results if status == 201]
    try:
        assert len(made) == 2
        assert sorted(status for status, _ in results) == [201, 201, 429, 429, 429, 429]
    finally:
        for sid in made:
            call(server, "DELETE", f"/sandboxes/{sid}", headers=headers)


def test_chunked_request_body_is_read(server):
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    pieces = iter([b'{"templateID": ', b'"base", "timeout": 30}'])
    conn.request("POST", "/v2/sandboxes", pieces, {"X-API-Key": server.api_key, "Content-Type": "application/json",
                                                    "Transfer-Encoding": "chunked"}, encode_chunked=True)
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 201, body
    conn.request("DELETE", f"/sandboxes/{body['sandboxID']}", headers={"X-API-Key": server.api_key})
    assert conn.getresponse().status == 204  # the same kept-alive connection still works
    conn.close()
