"""The stock `e2b` SDK's `sandbox.pty` against our server: create, input, resize, re-attach, kill."""

from __future__ import annotations

import threading
import time

import pytest


class Screen:
    """PTY output collected from the SDK's iterator on a thread, searchable while the session runs."""

    def __init__(self, handle):
        self.handle = handle
        self.data = bytearray()
        self.lock = threading.Lock()
        self.result = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            self.result = self.handle.wait(on_pty=self._add)
        except Exception as e:  # a nonzero exit or a killed session ends here; the test reads `result`
            self.result = e

    def _add(self, chunk: bytes) -> None:
        with self.lock:
            self.data += chunk

    def ended(self) -> object:
        """What `wait` gave (a result or the exception) once the session ended."""
        self.thread.join(10)
        assert not self.thread.is_alive(), "the PTY session did not end"
        return self.result

    def wait_for(self, needle: bytes, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if needle in self.data:
                    return bytes(self.data)
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not seen in PTY output: {bytes(self.data)[-500:]!r}")


def test_pty_runs_an_interactive_shell_on_a_terminal(e2b_sandbox):
    from e2b import CommandExitException
    from e2b.sandbox.commands.command_handle import PtySize

    handle = e2b_sandbox.pty.create(PtySize(rows=30, cols=100), envs={"MARK": "pty-env"}, cwd="/tmp")
    screen = Screen(handle)
    e2b_sandbox.pty.send_stdin(handle.pid, b"tty; pwd; stty size; echo $TERM $MARK; echo \"$((6 * 7))\"\n")
    out = screen.wait_for(b"42\r\n")
    assert b"/dev/pts/" in out and b"\r\n/tmp\r\n" in out
    assert b"30 100" in out
    assert b"xterm-256color pty-env" in out
    e2b_sandbox.pty.send_stdin(handle.pid, b"exit 3\n")
    assert isinstance(screen.ended(), CommandExitException)
    assert screen.result.exit_code == 3


def test_resize_reaches_the_terminal_and_its_foreground_process(e2b_sandbox):
    from e2b.sandbox.commands.command_handle import PtySize

    handle = e2b_sandbox.pty.create(PtySize(rows=24, cols=80))
    screen = Screen(handle)
    # a foreground process that waits for SIGWINCH and then prints the terminal's size (columns, lines)
    e2b_sandbox.pty.send_stdin(handle.pid, b"python3 -c 'import os, signal; w = signal.SIGWINCH; "
                                           b"signal.pthread_sigmask(signal.SIG_BLOCK, [w]); "
                                           b"print(\"re\" \"ady\", flush=True); signal.sigwait([w]); "
                                           b"print(\"winch\", *os.get_terminal_size())'\n")
    screen.wait_for(b"ready\r\n")
    e2b_sandbox.pty.resize(handle.pid, PtySize(rows=50, cols=132))
    screen.wait_for(b"winch 132 50")
    assert e2b_sandbox.pty.kill(handle.pid)
    assert screen.ended().exit_code == -1  # killed: CommandExitException with E2B's -1


def test_reconnect_sees_later_output_and_kill_ends_the_session(e2b_sandbox):
    from e2b.sandbox.commands.command_handle import PtySize

    first = e2b_sandbox.pty.create(PtySize(rows=24, cols=80))
    pid = first.pid
    e2b_sandbox.pty.send_stdin(pid, b"echo first-$((0 + 1))\n")
    seen = b""
    for _, _, chunk in first:  # read on this thread: the sync SDK's disconnect must not race its iterator
        seen += chunk or b""
        if b"first-1\r\n" in seen:
            break
    first.disconnect()
    second = e2b_sandbox.pty.connect(pid)
    screen = Screen(second)
    e2b_sandbox.pty.send_stdin(pid, b"echo again-$((1 + 1))\n")
    screen.wait_for(b"again-2")
    assert pid in [p.pid for p in e2b_sandbox.commands.list()]
    assert e2b_sandbox.pty.kill(pid)
    assert screen.ended().exit_code == -1
    assert pid not in [p.pid for p in e2b_sandbox.commands.list()]
    assert not e2b_sandbox.pty.kill(pid)  # gone: the SDK's "not found" answer


def test_pty_input_to_a_piped_process_and_bad_sizes_are_refused(e2b_sandbox):
    from e2b import InvalidArgumentException, SandboxException
    from e2b.sandbox.commands.command_handle import PtySize

    piped = e2b_sandbox.commands.run("cat", background=True, stdin=True)
    try:
        with pytest.raises(SandboxException, match="no PTY"):
            e2b_sandbox.pty.send_stdin(piped.pid, b"x")
        with pytest.raises(SandboxException, match="no PTY"):
            e2b_sandbox.pty.resize(piped.pid, PtySize(rows=10, cols=10))
    finally:
        e2b_sandbox.commands.kill(piped.pid)
    with pytest.raises(InvalidArgumentException, match="pty.size"):
        e2b_sandbox.pty.create(PtySize(rows=70000, cols=80))


def test_session_ends_when_the_shell_exits_though_a_background_job_keeps_the_terminal(e2b_sandbox):
    from e2b.sandbox.commands.command_handle import PtySize

    handle = e2b_sandbox.pty.create(PtySize(rows=24, cols=80))
    screen = Screen(handle)
    e2b_sandbox.pty.send_stdin(handle.pid, b"sleep 60 & echo bg-$((2 + 2)); exit 5\n")
    screen.wait_for(b"bg-4")
    t0 = time.monotonic()
    assert screen.ended().exit_code == 5  # the shell's exit ends the session; the job still holds the tty
    assert time.monotonic() - t0 < 5
    e2b_sandbox.commands.run("pkill -x sleep")
