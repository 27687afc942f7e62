"""Image layers from directories and tarballs that hold special files (a debootstrap root has device nodes)."""

from __future__ import annotations

import os
import stat
import tarfile

import pytest

from agentenv.runtime import images
from agentenv.runtime.store import Store

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="device nodes need root")


def _layer_root(store: Store, manifest: dict):
    (layer,) = manifest["layers"]
    return store.layers / layer / "diff"


@pytest.mark.timeout(60)
def test_directory_with_device_nodes_and_fifo_builds_without_reading_them(tmp_path):
    src = tmp_path / "root"
    (src / "dev").mkdir(parents=True)
    (src / "etc").mkdir()
    (src / "etc" / "hostname").write_text("img\n")
    # /dev/null's numbers (a regression then copies an empty file, where /dev/zero would fill the disk); a FIFO
    # copied by content would block the build forever.
    os.mknod(src / "dev" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(src / "pipe", 0o640)
    store = Store(tmp_path / "home")
    root = _layer_root(store, images.build_from_path(store, "special", src))
    assert (root / "etc" / "hostname").read_text() == "img\n"
    assert not os.path.lexists(root / "dev" / "null")
    pipe = os.lstat(root / "pipe")
    assert stat.S_ISFIFO(pipe.st_mode) and stat.S_IMODE(pipe.st_mode) == 0o640


@pytest.mark.timeout(60)
def test_tarball_device_members_are_dropped(tmp_path):
    src = tmp_path / "root"
    src.mkdir()
    (src / "file").write_text("x")
    os.mknod(src / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    tar_path = tmp_path / "root.tar"
    with tarfile.open(tar_path, "w") as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name)
    store = Store(tmp_path / "home")
    root = _layer_root(store, images.build_from_path(store, "tarred", tar_path))
    assert (root / "file").read_text() == "x"
    assert not os.path.lexists(root / "null")


@pytest.mark.timeout(120)
def test_usr_bind_image_from_a_small_directory_runs_commands(tmp_path, leak_report):
    """A directory with only app files: /bin and /lib64 links, /tmp 1777, a root-owned root and /tmp."""
    from agentenv import Sandbox
    from agentenv.runtime.local import NamespaceBackend

    src = tmp_path / "src"
    (src / "app").mkdir(parents=True)
    (src / "app" / "x").write_text("hi\n")
    os.chown(src, 200000, 200000)  # a source tree owned outside the uid range (e.g. from a rootless build)
    backend = NamespaceBackend(tmp_path / "home")
    try:
        images.build_from_path(backend.store, "app", src, usr_bind=True)
        with Sandbox.create("app", backend=backend) as sb:
            r = sb.exec("cat /app/x; stat -c '%a %u' /tmp /; readlink /bin /lib64")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split("\n")[:5] == ["hi", "1777 0", "755 0", "usr/bin", "usr/lib64"], r.stdout
    finally:
        backend.gc(everything=True)
    assert not any(leak_report(tmp_path / "home").values())
