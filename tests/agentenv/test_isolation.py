"""Escape attempts from inside a sandbox: every one must fail and the host must stay healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from agentenv import Limits, SandboxTimeoutError

PY = "/usr/bin/python3"


def _host_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent for a UDP connect
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_host_files_are_invisible_and_unwritable(sandbox, tmp_path):
    secret = Path("/tmp") / f"agentenv-secret-{uuid.uuid4().hex}"
    secret.write_text("host secret")
    try:
        assert sandbox.exec(f"cat {secret}").exit_code != 0
        assert "work" not in sandbox.exec("ls /").stdout.split()
        assert sandbox.exec("echo x > /usr/bin/agentenv-evil").exit_code != 0  # host /usr is read-only
        hosts_before = Path("/etc/hosts").read_text()
        assert sandbox.exec("echo '1.2.3.4 evil' >> /etc/hosts").exit_code == 0  # lands in the writable layer
        assert Path("/etc/hosts").read_text() == hosts_before
        assert not Path("/usr/bin/agentenv-evil").exists()
    finally:
        secret.unlink()


def test_host_processes_are_invisible_and_unsignalable(sandbox):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        listing = sandbox.exec("ps -eo pid,comm").stdout
        assert "sleep" not in listing and "pytest" not in listing
        assert sandbox.exec(f"kill -9 {sleeper.pid}").exit_code != 0
        assert sandbox.exec("kill -9 1; echo survived").stdout == "survived\n"
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_network_reaches_only_own_loopback(sandbox):
    listeners = []
    try:
        lo = socket.create_server(("127.0.0.1", 0))
        listeners.append(lo)
        targets = [("127.0.0.1", lo.getsockname()[1])]
        ip = _host_ip()
        if ip is not None:
            any_ = socket.create_server(("0.0.0.0", 0))
            listeners.append(any_)
            targets.append((ip, any_.getsockname()[1]))
        for host, port in targets:
            code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
                    f"try:\n    s.connect(({host!r}, {port}))\n    print('CONNECTED')\n"
                    f"except OSError as e:\n    print('blocked', e.errno)")
            out = sandbox.exec([PY, "-c", code]).stdout
            assert out.startswith("blocked"), (host, out)
        own = sandbox.exec([PY, "-c", "import socket; s = socket.create_server(('127.0.0.1', 0)); "
                                      "c = socket.create_connection(s.getsockname()); print('own ok')"])
        assert own.stdout == "own ok\n"
        assert sandbox.exec("ls /sys/class/net 2>/dev/null || cat /proc/net/dev").stdout.count(":") <= 2
    finally:
        for s in listeners:
            s.close()


@pytest.mark.parametrize(
    "name, code",
    [
        pytest.param("mount", "mount -t tmpfs none /mnt", id="mount"),
        pytest.param("ptrace", f"{PY} -c \"import ctypes,sys; l=ctypes.CDLL(None, use_errno=True); "
                               f"sys.exit(0 if l.ptrace(16, 1, 0, 0) == 0 else 1)\"", id="ptrace-attach"),
        pytest.param("init_module", f"{PY} -c \"import ctypes,sys; l=ctypes.CDLL(None, use_errno=True); "
                                    f"sys.exit(0 if l.syscall(175, 0, 0, b'') == 0 else 1)\"", id="module-load"),
        pytest.param("sysctl", "echo 3 > /proc/sys/vm/drop_caches", id="sysctl-write"),
        pytest.param("unshare", "unshare -U true", id="new-user-namespace"),
        pytest.param("kexec", f"{PY} -c \"import ctypes,sys; l=ctypes.CDLL(None, use_errno=True); "
                              f"sys.exit(0 if l.syscall(246, 0, 0, 0, 0) == 0 else 1)\"", id="kexec"),
    ],
)
def test_privileged_operations_fail(sandbox, name, code):
    assert sandbox.exec(code).exit_code != 0, name


def test_no_new_privileges_and_unprivileged_host_uid(sandbox, backend):
    status = sandbox.exec("cat /proc/self/status").stdout
    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status
    assert "nosuid" in sandbox.exec("grep ' /usr ' /proc/self/mounts").stdout
    rec = backend.store.read_record(sandbox.id)
    uid_line = next(x for x in Path(f"/proc/{rec.pid}/status").read_text().splitlines() if x.startswith("Uid:"))
    assert all(int(u) >= 100_000 for u in uid_line.split()[1:])


def test_agents_cannot_reach_into_the_tool_server(sandbox):
    for probe in ("exec 3</proc/1/mem", "cat /proc/1/environ", "ls /proc/1/fd", "readlink /proc/1/root"):
        assert sandbox.exec(f"{probe} >/dev/null 2>&1").exit_code != 0, probe
    (kid,) = sandbox.fork(1)
    try:
        assert kid.exec("cat /proc/1/environ >/dev/null 2>&1").exit_code != 0
    finally:
        kid.destroy()


def test_sandboxes_cannot_see_each_other(sandbox_factory):
    a, b = sandbox_factory(), sandbox_factory()
    a.files.write("/root/mine", "a")
    a.exec("sleep 30 >/dev/null 2>&1 &")
    assert not b.files.exists("/root/mine")
    assert "sleep" not in b.exec("ps -eo comm").stdout


def test_fork_bomb_is_contained_by_pids_limit(sandbox_factory, backend):
    sb = sandbox_factory(limits=Limits(pids=64))
    try:
        sb.exec("bomb() { bomb | bomb & }; bomb; sleep 2", timeout=3)
    except SandboxTimeoutError:
        pass
    pids = backend._cgroup(sb.id).path("pids")
    # the commands' process share (below the pids limit) stops it before the cgroup limit does
    assert int((pids / "pids.current").read_text()) <= 64
    assert sb.exec("echo alive").stdout == "alive\n"
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_memory_bomb_is_killed_inside_only(sandbox_factory):
    sb = sandbox_factory(limits=Limits(memory_mb=64))
    result = sb.exec([PY, "-c", "x = bytearray(256 << 20); x[::4096] = b'1' * len(x[::4096]); print('survived')"])
    assert result.exit_code != 0 and "survived" not in result.stdout
    assert sb.exec("echo alive").stdout == "alive\n"


def test_disk_fill_hits_writable_layer_quota(sandbox_factory):
    sb = sandbox_factory(limits=Limits(disk_mb=8))
    result = sb.exec("dd if=/dev/zero of=/root/big bs=1M count=32")
    assert result.exit_code != 0 and "No space left" in result.stderr
    sb.exec("rm -f /root/big")
    assert sb.exec("echo fine > /root/small && cat /root/small").stdout == "fine\n"
    assert os.statvfs("/").f_bavail > 0
