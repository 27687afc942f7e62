"""Thin ctypes wrappers over the Linux calls Python 3.11 lacks: unshare, setns, mount, pivot_root, prctl.

Stdlib only: the in-sandbox tool server imports this module before it pivots into the sandbox root.
Every wrapper raises `OSError` with the errno and the call's arguments, so a failure names what was tried.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
SECCOMP_MODE_FILTER = 2

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """The C library, loaded on first use (never at import)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _check(result: int, what: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return result


def unshare(flags: int) -> None:
    """unshare(2) with CLONE_* `flags`."""
    _check(libc().unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def setns(fd: int, nstype: int = 0) -> None:
    """setns(2): join the namespace behind `fd`."""
    _check(libc().setns(ctypes.c_int(fd), ctypes.c_int(nstype)), f"setns({fd}, {nstype:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    """mount(2); `source`, `fstype` and `data` may be None."""

    def enc(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    _check(
        libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x}, {data!r})",
    )


def umount(target: str, flags: int = 0) -> None:
    """umount2(2)."""
    _check(libc().umount2(os.fsencode(target), ctypes.c_int(flags)), f"umount2({target!r}, {flags})")


def pivot_root(new_root: str, put_old: str) -> None:
    """pivot_root(2) through syscall(2): glibc has no wrapper."""
    nr = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
    if nr is None:
        raise OSError(38, f"pivot_root: unsupported machine {os.uname().machine}")
    _check(libc().syscall(ctypes.c_long(nr), os.fsencode(new_root), os.fsencode(put_old)), f"pivot_root({new_root!r})")


def prctl(option: int, arg2: int = 0, arg3: int | ctypes.c_void_p = 0, arg4: int = 0, arg5: int = 0) -> int:
    """prctl(2) with integer arguments (or a pointer as `arg3`)."""
    arg3_c = arg3 if isinstance(arg3, ctypes.c_void_p) else ctypes.c_ulong(arg3)
    return _check(
        libc().prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), arg3_c, ctypes.c_ulong(arg4), ctypes.c_ulong(arg5)),
        f"prctl({option})",
    )


def sethostname(name: str) -> None:
    """sethostname(2) (inside a fresh UTS namespace)."""
    raw = name.encode()
    _check(libc().sethostname(raw, ctypes.c_size_t(len(raw))), f"sethostname({name!r})")


_NR = {
    "x86_64": {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432},
    "aarch64": {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432},
}
FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100


def _nr(name: str) -> int:
    table = _NR.get(os.uname().machine)
    if table is None:
        raise OSError(38, f"{name}: unsupported machine {os.uname().machine}")
    return table[name]


def fsmount_detached(fstype: str, options: list[tuple[str, str | None]], attrs: int = 0) -> int:
    """Create a filesystem and return a detached mount of it (fsopen/fsconfig/fsmount), close-on-exec.

    Args:
        fstype: e.g. ``overlay``.
        options: ``(key, value)`` in order; value None sets a flag. Each value is at most 256 bytes.
        attrs: MOUNT_ATTR_* for the mount.

    Returns:
        A mount fd; `move_mount_fd` attaches it, in this or another (child) mount namespace.
    """
    lib = libc()
    fs = _check(lib.syscall(ctypes.c_long(_nr("fsopen")), fstype.encode(), ctypes.c_uint(1)), f"fsopen({fstype!r})")
    try:
        # one call per option (a fork's overlay has one per layer): convert the constant arguments once
        syscall, nr, fd, zero = lib.syscall, ctypes.c_long(_nr("fsconfig")), ctypes.c_int(fs), ctypes.c_int(0)
        set_flag, set_string = ctypes.c_uint(FSCONFIG_SET_FLAG), ctypes.c_uint(FSCONFIG_SET_STRING)
        for key, value in options:
            if value is None:
                res = syscall(nr, fd, set_flag, key.encode(), None, zero)
            else:
                res = syscall(nr, fd, set_string, key.encode(), os.fsencode(value), zero)
            if res < 0:
                _check(res, f"fsconfig({fstype}, {key}={value!r})")
        _check(lib.syscall(ctypes.c_long(_nr("fsconfig")), ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_CMD_CREATE),
                           None, None, ctypes.c_int(0)), f"fsconfig({fstype}, create)")
        return _check(lib.syscall(ctypes.c_long(_nr("fsmount")), ctypes.c_int(fs), ctypes.c_uint(1),
                                  ctypes.c_uint(attrs)), f"fsmount({fstype})")
    finally:
        os.close(fs)


def move_mount_fd(mount_fd: int, target: str) -> None:
    """Attach the detached mount `mount_fd` at `target` (move_mount with MOVE_MOUNT_F_EMPTY_PATH)."""
    _check(libc().syscall(ctypes.c_long(_nr("move_mount")), ctypes.c_int(mount_fd), b"", ctypes.c_int(AT_FDCWD),
                          os.fsencode(target), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount(-> {target!r})")


def fork_into_namespaces(flags: int) -> int:
    """fork(2) straight into new namespaces: clone(2) with CLONE_NEW* `flags` and no new stack.

    One clone replaces unshare + fork (a pid namespace only applies to children), which matters because
    each fork copies the page tables of the whole interpreter (tens of ms for a few hundred MB here).
    Python's own fork hooks run around it (PyOS_BeforeFork / AfterFork_*), as for `os.fork`. The
    caller must be single-threaded. glibc's cached thread id in the child keeps the parent's value, so
    the child must not use pthread_kill/raise (Python's signal delivery does not).

    Returns:
        0 in the child (pid 1 of its new pid namespace when CLONE_NEWPID is set), the child's pid in the parent.
    """
    nr = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)
    if nr is None:
        raise OSError(38, f"clone: unsupported machine {os.uname().machine}")
    sigchld = 17
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = libc().syscall(ctypes.c_long(nr), ctypes.c_ulong(flags | sigchld), None, None, None, None)
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    errno = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(errno, f"clone({flags:#x}): {os.strerror(errno)}")
    return pid
