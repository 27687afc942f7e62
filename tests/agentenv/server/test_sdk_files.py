"""The stock `e2b` SDK's filesystem service and /files transfers against our server."""

from __future__ import annotations

import hashlib
import time

import pytest


def test_write_read_roundtrip_text_and_bytes(e2b_sandbox):
    info = e2b_sandbox.files.write("/tmp/a/b/hello.txt", "hello")  # parents are created
    assert info.path == "/tmp/a/b/hello.txt"
    assert e2b_sandbox.files.read("/tmp/a/b/hello.txt") == "hello"
    blob = bytes(range(256)) * 4096
    e2b_sandbox.files.write("/tmp/blob.bin", blob)
    assert bytes(e2b_sandbox.files.read("/tmp/blob.bin", format="bytes")) == blob


@pytest.mark.parametrize("octet", [False, True], ids=["multipart", "octet-stream"])
def test_upload_encodings(e2b_sandbox, octet):
    e2b_sandbox.files.write("/tmp/up.txt", "x" * 1000, use_octet_stream=octet)
    assert e2b_sandbox.commands.run("wc -c < /tmp/up.txt").stdout.strip() == "1000"


def test_write_files_writes_several_in_one_request(e2b_sandbox):
    infos = e2b_sandbox.files.write_files([{"path": "/tmp/m/1.txt", "data": "one"},
                                           {"path": "/tmp/m/2.txt", "data": "two"}])
    assert sorted(i.path for i in infos) == ["/tmp/m/1.txt", "/tmp/m/2.txt"]
    assert e2b_sandbox.files.read("/tmp/m/2.txt") == "two"


def test_relative_paths_resolve_in_the_users_home(e2b_sandbox):
    e2b_sandbox.files.write("notes.txt", "n")
    assert e2b_sandbox.commands.run("cat /home/user/notes.txt").stdout == "n"


def test_list_stat_make_dir_rename_remove(e2b_sandbox):
    files = e2b_sandbox.files
    assert files.make_dir("/tmp/d") is True
    assert files.make_dir("/tmp/d") is False  # exists already
    files.write("/tmp/d/x.txt", "12345")
    entries = files.list("/tmp/d")
    assert [(e.name, e.type.value, e.size) for e in entries] == [("x.txt", "file", 5)]
    info = files.get_info("/tmp/d")
    assert info.type.value == "dir"
    files.rename("/tmp/d/x.txt", "/tmp/d/y.txt")
    assert files.exists("/tmp/d/y.txt") and not files.exists("/tmp/d/x.txt")
    files.remove("/tmp/d")
    assert not files.exists("/tmp/d")


def test_list_depth_walks_subdirectories(e2b_sandbox):
    e2b_sandbox.files.write("/tmp/t/a/b/c.txt", "c")
    names = sorted(e.path for e in e2b_sandbox.files.list("/tmp/t", depth=3))
    assert names == ["/tmp/t/a", "/tmp/t/a/b", "/tmp/t/a/b/c.txt"]


def test_missing_file_raises_not_found(e2b_sandbox):
    from e2b import NotFoundException

    with pytest.raises(NotFoundException):
        e2b_sandbox.files.read("/tmp/does-not-exist")
    with pytest.raises(NotFoundException):
        e2b_sandbox.files.list("/tmp/does-not-exist")


def test_watch_dir_reports_create_write_remove(e2b_sandbox):
    e2b_sandbox.files.make_dir("/tmp/w")
    handle = e2b_sandbox.files.watch_dir("/tmp/w")
    try:
        e2b_sandbox.files.write("/tmp/w/f.txt", "1")
        time.sleep(0.2)
        e2b_sandbox.files.write("/tmp/w/f.txt", "22")
        time.sleep(0.2)
        e2b_sandbox.files.remove("/tmp/w/f.txt")
        deadline = time.monotonic() + 5
        seen: list = []
        while time.monotonic() < deadline and "remove" not in [e.type.value for e in seen]:
            seen += handle.get_new_events()
            time.sleep(0.05)
    finally:
        handle.stop()
    kinds = [e.type.value for e in seen if e.name == "f.txt"]
    assert kinds[0] == "create" and "write" in kinds and kinds[-1] == "remove", kinds


