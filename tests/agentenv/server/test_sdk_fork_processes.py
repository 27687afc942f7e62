"""Processes and PTY sessions across our fork, snapshot and restore, through the stock `e2b` SDK; no leaks of PTY
descriptors or agent threads over many PTY sessions.

Defined behaviour (unlike E2B's fork, which checkpoints the VM's memory, processes included): a fork or a snapshot
moves the sandbox onto a new writable layer and kills every process in it. A client streaming a PTY or command of
the parent sees it end as killed (exit code -1, as after ``kill``); the parent keeps running and starts new
processes as before; forks and sandboxes restored from a snapshot start with no process, and a pid of the parent
names nothing there (``NotFoundException``). Files and the code interpreter's state do carry over.
"""

from __future__ import annotations

import os

import pytest

from tests.agentenv.server.test_sdk_pty import Screen

AGENT_COUNTS = ("for f in $(grep -la 'agentenv_envd_[w]atch' /proc/[0-9]*/cmdline); do d=${f%/cmdline}; "
                "echo $(ls $d/fd | wc -l) $(ls $d/task | wc -l) $(find $d/fd -lname '*ptmx' | wc -l); done")
"""Per envd agent in the sandbox: open descriptors, threads, PTY masters (the bracket keeps grep off itself)."""


def _pty_session(sandbox) -> tuple[int, Screen]:
    from e2b.sandbox.commands.command_handle import PtySize

    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    screen = Screen(handle)
    sandbox.pty.send_stdin(handle.pid, b"echo up-$((20 + 1))\n")
    screen.wait_for(b"up-21")
    return handle.pid, screen


def _assert_gone(sandbox, pid: int) -> None:
    from e2b import NotFoundException

    assert pid not in [p.pid for p in sandbox.commands.list()]
    with pytest.raises(NotFoundException):
        sandbox.pty.send_stdin(pid, b"echo nobody\n")
    with pytest.raises(NotFoundException):
        sandbox.pty.connect(pid)
    assert not sandbox.pty.kill(pid)


def test_fork_kills_the_parents_pty_and_forks_start_without_it(e2b_sandbox):
    from e2b import CommandExitException

    pid, screen = _pty_session(e2b_sandbox)
    background = e2b_sandbox.commands.run("sleep 300", background=True)
    (kid,) = e2b_sandbox.fork(count=1)
    try:
        ended = screen.ended()
        assert isinstance(ended, CommandExitException) and ended.exit_code == -1, ended  # as after pty.kill
        with pytest.raises(CommandExitException) as info:
            background.wait()
        assert info.value.exit_code == -1
        assert kid.commands.list() == []  # before anything runs in the fork: pid `pid` is free there
        _assert_gone(kid, pid)
        _assert_gone(e2b_sandbox, pid)
        # both go on: new PTY sessions in the parent and in the fork
        for sandbox in (e2b_sandbox, kid):
            new_pid, new_screen = _pty_session(sandbox)
            assert sandbox.pty.kill(new_pid)
            assert new_screen.ended().exit_code == -1
    finally:
        kid.kill()


def test_snapshot_kills_running_processes_and_a_restore_starts_without_them(e2b_sandbox, kill_later):
    from e2b import CommandExitException, Sandbox

    e2b_sandbox.files.write("/tmp/kept.txt", "kept")
    pid, screen = _pty_session(e2b_sandbox)
    snap = e2b_sandbox.create_snapshot()
    try:
        assert isinstance(screen.ended(), CommandExitException) and screen.result.exit_code == -1
        _assert_gone(e2b_sandbox, pid)
        restored = Sandbox.create(snap.snapshot_id, timeout=60)
        kill_later(restored)
        assert restored.commands.list() == []
        _assert_gone(restored, pid)
        assert restored.files.read("/tmp/kept.txt") == "kept"
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)


def test_many_pty_sessions_leak_no_descriptor_or_thread(e2b_sandbox, server):
    from e2b import CommandExitException
    from e2b.sandbox.commands.command_handle import PtySize

    def cycle(n: int) -> None:
        for _ in range(n):
            handle = e2b_sandbox.pty.create(PtySize(rows=24, cols=80))
            assert e2b_sandbox.pty.kill(handle.pid)
            with pytest.raises(CommandExitException):
                handle.wait()

    def counts() -> tuple[list[int], int, int]:
        (agent,) = e2b_sandbox.commands.run(AGENT_COUNTS).stdout.splitlines()
        srv = server.proc.pid
        return [int(x) for x in agent.split()], len(os.listdir(f"/proc/{srv}/fd")), len(os.listdir(f"/proc/{srv}/task"))

    pid, screen = _pty_session(e2b_sandbox)
    assert counts()[0][2] == 1  # the count sees a live session's master
    assert e2b_sandbox.pty.kill(pid)
    screen.ended()
    cycle(10)  # the agent, its pooled connections and the server's threads warmed up
    (fds0, threads0, ptys0), server_fds0, server_threads0 = counts()
    cycle(300)
    (fds1, threads1, ptys1), server_fds1, server_threads1 = counts()
    assert ptys0 == ptys1 == 0
    assert fds1 <= fds0 + 2 and threads1 <= threads0 + 1, ((fds0, threads0), (fds1, threads1))
    assert server_fds1 <= server_fds0 + 4 and server_threads1 <= server_threads0 + 2, (
        (server_fds0, server_threads0), (server_fds1, server_threads1))
