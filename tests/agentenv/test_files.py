import pytest

from agentenv import NotFoundError, SandboxError


def test_write_read_list_remove(sandbox):
    sandbox.files.write("/root/dir/a.txt", "hello")
    sandbox.files.write("/root/dir/b.bin", b"\x00\x01", mode=0o600)
    assert sandbox.files.read("/root/dir/a.txt") == "hello"
    assert sandbox.files.read("/root/dir/b.bin", text=False) == b"\x00\x01"
    entries = sandbox.files.list("/root/dir")
    assert [(e.name, e.type, e.size) for e in entries] == [("a.txt", "file", 5), ("b.bin", "file", 2)]
    assert entries[1].mode == 0o600
    assert sandbox.exec("cat /root/dir/a.txt").stdout == "hello"
    sandbox.files.remove("/root/dir", recursive=True)
    assert not sandbox.files.exists("/root/dir")


def test_upload_download_roundtrip(sandbox, tmp_path):
    src = tmp_path / "in.bin"
    src.write_bytes(bytes(range(256)) * 100)
    sandbox.files.upload(src, "/tmp/in.bin")
    sandbox.files.download("/tmp/in.bin", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()


def test_missing_paths_raise_not_found_and_sandbox_stays_usable(sandbox):
    with pytest.raises(NotFoundError):
        sandbox.files.read("/root/missing")
    with pytest.raises(FileNotFoundError):
        sandbox.files.remove("/root/missing")
    with pytest.raises(SandboxError):
        sandbox.files.read("/root")
    assert sandbox.files.exists("/root")


@pytest.mark.parametrize("path", [pytest.param("relative/x", id="relative"), pytest.param(3, id="not-str")])
def test_bad_paths_raise_value_error(sandbox, path):
    with pytest.raises(ValueError, match="path"):
        sandbox.files.read(path)


@pytest.mark.parametrize("path", ["/dev/zero", "/tmp/fifo", "/dev/null"], ids=["dev-zero", "fifo", "dev-null"])
def test_reading_a_non_regular_file_is_refused_at_once(sandbox, path):
    sandbox.exec("mkfifo /tmp/fifo")
    with pytest.raises(SandboxError, match="not a regular file"):
        sandbox.files.read(path, text=False)
    assert sandbox.exec("echo alive").stdout == "alive\n"