def test_async_watch_stream(e2b_env):
    import asyncio

    from e2b import AsyncSandbox

    async def scenario() -> list:
        sb = await AsyncSandbox.create(timeout=60)
        try:
            await sb.files.make_dir("/tmp/aw")
            events: list = []
            handle = await sb.files.watch_dir("/tmp/aw", on_event=events.append)
            await sb.files.write("/tmp/aw/new.txt", "x")
            for _ in range(100):
                if events:
                    break
                await asyncio.sleep(0.05)
            await handle.stop()
            return events
        finally:
            await sb.kill()

    events = asyncio.run(scenario())
    assert [(e.name, e.type.value) for e in events][:1] == [("new.txt", "create")]


def test_streamed_upload_from_a_file_object(e2b_sandbox):
    import io

    blob = bytes(range(256)) * 2048  # 512 KiB, sent as a streamed (chunked) octet-stream body
    e2b_sandbox.files.write("/tmp/streamed.bin", io.BytesIO(blob))
    assert bytes(e2b_sandbox.files.read("/tmp/streamed.bin", format="bytes")) == blob


def test_reads_resolve_inside_the_sandbox_root(e2b_sandbox):
    """Regular files at absolute paths are sent from the host (sendfile); every symlink, `..` and magic link
    must still resolve as inside the sandbox, never to the host's files."""
    inside = e2b_sandbox.commands.run("cat /etc/hostname").stdout
    e2b_sandbox.commands.run("mkdir -p /tmp/r/a && ln -s ../../../../../../etc/hostname /tmp/r/a/up && "
                             "ln -s /etc/hostname /tmp/r/abs && ln -s /proc/1/root/etc/hostname /tmp/r/magic && "
                             "ln -s /proc/self/cwd /tmp/r/cwd && head -c 300000 /dev/urandom > /tmp/r/big")
    for path in ("/etc/hostname", "/tmp/r/a/up", "/tmp/r/abs", "/tmp/r/../../etc/hostname"):
        assert e2b_sandbox.files.read(path) == inside, path
    from e2b import SandboxException

    with pytest.raises(SandboxException, match="Permission denied"):  # the agent's answer: pid 1 is not dumpable
        e2b_sandbox.files.read("/tmp/r/magic")
    big = e2b_sandbox.commands.run("sha256sum /tmp/r/big").stdout.split()[0]
    assert hashlib.sha256(bytes(e2b_sandbox.files.read("/tmp/r/big", format="bytes"))).hexdigest() == big
    with pytest.raises(SandboxException):  # a magic link to a directory: the agent's error, not a host read
        e2b_sandbox.files.read("/tmp/r/cwd")


def test_host_side_open_is_confined_to_the_sandbox(e2b_sandbox, server):
    """`open_regular_in_sandbox` (the read fast path) opens regular files as the sandbox sees them and
    declines everything else, so those reads go to the agent."""
    import os

    from agentenv.runtime.local import NamespaceBackend
    from agentenv.server.agents import open_regular_in_sandbox

    pid = next(i.pid for i in NamespaceBackend(server.home).list() if i.id == e2b_sandbox.sandbox_id)
    e2b_sandbox.commands.run("mkdir -p /tmp/h && printf inside > /tmp/h/f && ln -s ../../../../../tmp/h/f /tmp/h/up "
                             "&& ln -s /proc/1/root/tmp/h/f /tmp/h/magic && mkfifo /tmp/h/fifo")
    for path in ("/tmp/h/f", "/tmp/h/up"):
        fd, size = open_regular_in_sandbox(pid, path)
        try:
            assert os.read(fd, 100) == b"inside" and size == 6
        finally:
            os.close(fd)
    for path in ("/tmp/h/magic", "/tmp/h/fifo", "/tmp/h", "/tmp/h/missing", "/dev/zero"):
        assert open_regular_in_sandbox(pid, path) is None, path
