"""The writable layer is disk-backed: files never count against memory, the quota answers ENOSPC."""

from __future__ import annotations

from pathlib import Path

from agentenv import Limits

WRITE = """
import errno, os, sys
total, chunk = int(sys.argv[1]) << 20, b"x" * (1 << 20)
written = 0
try:
    with open(sys.argv[2], "wb") as f:
        while written < total:
            written += f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    print("ok", written >> 20)
except OSError as e:
    print(errno.errorcode[e.errno], written >> 20)
"""


def _fstype(backend, sandbox_id: str) -> str:
    upper = backend.store.read_record(sandbox_id).upper
    target = str(backend.store.layers / upper)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == target:
            return fields[fields.index("-") + 1]
    raise AssertionError(f"layer {upper} is not mounted")


def test_writing_more_than_memory_within_the_disk_quota_succeeds_then_enospc(sandbox_factory, backend):
    sb = sandbox_factory(limits=Limits(memory_mb=512, disk_mb=1024))
    assert _fstype(backend, sb.id) == "ext4"
    r = sb.exec(["python3", "-c", WRITE, "700", "/root/big"], timeout=120)
    assert r.stdout.split() == ["ok", "700"], (r.stdout, r.stderr)
    r = sb.exec(["python3", "-c", WRITE, "400", "/root/more"], timeout=120)
    assert r.stdout.split()[0] == "ENOSPC", (r.stdout, r.stderr)
    assert 300 <= int(r.stdout.split()[1]) <= 326, r.stdout  # the rest of the 1024 MiB, not more
    assert sb.exec("stat -c %s /root/big && echo alive").stdout.split() == [str(700 << 20), "alive"]
    sb.files.write("/root/small", "fits after a delete")
    sb.exec("rm /root/more")
    assert sb.files.read("/root/small") == "fits after a delete"


def test_small_memory_limit_writes_several_times_its_memory(sandbox_factory, backend):
    sb = sandbox_factory(limits=Limits(memory_mb=32, disk_mb=128))
    r = sb.exec(["python3", "-c", WRITE, "120", "/root/big"], timeout=120)
    assert r.stdout.split() == ["ok", "120"], (r.stdout, r.stderr)
    kids = sb.fork(2)
    for kid in kids:
        sandbox_factory.track(kid)
    for kid in kids:  # each child has its own quota over the sealed parent layer
        assert kid.exec("stat -c %s /root/big").stdout.strip() == str(120 << 20)
        r = kid.exec(["python3", "-c", WRITE, "200", "/root/mine"], timeout=120)
        assert r.stdout.split()[0] == "ENOSPC" and 120 <= int(r.stdout.split()[1]) <= 129, r.stdout
    assert sb.exec("echo alive").stdout.strip() == "alive"


def test_disk_in_memory_is_a_tmpfs_charged_to_memory(sandbox_factory, backend):
    sb = sandbox_factory(limits=Limits(memory_mb=64, disk_mb=32, disk_in_memory=True))
    assert _fstype(backend, sb.id) == "tmpfs"
    r = sb.exec(["python3", "-c", WRITE, "40", "/root/big"], timeout=60)
    assert r.stdout.split()[0] == "ENOSPC", (r.stdout, r.stderr)
    kid = sb.fork(1)[0]
    sandbox_factory.track(kid)
    assert _fstype(backend, kid.id) == "tmpfs"
