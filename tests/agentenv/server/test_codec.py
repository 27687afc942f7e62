"""Pure-Python pieces: the Connect envelope codec, API keys and quotas, server argument checks."""

from __future__ import annotations

import json

import pytest

from agentenv.server import connect
from agentenv.server.auth import KeyStore, Quota

pytestmark = pytest.mark.no_runtime


def test_envelope_roundtrip_and_end_stream():
    body = connect.envelope({"a": 1}) + connect.envelope({"b": "x"}) + connect.end_stream()
    assert list(connect.iter_envelopes(body)) == [{"a": 1}, {"b": "x"}]
    flags, size = connect.ENVELOPE.unpack_from(connect.end_stream(connect.ConnectError("not_found", "gone")))
    assert flags == connect.FLAG_END_STREAM
    tail = connect.end_stream(connect.ConnectError("not_found", "gone"))[connect.ENVELOPE.size:]
    assert json.loads(tail) == {"error": {"code": "not_found", "message": "gone"}}


@pytest.mark.parametrize("body,code", [
    (b"\x00\x00\x00", "invalid_argument"),
    (b"\x00\x00\x00\x00\x09{}", "invalid_argument"),
    (b"\x01\x00\x00\x00\x02{}", "unimplemented"),
    (b"\x00\x00\x00\x00\x03{x}", "invalid_argument"),
], ids=["short-prefix", "truncated", "compressed", "bad-json"])
def test_bad_envelopes_raise_connect_errors(body, code):
    with pytest.raises(connect.ConnectError) as info:
        list(connect.iter_envelopes(body))
    assert info.value.code == code


def test_first_message_unary_and_streaming():
    assert connect.first_message(b'{"path": "/x"}', streaming=False) == {"path": "/x"}
    assert connect.first_message(connect.envelope({"path": "/y"}), streaming=True) == {"path": "/y"}
    with pytest.raises(connect.ConnectError):
        connect.first_message(b"", streaming=True)
    with pytest.raises(connect.ConnectError):
        connect.first_message(b"[1]", streaming=False)


def test_unknown_codes_become_unknown_with_http_500():
    error = connect.ConnectError("made_up", "m")
    assert error.code == "unknown" and error.http_status == 500
    assert connect.ConnectError("resource_exhausted", "q").http_status == 429


def test_keys_are_stored_hashed_and_revocable(tmp_path):
    store = KeyStore(tmp_path)
    key, info = store.create("ci", Quota(max_sandboxes=3))
    assert key.startswith("e2b_") and key not in (tmp_path / "keys.json").read_text()
    assert store.verify(key).id == info.id and store.verify(key).quota.max_sandboxes == 3
    assert store.verify("e2b_other") is None and store.verify(None) is None
    other = KeyStore(tmp_path)  # a second process (the CLI) sees and revokes the same keys
    other.revoke(info.id)
    assert store.verify(key) is None
    with pytest.raises(KeyError):
        store.revoke("key-missing")


@pytest.mark.parametrize("kwargs,arg", [({"max_sandboxes": -1}, "max_sandboxes"), ({"max_cpus": -2}, "max_cpus"),
                                        ({"max_memory_mb": 1.5}, "max_memory_mb")])
def test_quota_rejects_bad_values(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        Quota(**kwargs)


def test_key_name_must_be_text(tmp_path):
    with pytest.raises(ValueError, match="name"):
        KeyStore(tmp_path).create("  ")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "example.com"])
def test_server_binds_loopback_only(host):
    from agentenv.server import Server

    with pytest.raises(ValueError, match="loopback"):
        Server(host=host, port=0, backend=object())


def test_server_rejects_bad_port():
    from agentenv.server import Server

    with pytest.raises(ValueError, match="port"):
        Server(port=70000, backend=object())


def test_cli_verbs_plug_into_a_parser_with_a_global_home():
    import argparse

    from agentenv.server.cli import add_subcommands, cmd_keys_create, cmd_serve

    parser = argparse.ArgumentParser(prog="agentenv")
    parser.add_argument("--home", default=None)
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["--home", "/tmp/h", "serve", "--port", "0", "--kill-on-exit"])
    assert (args.home, args.port, args.kill_on_exit, args.func) == ("/tmp/h", 0, True, cmd_serve)
    args = parser.parse_args(["keys", "create", "ci", "--max-sandboxes", "4"])
    assert (args.name, args.max_sandboxes, args.func) == ("ci", 4, cmd_keys_create)


