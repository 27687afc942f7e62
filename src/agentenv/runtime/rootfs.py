"""Entering a sandbox root: overlayfs stack, /dev (own devpts), /proc, optional read-only host /usr, pivot_root.

Stdlib only; used by the tool server at first start and when it forks. The host builds each overlay as a
*detached* mount (fsopen/fsmount, as real root, from layer paths the sandbox cannot see) and passes the
mount fd over the control socket; the tool server attaches it with move_mount inside its own mount
namespace. (Layer paths passed as fds would not do: overlayfs refuses layers from another mount
namespace.) The new root is attached over `/dev` of the current root (a directory every sandbox root has),
populated, and entered with `pivot_root(".", ".")` and a lazy detach of the old root, so no directory in any
layer is created for the purpose.
"""

from __future__ import annotations

import os

from agentenv.runtime import syscalls as sc

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
"""Device nodes bound into every sandbox's /dev (from the host's, or the parent sandbox's, /dev)."""


def overlay_fd(lowers: list[str], upper: str, work: str) -> int:
    """A detached overlay mount (host side, as real root): `lowers` top first, `upper`/`work` writable."""
    options: list[tuple[str, str | None]] = [("lowerdir+", path) for path in lowers]
    options += [("upperdir", upper), ("workdir", work), ("userxattr", None)]
    return sc.fsmount_detached("overlay", options, sc.MOUNT_ATTR_NODEV)


def enter_root(
    root_fd: int,
    *,
    usr_bind: bool,
    mount_proc: bool = True,
    hostname: str | None = None,
) -> None:
    """Mount the overlay stack and pivot into it; the caller must own a fresh mount namespace.

    Args:
        root_fd: the detached overlay mount (from `overlay_fd`) to become the root.
        usr_bind: bind the current root's /usr read-only (nosuid, nodev) over the sandbox's /usr.
        mount_proc: mount a fresh /proc (the caller must be inside the sandbox's pid namespace).
        hostname: set the UTS hostname (the caller must own a fresh UTS namespace).
    """
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
    old_dev = os.open("/dev", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    old_usr = os.open("/usr", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if usr_bind else -1
    try:
        sc.move_mount_fd(root_fd, "/dev")
        os.chdir("/dev")
        for name in ("dev", "proc", "usr", "tmp"):
            if not os.path.isdir(name):
                os.mkdir(name, 0o1777 if name == "tmp" else 0o755)
        sc.mount("tmpfs", "dev", "tmpfs", sc.MS_NOSUID | sc.MS_NOEXEC, "mode=755,size=1m")
        for name in DEVICES:
            source = f"/proc/self/fd/{old_dev}/{name}"
            if os.path.exists(source):
                with open(f"dev/{name}", "w"):
                    pass
                sc.mount(source, f"dev/{name}", None, sc.MS_BIND)
        os.mkdir("dev/shm", 0o1777)
        os.mkdir("dev/pts", 0o755)
        # a private devpts instance (PTYs for `sandbox.pty`): the sandbox sees only its own terminals, and
        # /dev/ptmx opens this instance's multiplexer
        sc.mount("devpts", "dev/pts", "devpts", sc.MS_NOSUID | sc.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
        os.symlink("pts/ptmx", "dev/ptmx")
        for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
            os.symlink(target, f"dev/{link}")
        if usr_bind:
            sc.mount(f"/proc/self/fd/{old_usr}", "usr", None, sc.MS_BIND | sc.MS_REC)
            sc.mount(None, "usr", None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | sc.MS_NOSUID | sc.MS_NODEV)
        if mount_proc:
            sc.mount("proc", "proc", "proc", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC)
    finally:
        os.close(old_dev)
        if old_usr >= 0:
            os.close(old_usr)
    sc.pivot_root(".", ".")
    sc.umount(".", sc.MNT_DETACH)
    os.chdir("/")
    if hostname:
        sc.sethostname(hostname)


def loopback_up() -> None:
    """Bring up `lo` in the current (fresh) network namespace: the only interface a sandbox gets by default."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), siocgifflags, ifreq))[1]
        fcntl.ioctl(s.fileno(), siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))
