"""The persistent sessions a tool server keeps: a Python interpreter (its own globals) and a bash shell.

Stdlib only. `PythonSession` runs code in its own process, a kernel (`kernels`: one per interpreter context,
carried into every fork of the sandbox), so a fork carries every variable, import and function. `ShellSession`
drives a long-lived `bash`; since a process fork does not copy other processes, its state (variables, functions,
aliases, options, cwd) is dumped as bash source before a fork and replayed into a fresh bash in each child and
in the parent.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import os
import resource
import selectors
import shlex
import signal
import time
import traceback
from collections.abc import Callable


class _Timeout(BaseException):
    """Raised inside user code by SIGALRM; a BaseException so `except Exception` in user code won't eat it."""


class PythonSession:
    """A persistent interpreter namespace.

    With `memory_bytes` set (the sandbox's memory limit), code runs under a soft ``RLIMIT_DATA`` that leaves
    the rest of the sandbox a share of that limit: a memory bomb gets ``MemoryError`` instead of driving the
    cgroup to an OOM kill (which would end this kernel and its state).
    """

    def __init__(self) -> None:
        self.globals: dict = {"__name__": "__main__", "__builtins__": builtins}
        self.memory_bytes: int | None = None

    def run(self, code: str, timeout_s: float | None) -> dict:
        """Run `code`; return stdout, stderr, the repr of a trailing expression, and any error."""
        out, err = io.StringIO(), io.StringIO()
        value = error = None
        tb = ""
        try:
            tree = ast.parse(code, mode="exec")
        except SyntaxError:
            tb = traceback.format_exc()
            return {"stdout": "", "stderr": "", "value": None, "error": "SyntaxError", "traceback": tb}
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)

        def on_alarm(_signum: int, _frame: object) -> None:
            raise _Timeout()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        if timeout_s:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        data_limit = _cap_data(self.memory_bytes)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(tree, "<sandbox>", "exec"), self.globals)
                if last is not None:
                    result = eval(compile(last, "<sandbox>", "eval"), self.globals)
                    if result is not None:
                        value = repr(result)
        except _Timeout:
            error, tb = "TimeoutError", f"code ran past its timeout of {timeout_s} s\n"
        except BaseException as e:  # user code may raise anything, SystemExit included; report it
            error, tb = type(e).__name__, traceback.format_exc()
            if isinstance(e, MemoryError) and self.memory_bytes:
                tb += (f"(the interpreter may use about {(self.memory_bytes - HEADROOM_BYTES) >> 20} MiB of the "
                       f"sandbox's {self.memory_bytes >> 20} MiB; the sandbox and this interpreter live on)\n")
        finally:
            if data_limit is not None:
                resource.setrlimit(resource.RLIMIT_DATA, data_limit)
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return {"stdout": out.getvalue(), "stderr": err.getvalue(), "value": value, "error": error, "traceback": tb}


HEADROOM_BYTES = 48 << 20
"""What code in the interpreter leaves of the memory limit to the rest of the sandbox (agent, commands)."""


def _cap_data(memory_bytes: int | None) -> tuple[int, int] | None:
    """Lower the soft RLIMIT_DATA so this process grows by at most its share of `memory_bytes`; returns the
    limits to restore (None: nothing changed)."""
    if not memory_bytes:
        return None
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmData", "VmRSS"):
                status[key] = int(value.split()[0]) << 10
    room = max(8 << 20, memory_bytes - HEADROOM_BYTES - status.get("VmRSS", 0))
    before = resource.getrlimit(resource.RLIMIT_DATA)
    soft = status.get("VmData", 0) + room
    if before[1] != resource.RLIM_INFINITY:
        soft = min(soft, before[1])
    resource.setrlimit(resource.RLIMIT_DATA, (soft, before[1]))
    return before


class ShellSession:
    """A persistent bash fed commands through its stdin, each followed by an exit-code marker.

    Args:
        spawn: starts bash with pipes (the tool server's agent launcher: seccomp, no_new_privs).
    """

    def __init__(self, spawn: Callable[..., object]):
        self._spawn = spawn
        self._proc = None
        self._token = os.urandom(8).hex()
        self.saved_state = ""

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        self._proc = self._spawn(["/bin/bash", "--noprofile", "--norc"], stdin_pipe=True)
        if self.saved_state:
            self._send(f"eval {shlex.quote(self.saved_state)} >/dev/null 2>&1")
            self._read_result(10.0, 1 << 20)

    def _send(self, cmd: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        m = f"__AE_{self._token}"
        script = (
            f"eval {shlex.quote(cmd)} </dev/null\n"
            f"printf '\\n{m}:%d\\n' $?\nprintf '\\n{m}\\n' >&2\n"
        )
        self._proc.stdin.write(script.encode())
        self._proc.stdin.flush()

    def _read_result(self, timeout_s: float | None, max_output: int) -> dict:
        assert self._proc is not None
        m = f"__AE_{self._token}".encode()
        bufs = {"out": bytearray(), "err": bytearray()}
        done = {"out": False, "err": False}
        exit_code: int | None = None
        sel = selectors.DefaultSelector()
        sel.register(self._proc.stdout, selectors.EVENT_READ, "out")
        sel.register(self._proc.stderr, selectors.EVENT_READ, "err")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not (done["out"] and done["err"]):
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    self.close()
                    return {"timeout": True}
                events = sel.select(wait)
                for key, _ in events:
                    chunk = os.read(key.fd, 65536)
                    if not chunk:  # bash exited (e.g. the command ran `exit`)
                        code = self._proc.wait()
                        self._proc = None
                        return _shell_reply(bufs, code, max_output)
                    bufs[key.data] += chunk
                    buf = bufs[key.data]
                    if key.data == "out" and not done["out"]:
                        at = buf.rfind(b"\n" + m + b":")
                        if at >= 0 and buf.endswith(b"\n"):
                            exit_code = int(buf[at + len(m) + 2 : -1])
                            del buf[at:]
                            done["out"] = True
                    elif key.data == "err" and buf.endswith(b"\n" + m + b"\n"):
                        del buf[-len(m) - 2 :]
                        done["err"] = True
        finally:
            sel.close()
        return _shell_reply(bufs, exit_code if exit_code is not None else -1, max_output)

    def run(self, cmd: str, timeout_s: float | None, max_output: int) -> dict:
        """Run `cmd` in the session; a timeout kills the shell (its state is lost, the next call starts afresh)."""
        if self._proc is None:
            self._start()
        self._send(cmd)
        return self._read_result(timeout_s, max_output)

    def dump_state(self) -> None:
        """Capture variables, functions, aliases, options and cwd as bash source into `saved_state`."""
        if self._proc is None:
            return
        reply = self.run(
            "declare -p; declare -f; alias -p; shopt -p; set +o; printf 'cd -- %q\\n' \"$PWD\"", 10.0, 64 << 20
        )
        if reply.get("timeout"):
            return
        lines = []
        for line in reply["stdout"].splitlines():
            if line.startswith("declare -") and "r" in line.split(" ", 2)[1]:
                continue  # readonly builtins (BASHOPTS, UID, ...) cannot be reassigned
            lines.append(line)
        self.saved_state = "\n".join(lines) + "\n"

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()
        self._proc.wait()
        self._proc = None


def _shell_reply(bufs: dict, exit_code: int, max_output: int) -> dict:
    truncated = any(len(b) > max_output for b in bufs.values())
    return {
        "exit_code": exit_code,
        "stdout": bytes(bufs["out"][:max_output]).decode(errors="replace"),
        "stderr": bytes(bufs["err"][:max_output]).decode(errors="replace"),
        "truncated": truncated,
    }