def test_keys_cli_creates_lists_and_revokes(tmp_path, capsys):
    from agentenv.server.cli import main

    assert main(["keys", "--state-dir", str(tmp_path), "create", "ci", "--max-sandboxes", "2"]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["quota"]["max_sandboxes"] == 2 and created["api_key"].startswith("e2b_")
    assert main(["keys", "--state-dir", str(tmp_path), "list"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["key_id"] == created["key_id"] and "api_key" not in listed
    assert main(["keys", "--state-dir", str(tmp_path), "revoke", created["key_id"]]) == 0
    assert main(["keys", "--state-dir", str(tmp_path), "revoke", "key-nope"]) == 1


class _FakeUpload:
    """Just what `Envd._uploads` reads from a request."""

    def __init__(self, body: bytes, content_type: str, query: dict | None = None, encoding: str = ""):
        self._raw = body
        self.headers = {"Content-Type": content_type, "Content-Encoding": encoding}
        self.query = query or {}

    def body(self, limit: int) -> bytes:
        return self._raw


def _multipart(files):
    import httpx

    req = httpx.Request("POST", "http://x/files", files=[("file", f) for f in files])
    return req.read(), req.headers["content-type"]


def test_multipart_uploads_split_into_files():
    from agentenv.server.envd import Envd

    big = bytes(range(256)) * 5000
    body, ctype = _multipart([("/a.txt", b"one"), ("/empty", b""), ("/big.bin", big)])
    assert Envd._uploads(_FakeUpload(body, ctype)) == [("/a.txt", b"one"), ("/empty", b""), ("/big.bin", big)]
    body, ctype = _multipart([("ignored-name", b"x")])
    assert Envd._uploads(_FakeUpload(body, ctype, {"path": "/p"})) == [("/p", b"x")]


def test_octet_stream_and_gzip_uploads():
    import gzip

    from agentenv.server.envd import Envd

    assert Envd._uploads(_FakeUpload(b"raw", "application/octet-stream", {"path": "/r"})) == [("/r", b"raw")]
    packed = gzip.compress(b"zipped")
    assert Envd._uploads(_FakeUpload(packed, "application/octet-stream", {"path": "/z"}, "gzip")) == \
        [("/z", b"zipped")]


@pytest.mark.parametrize("case", ["no-boundary", "truncated", "path-with-many", "octet-no-path", "bad-gzip"])
def test_malformed_uploads_are_400(case):
    from agentenv.server.envd import Envd
    from agentenv.server.httpd import HTTPError

    body, ctype = _multipart([("/a", b"1"), ("/b", b"2")])
    request = {
        "no-boundary": _FakeUpload(body, "multipart/form-data"),
        "truncated": _FakeUpload(body[: len(body) // 2], ctype),
        "path-with-many": _FakeUpload(body, ctype, {"path": "/one"}),
        "octet-no-path": _FakeUpload(b"x", "application/octet-stream"),
        "bad-gzip": _FakeUpload(b"not gzip", "application/octet-stream", {"path": "/g"}, "gzip"),
    }[case]
    with pytest.raises(HTTPError) as info:
        Envd._uploads(request)
    assert info.value.status == 400


@pytest.mark.parametrize("step", [1, 3, 7, 1000], ids=lambda s: f"pieces-of-{s}")
def test_client_stream_decodes_across_arbitrary_chunking(step):
    body = connect.envelope({"start": {"pid": 1}}) + connect.envelope({"data": {"x": "y" * 50}}) + \
        connect.end_stream()
    pieces = (body[i : i + step] for i in range(0, len(body), step))
    assert list(connect.iter_stream(pieces)) == [{"start": {"pid": 1}}, {"data": {"x": "y" * 50}}]


def test_client_stream_cut_inside_an_envelope_is_invalid():
    body = connect.envelope({"a": 1})
    with pytest.raises(connect.ConnectError, match="inside an envelope"):
        list(connect.iter_stream(iter([body[:-2]])))
