"""What envd 0.6.2 and 0.6.3 add, through the stock `e2b` SDK (we report 0.6.3, so the SDK sends them): user
metadata on uploaded files (``user.e2b.*`` xattrs) in write results, stat and list; entries in watch events
(``include_entry``) with their metadata, mode, permissions, owner, group, modified time and symlink target."""

from __future__ import annotations

import time
from datetime import datetime, timezone

STAT = "python3 -c \"import os; st = os.lstat('{0}'); print(oct(st.st_mode & 0o777), st.st_mtime)\""


def test_server_reports_envd_0_6_3(e2b_sandbox):
    from packaging.version import Version

    assert e2b_sandbox._envd_version == Version("0.6.3")


def test_write_metadata_is_kept_and_read_back_by_stat_and_list(e2b_sandbox):
    info = e2b_sandbox.files.write("/tmp/meta/a.txt", "payload", metadata={"Team": "rl", "run-id": "7 b"})
    expected = {"team": "rl", "run-id": "7 b"}  # keys lower-cased by the sandbox, as envd does
    assert info.metadata == expected
    assert e2b_sandbox.files.get_info("/tmp/meta/a.txt").metadata == expected
    # set out of band (not through an upload) and a plain file without any
    e2b_sandbox.commands.run("touch /tmp/meta/b.txt /tmp/meta/plain.txt && python3 -c \"import os; "
                             "os.setxattr('/tmp/meta/b.txt', 'user.e2b.src', b'oob')\"")
    listed = {e.name: e.metadata for e in e2b_sandbox.files.list("/tmp/meta")}
    assert listed == {"a.txt": expected, "b.txt": {"src": "oob"}, "plain.txt": None}
    # a rewrite with other metadata adds its keys; the file's content changes as usual
    e2b_sandbox.files.write("/tmp/meta/a.txt", "again", metadata={"team": "env"})
    assert e2b_sandbox.files.get_info("/tmp/meta/a.txt").metadata == {"team": "env", "run-id": "7 b"}
    assert e2b_sandbox.files.read("/tmp/meta/a.txt") == "again"


def test_metadata_survives_a_fork(e2b_sandbox):
    e2b_sandbox.files.write("/tmp/fm.txt", "x", metadata={"stage": "before-fork"})
    (kid,) = e2b_sandbox.fork(count=1)
    try:
        assert kid.files.get_info("/tmp/fm.txt").metadata == {"stage": "before-fork"}
    finally:
        kid.kill()


def test_watch_events_carry_entries_with_metadata(e2b_sandbox):
    from e2b import FileType

    e2b_sandbox.files.make_dir("/tmp/we")
    handle = e2b_sandbox.files.watch_dir("/tmp/we", include_entry=True)
    try:
        e2b_sandbox.files.write("/tmp/we/f.txt", "12345", metadata={"k": "v"})
        e2b_sandbox.commands.run("chmod 640 /tmp/we/f.txt && ln -s f.txt /tmp/we/link && touch /tmp/we/gone "
                                 "&& rm /tmp/we/gone")
        seen: list = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(e.name == "gone" and e.type.value == "remove" for e in seen):
            seen += handle.get_new_events()
            time.sleep(0.05)
    finally:
        handle.stop()
    mode, mtime = e2b_sandbox.commands.run(STAT.format("/tmp/we/f.txt")).stdout.split()
    chmod = next(e for e in seen if e.name == "f.txt" and e.type.value == "chmod")
    entry = chmod.entry
    assert entry is not None and entry.type == FileType.FILE and entry.path == "/tmp/we/f.txt"
    assert entry.size == 5 and entry.metadata == {"k": "v"}
    assert oct(entry.mode) == mode == "0o640" and entry.permissions == "-rw-r-----"
    assert entry.owner == "root" and entry.group == "root"
    assert abs(entry.modified_time.timestamp() - float(mtime)) < 1e-3
    assert entry.modified_time.tzinfo is not None and entry.modified_time <= datetime.now(timezone.utc)
    link = next(e.entry for e in seen if e.name == "link" and e.type.value == "create")
    assert link is not None and link.symlink_target == "f.txt" and link.type == FileType.SYMLINK
    assert [e.entry for e in seen if e.type.value == "remove"] == [None]  # gone: E2B leaves the entry out


def test_stat_reports_a_symlink_and_its_target(e2b_sandbox):
    from e2b import FileType

    e2b_sandbox.commands.run("mkdir -p /tmp/sl && echo hi > /tmp/sl/t && ln -s /tmp/sl/t /tmp/sl/l")
    entry = e2b_sandbox.files.get_info("/tmp/sl/l")
    assert entry.type == FileType.SYMLINK and entry.symlink_target == "/tmp/sl/t"
    assert e2b_sandbox.files.get_info("/tmp/sl/t").symlink_target is None


def test_invalid_metadata_headers_are_refused_before_writing(server, e2b_sandbox):
    """The SDK checks keys and values itself; the server does too, for any other client (E2B-shaped 400)."""
    from tests.agentenv.server.test_auth_errors import assert_e2b_error, call

    headers = {"E2b-Sandbox-Id": e2b_sandbox.sandbox_id, "E2b-Sandbox-Port": "49983",
               "X-Access-Token": e2b_sandbox._envd_access_token, "Content-Type": "application/octet-stream"}
    for bad in ({"X-Metadata-": "empty key"}, {"X-Metadata-k": "caf\u00e9"}, {"X-Metadata-a(b": "v"}):
        status, body = call(server, "POST", "/files?path=/tmp/bad.txt", headers={**headers, **bad}, raw=b"x")
        assert_e2b_error(status, body, 400)
        assert "metadata" in body["message"]
    assert not e2b_sandbox.files.exists("/tmp/bad.txt")
    status, body = call(server, "POST", "/files?path=/tmp/good.txt", headers={**headers, "X-Metadata-OK": "v"},
                        raw=b"x")
    assert status == 200 and body[0]["metadata"] == {"ok": "v"}
