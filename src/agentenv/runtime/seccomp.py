"""Seccomp filters as classic BPF built in Python and installed with prctl(2): no libseccomp needed.

Two deny lists. `BASE_DENY` holds calls no process in a sandbox may make (kexec, bpf, keyctl, module
loading, perf, raw I/O ports, swap, clocks, reboot, ptrace and cross-process memory access); the tool
server installs it on itself, so every process of the sandbox inherits it. `AGENT_DENY` adds the calls
that rearrange namespaces and mounts (mount, pivot_root, unshare, setns, the new mount API, and clone with
namespace flags); the tool server installs it, with no_new_privs, in every command it starts. The tool
server keeps those calls because forking a sandbox needs them.

Denied calls fail with EPERM (clone3 with ENOSYS, so libc falls back to clone, whose flags the filter can
read); a foreign architecture (x32 or i386 calls on x86_64) kills the process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

from agentenv.runtime import syscalls

# seccomp_data offsets and BPF opcodes (linux/filter.h, linux/seccomp.h).
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

# Syscall numbers per machine; a name missing on a machine is simply not filtered there.
_X86_64 = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "personality": 135, "vhangup": 153, "pivot_root": 155,
    "_sysctl": 156, "adjtimex": 159, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173, "create_module": 174,
    "init_module": 175, "delete_module": 176, "quotactl": 179, "nfsservctl": 180, "lookup_dcookie": 212,
    "clock_settime": 227, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435,
    "mount_setattr": 442, "clone": 56,
}
_AARCH64 = {
    "ptrace": 117, "syslog": 116, "personality": 92, "vhangup": 58, "pivot_root": 41, "adjtimex": 171,
    "acct": 89, "settimeofday": 170, "mount": 40, "umount2": 39, "swapon": 224, "swapoff": 225, "reboot": 142,
    "init_module": 105, "delete_module": 106, "quotactl": 60, "lookup_dcookie": 18, "clock_settime": 112,
    "kexec_load": 104, "add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "perf_event_open": 241,
    "name_to_handle_at": 264, "open_by_handle_at": 265, "clock_adjtime": 266, "setns": 268,
    "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "finit_module": 273, "kexec_file_load": 294,
    "bpf": 280, "userfaultfd": 282, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "clone3": 435, "mount_setattr": 442, "clone": 220,
}
_NUMBERS = {"x86_64": _X86_64, "aarch64": _AARCH64}

BASE_DENY = (
    "kexec_load", "kexec_file_load", "bpf", "keyctl", "add_key", "request_key", "init_module", "finit_module",
    "delete_module", "create_module", "perf_event_open", "open_by_handle_at", "name_to_handle_at", "iopl",
    "ioperm", "swapon", "swapoff", "reboot", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "acct",
    "quotactl", "lookup_dcookie", "userfaultfd", "syslog", "uselib", "nfsservctl", "_sysctl", "vhangup", "kcmp",
    "process_vm_readv", "process_vm_writev", "ptrace",
)
AGENT_DENY = BASE_DENY + (
    "mount", "umount2", "pivot_root", "unshare", "setns", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
)
# clone flags that create namespaces: CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME.
_CLONE_NS_MASK = 0x7E020080


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def build_filter(deny: tuple[str, ...], *, block_namespace_clone: bool = False, machine: str | None = None) -> bytes:
    """Assemble a seccomp BPF program.

    Args:
        deny: syscall names that fail with EPERM (names unknown on `machine` are skipped).
        block_namespace_clone: also fail `clone` with namespace flags (EPERM) and `clone3` (ENOSYS).
        machine: `os.uname().machine` to build for; defaults to this machine.

    Returns:
        The program as packed `struct sock_filter` entries.

    Raises:
        ValueError: `machine` has no syscall table here.
    """
    machine = machine or os.uname().machine
    if machine not in _NUMBERS:
        raise ValueError(f"machine {machine!r} has no seccomp table; supported: {sorted(_NUMBERS)}")
    table = _NUMBERS[machine]
    denied = sorted({table[name] for name in deny if name in table and name not in ("clone", "clone3")})
    if not block_namespace_clone and "clone3" in deny:
        denied.append(table["clone3"])
    prog = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, _ARCH[machine]),
        _insn(_RET_K, 0, 0, RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if machine == "x86_64":  # x32 ABI numbers carry bit 30; refuse them all
        prog.append(_insn(_JGE_K, 0, 1, 0x40000000))
        prog.append(_insn(_RET_K, 0, 0, RET_ERRNO | errno.EPERM))
    if block_namespace_clone:
        prog.append(_insn(_JEQ_K, 0, 1, table["clone3"]))
        prog.append(_insn(_RET_K, 0, 0, RET_ERRNO | errno.ENOSYS))
        prog.append(_insn(_JEQ_K, 0, 4, table["clone"]))
        prog.append(_insn(_LD_W_ABS, 0, 0, _OFF_ARG0))
        prog.append(_insn(_JSET_K, 0, 1, _CLONE_NS_MASK))
        prog.append(_insn(_RET_K, 0, 0, RET_ERRNO | errno.EPERM))
        prog.append(_insn(_RET_K, 0, 0, RET_ALLOW))
    n = len(denied)
    for i, nr in enumerate(denied):
        # jump to the final EPERM return on a match: it sits n - i instructions past the next one
        prog.append(_insn(_JEQ_K, n - i, 0, nr))
    prog.append(_insn(_RET_K, 0, 0, RET_ALLOW))
    prog.append(_insn(_RET_K, 0, 0, RET_ERRNO | errno.EPERM))
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(program: bytes, *, no_new_privs: bool = True) -> None:
    """Install `program` (from `build_filter`) on the calling thread and its future children.

    Args:
        program: packed sock_filter entries.
        no_new_privs: set PR_SET_NO_NEW_PRIVS first (required without CAP_SYS_ADMIN; also stops setuid
            binaries from gaining privileges).
    """
    if len(program) % 8:
        raise ValueError(f"program must be whole 8-byte instructions, got {len(program)} bytes")
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if no_new_privs:
        syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
    syscalls.prctl(syscalls.PR_SET_SECCOMP, syscalls.SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(fprog)))
