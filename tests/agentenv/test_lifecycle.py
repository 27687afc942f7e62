"""Leaks, crashes, TTL and images: each test runs on its own data directory and checks it ends empty."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from agentenv import AsyncSandbox, Sandbox, SandboxError, SandboxGoneError, SandboxNotFoundError
from agentenv.runtime.local import NamespaceBackend

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_backend(leak_report):
    home = Path(tempfile.mkdtemp(prefix="agentenv-own-", dir="/tmp"))
    backend = NamespaceBackend(home)
    yield backend
    backend.gc(everything=True)
    left = leak_report(home)
    assert not any(left.values()), f"leaked: {left}"
    import shutil

    shutil.rmtree(home, ignore_errors=True)


def _only_seed_left(backend: NamespaceBackend, leak_report) -> None:
    left = leak_report(backend.store.home)
    assert left["records"] == ["seed-host.json", "seed-host.sock"], left
    assert len(left["layers"]) == 1 and len(left["mounts"]) == 1, left  # the seed's scratch layer
    assert list(left["cgroups"].values()) == [["seed-host"]] * 4, left


def _cycles(backend: NamespaceBackend, n: int) -> None:
    for _ in range(n):
        sb = Sandbox.create(backend=backend)
        sb.files.write("/root/x", "1")
        (kid,) = sb.fork(1)
        kid.destroy()
        sb.destroy()


def test_create_fork_destroy_cycles_leave_nothing(own_backend, leak_report):
    _cycles(own_backend, 150)
    _only_seed_left(own_backend, leak_report)


_CHURN = """
import sys
sys.path.insert(0, {src!r})
from agentenv import Sandbox
from agentenv.runtime.local import NamespaceBackend
backend = NamespaceBackend({home!r})
keep = []
while True:
    sb = Sandbox.create(backend=backend)
    sb.python.run("x = 1")
    keep += sb.fork(2)
    keep.append(sb.snapshot())
    print(sb.id, flush=True)
"""


def test_killed_runtime_leaves_nothing_gc_cannot_reclaim(own_backend, leak_report):
    home = own_backend.store.home
    proc = subprocess.Popen([sys.executable, "-c", _CHURN.format(src=str(REPO / "src"), home=str(home))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("sb-")  # it is running; kill it somewhere mid-operation
        time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert own_backend.list()  # its sandboxes outlive it (they are not its children)
    own_backend.gc(everything=True)
    left = leak_report(home)
    assert not any(left.values()), left


def test_gc_removes_a_record_write_cut_by_a_kill(own_backend, leak_report):
    records = own_backend.store.records
    dead = subprocess.Popen(["true"])
    dead.wait()  # a writer that died inside write_record left its temporary file behind
    cut = records / f".sb-000000000000.json.{dead.pid}.1.tmp"
    cut.write_text("{")
    writing = records / f".sb-000000000001.json.{os.getpid()}.1.tmp"  # a live writer's: not touched
    writing.write_text("{")
    try:
        own_backend.gc()
        assert not cut.exists() and writing.exists()
    finally:
        writing.unlink()
    assert leak_report(own_backend.store.home)["records"] == []


def test_ttl_stops_sandbox_and_gc_reclaims_it(own_backend, leak_report):
    sb = Sandbox.create(backend=own_backend, ttl=0.5)
    assert sb.exec("echo up").stdout == "up\n"
    time.sleep(1.6)
    with pytest.raises(SandboxGoneError):
        sb.exec("true")
    own_backend.gc()
    _only_seed_left(own_backend, leak_report)


def test_unknown_image_raises_not_found(own_backend):
    with pytest.raises(SandboxNotFoundError, match="unknown image"):
        Sandbox.create("no-such-image", backend=own_backend)
    with pytest.raises(SandboxNotFoundError):
        Sandbox.restore("snap-000000000000", backend=own_backend)


def test_images_from_directory_and_tarball_are_content_addressed(own_backend, tmp_path):
    from agentenv.runtime import images

    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    (root / "data" / "hello.txt").write_text("from the image\n")
    for link in ("bin", "lib", "lib64"):
        if Path(f"/usr/{link}").exists():
            os.symlink(f"usr/{link}", root / link)
    a = images.build_from_path(own_backend.store, "dirimg", root, usr_bind=True)
    tar = tmp_path / "root.tar.gz"
    with tarfile.open(tar, "w:gz") as t:
        for child in sorted(root.iterdir()):
            t.add(child, arcname=child.name)
    b = images.build_from_path(own_backend.store, "tarimg", tar, usr_bind=True)
    c = images.build_from_path(own_backend.store, "dirimg2", root, usr_bind=True)
    assert a["layers"] == c["layers"]  # same content, one layer
    with Sandbox.create("tarimg", backend=own_backend) as sb:
        assert sb.exec("cat /data/hello.txt").stdout == "from the image\n"
    assert len(b["layers"]) == 1
    with pytest.raises(FileNotFoundError):
        images.build_from_path(own_backend.store, "x", tmp_path / "missing")


def test_template_runs_setup_once_and_sandboxes_start_from_it(own_backend):
    snap = own_backend.template("tpl", "host", ["echo ready > /root/setup.txt", "mkdir -p /opt/tool"])
    with Sandbox.create("tpl", backend=own_backend) as a, Sandbox.create("tpl", backend=own_backend) as b:
        assert a.files.read("/root/setup.txt") == "ready\n" and b.files.exists("/opt/tool")
        a.files.write("/root/setup.txt", "changed")
        assert b.files.read("/root/setup.txt") == "ready\n"
    with pytest.raises(SandboxError, match="exited with 3"):
        own_backend.template("bad", "host", ["exit 3"])
    own_backend.destroy(snap)


def test_async_sandbox_create_exec_fork(own_backend):
    async def main() -> list[str]:
        async with await AsyncSandbox.create(backend=own_backend) as sb:
            await sb.python.run("v = 5")
            kids = await sb.fork(2)
            results = await asyncio.gather(*(k.python.run("v * 2") for k in kids))
            outs = await asyncio.gather(*(k.exec("echo hi") for k in kids))
            for k in kids:
                await k.destroy()
            return [r.value for r in results] + [o.stdout for o in outs]

    assert asyncio.run(main()) == ["10", "10", "hi\n", "hi\n"]


def test_cli_create_exec_fork_snapshot_restore_ls_rm_gc(own_backend):
    home = str(own_backend.store.home)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    def cli(*args: str, code: int = 0) -> str:
        done = subprocess.run([sys.executable, "-m", "agentenv.cli", "--home", home, *args],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        return done.stdout

    sid = cli("create", "--memory-mb", "128").strip()
    assert cli("exec", sid, "--", "sh", "-c", "echo hi > /root/f; cat /root/f") == "hi\n"
    cli("exec", sid, "--", "sh", "-c", "exit 4", code=4)
    kids = cli("fork", sid, "-n", "2").split()
    assert len(kids) == 2 and cli("exec", kids[0], "--", "cat", "/root/f") == "hi\n"
    snap = cli("snapshot", sid).strip()
    restored = cli("restore", snap).strip()
    assert cli("exec", restored, "--", "cat", "/root/f") == "hi\n"
    listing = cli("ls")
    assert all(x in listing for x in (sid, snap, restored, *kids))
    cli("rm", restored, *kids)
    cli("rm", "sb-nonexistent", code=1)
    cli("gc", "--all")
    assert cli("ls", "--all").count("\n") == 1  # header only
