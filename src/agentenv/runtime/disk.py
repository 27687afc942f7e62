"""Disk-backed writable layers: each one a small ext4 of exactly its quota, on a loop device.

With the writable layer in tmpfs, a sandbox's files were charged to its memory cgroup and filling the disk
quota could OOM-kill it. Here a writable layer is its own ext4 filesystem, the size of the quota, in a
sparse, unlinked image file on a loop device in direct-I/O mode (no second page cache on the host), mounted
at ``<home>/layers/<id>``: writes past the quota get ``ENOSPC`` from the filesystem itself, and the files'
page cache is ordinary, reclaimable page cache rather than tmpfs memory that can only be freed by deleting.

Why not one filesystem with a project quota per layer: that needs the kernel's quota format support
(``CONFIG_QFMT_V2`` for ext4, ``CONFIG_XFS_QUOTA``), which kernels built for VMs often lack, and it answers
``EDQUOT``, not ``ENOSPC``.

A layer costs a sparse copy of a formatted template image of its size (made once per size with
``mkfs.ext4``, about 10 ms; ``diff`` and ``work`` already made and owned by the sandbox root), a
``LOOP_CONFIGURE`` and a mount: about 2 ms. The image file has no name (``O_TMPFILE``) and the loop device is
``autoclear``: unmounting the layer frees the device and the blocks, and a crash leaves nothing behind.

Dirty pages are capped per layer device (``max_bytes`` with ``strict_limit`` on its backing-device info): a
writer is throttled to the disk's pace instead of piling up dirty page cache in its memory cgroup, whose
reclaim could not free it fast enough.

Stdlib only.
"""

from __future__ import annotations

import errno as errno_codes
import fcntl
import logging
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from agentenv.errors import SandboxError
from agentenv.runtime import syscalls as sc

log = logging.getLogger(__name__)

MKFS = "mkfs.ext4"
DIRTY_MAX_BYTES = 32 << 20
"""Most dirty page cache one layer's filesystem may hold (writers past it wait for writeback)."""
MIN_IMAGE_BYTES = 256 << 10
"""Room for ext4's own metadata in the first try at an image size (see `LayerDisks._template`)."""

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
_LO_FLAGS_DIRECT_IO = 16
_LOOP_CONFIG_BYTES = 8 + 232 + 64  # struct loop_config: fd, block_size, struct loop_info64, reserved[8]
_LO_FLAGS_OFFSET = 8 + 52  # loop_info64.lo_flags
_MKFS_ARGS = ("-q", "-F", "-t", "ext4", "-b", "4096", "-O", "^has_journal,^resize_inode", "-I", "256", "-m", "0",
              "-E", "lazy_itable_init=1,nodiscard")
_MOUNT_OPTIONS = "noinit_itable,discard"


class DiskUnavailable(SandboxError):
    """Disk-backed layers cannot be made on this host (no mkfs.ext4, no loop devices)."""


class LayerDisks:
    """Makes and mounts writable layers of one data directory.

    Args:
        templates: directory for the formatted template image of each size (``tpl-<bytes>.img``); the
            layers' own images are unlinked files on the same filesystem.
        owner: host uid (and gid) that owns ``diff`` and ``work`` (the sandbox root's).
    """

    def __init__(self, templates: Path, owner: int):
        self.templates = Path(templates)
        self.owner = owner

    def mount(self, target: Path, quota_bytes: int) -> None:
        """Mount a fresh, empty layer filesystem with `quota_bytes` usable bytes on directory `target`.

        Raises:
            DiskUnavailable: what this host lacks (mkfs.ext4, loop devices).
        """
        template = self._template(quota_bytes)
        image = _sparse_copy(template, self.templates)
        try:
            device, device_fd = _attach_loop(image)
        finally:
            os.close(image)  # the loop device holds the file now; it has no name, so it goes with the device
        try:
            sc.mount(device, str(target), "ext4", sc.MS_NOSUID | sc.MS_NODEV, _MOUNT_OPTIONS)
            _cap_dirty(os.stat(target).st_dev)
        except OSError as e:
            if os.path.ismount(target):
                sc.umount(str(target), sc.MNT_DETACH)
            raise DiskUnavailable(f"mounting layer filesystem {device} on {target}: {e}") from None
        finally:
            os.close(device_fd)  # autoclear: from now on the mount alone holds the device

    def _template(self, quota_bytes: int) -> Path:
        """The formatted image for `quota_bytes` (sized so that its free space is the quota), made once."""
        path = self.templates / f"tpl-{quota_bytes}.img"
        if path.exists():
            return path
        mkfs = _mkfs()
        if mkfs is None:
            raise DiskUnavailable(f"{MKFS} is missing (Debian: apt-get install e2fsprogs); "
                                  "or ask for the writable layer in memory: Limits(disk_in_memory=True)")
        self.templates.mkdir(parents=True, exist_ok=True)
        want = quota_bytes + max(64 << 10, quota_bytes >> 9)  # room for the files' own extent blocks
        size = _round_up(want + MIN_IMAGE_BYTES, 1 << 20)
        with tempfile.TemporaryDirectory(dir=self.templates) as tmp:
            probe = Path(tmp) / "image"
            # ext4's metadata (bitmaps, inode tables) takes a share of the image: grow it by that share until
            # the free space is the quota
            for _ in range(6):
                free = self._format(mkfs, probe, size, Path(tmp) / "mnt")
                if free >= want:
                    break
                size = _round_up(int(want * size / free) + 4096, 1 << 16)
            else:
                raise DiskUnavailable(f"{MKFS}: no image size gives {quota_bytes} free bytes")
            os.replace(probe, path)
        return path

    def _format(self, mkfs: str, path: Path, size: int, mnt: Path) -> int:
        """mkfs `path` at `size` bytes with ``diff`` and ``work`` made in it; returns its free bytes."""
        path.unlink(missing_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)
        done = subprocess.run([mkfs, *_MKFS_ARGS, str(path)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise DiskUnavailable(f"{MKFS} {path}: {done.stderr.strip()[-500:]}")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            device, device_fd = _attach_loop(fd)
        finally:
            os.close(fd)
        mnt.mkdir(exist_ok=True)
        try:
            sc.mount(device, str(mnt), "ext4", sc.MS_NOSUID | sc.MS_NODEV, _MOUNT_OPTIONS)
        finally:
            os.close(device_fd)
        try:
            os.rmdir(mnt / "lost+found")
            os.chown(mnt, self.owner, self.owner)
            for sub in ("diff", "work"):
                (mnt / sub).mkdir()
                os.chown(mnt / sub, self.owner, self.owner)
            stat = os.statvfs(mnt)
            return stat.f_bavail * stat.f_frsize
        finally:
            sc.umount(str(mnt))


def _mkfs() -> str | None:
    """mkfs.ext4 on $PATH or in the sbin directories (a daemon's PATH often lacks them)."""
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"])
    return shutil.which(MKFS, path=path)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _sparse_copy(source: Path, directory: Path) -> int:
    """An unnamed file in `directory` with `source`'s data extents (holes stay holes); returns its fd."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(src).st_size
            offset = 0
            while offset < size:
                try:
                    data = os.lseek(src, offset, os.SEEK_DATA)
                except OSError as e:
                    if e.errno == errno_codes.ENXIO:  # no data after offset
                        break
                    raise
                hole = os.lseek(src, data, os.SEEK_HOLE)
                position = data
                while position < hole:
                    position += os.copy_file_range(src, dst, hole - position, position, position)
                offset = hole
            os.ftruncate(dst, size)
        except BaseException:
            os.close(dst)
            raise
        return dst
    finally:
        os.close(src)


def _attach_loop(backing_fd: int) -> tuple[str, int]:
    """A free loop device over `backing_fd`, direct I/O (no second page cache), detached at its last close.

    Returns:
        (device path, an open fd of it: the device stays attached while this fd or a mount holds it).
    """
    config = bytearray(_LOOP_CONFIG_BYTES)
    struct.pack_into("II", config, 0, backing_fd, 4096)
    struct.pack_into("I", config, _LO_FLAGS_OFFSET, _LO_FLAGS_AUTOCLEAR | _LO_FLAGS_DIRECT_IO)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise DiskUnavailable(f"no loop devices (/dev/loop-control: {e.strerror})") from None
    try:
        for _ in range(32):
            device = f"/dev/loop{fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)}"
            device_fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(device_fd, _LOOP_CONFIGURE, bytes(config))
            except OSError as e:
                os.close(device_fd)
                if e.errno == errno_codes.EBUSY:  # another process took it between the two calls
                    continue
                raise DiskUnavailable(f"configuring {device}: {e.strerror}") from None
            return device, device_fd
    finally:
        os.close(ctl)
    raise DiskUnavailable("no free loop device after 32 tries")


def _cap_dirty(dev: int) -> None:
    bdi = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}"
    try:
        with open(f"{bdi}/max_bytes", "w") as f:
            f.write(str(DIRTY_MAX_BYTES))
        with open(f"{bdi}/strict_limit", "w") as f:
            f.write("1")
    except OSError as e:  # kernels before 6.2 lack max_bytes: the global dirty limits apply
        log.debug("capping dirty pages of %s: %s", bdi, e)
