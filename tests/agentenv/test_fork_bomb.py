"""A fork bomb fills the sandbox's pids limit only up to the commands' share: the command API still answers."""

from __future__ import annotations

import time

from agentenv import Limits

BOMB = ("setsid -f python3 -c 'import os, time\nwhile True:\n try:\n  os.fork() or time.sleep(600)\n"
        " except OSError:\n  time.sleep(0.001)' >/dev/null 2>&1 </dev/null; sleep 1")
"""Takes every process slot that is or becomes free, and keeps them."""


def test_command_api_survives_a_fork_bomb(sandbox_factory):
    sb = sandbox_factory(limits=Limits(pids=64))
    sb.exec(BOMB, timeout=10)
    for _ in range(3):
        assert sb.exec("echo ok", timeout=10).stdout == "ok\n"
        assert sb.python.run("1 + 1", timeout=10).value == "2"


def test_a_fork_bomb_in_a_fork_leaves_its_parent_its_share(sandbox_factory):
    """A fork's processes count against its own share, not its parent's (nor its siblings')."""
    sb = sandbox_factory(limits=Limits(pids=64))
    kids = sb.fork(2)
    for kid in kids:
        sandbox_factory.track(kid)
    kids[0].exec(BOMB, timeout=10)
    forking = "for i in 1 2 3 4 5 6 7 8; do sleep 0.01 & done; wait; echo ok"
    for other in (sb, kids[1]):
        r = other.exec(forking, timeout=10)
        assert (r.stdout, r.stderr) == ("ok\n", ""), r
    assert kids[0].exec("echo ok", timeout=10).stdout == "ok\n"
    assert kids[0].python.run("1 + 1", timeout=10).value == "2"
    grandchild = kids[0].fork(1)[0]  # the bombed sandbox still forks, and its fork gets a share of its own
    sandbox_factory.track(grandchild)
    assert grandchild.exec(forking, timeout=10).stdout == "ok\n"


def test_commands_get_the_share_and_keep_the_hard_limit(sandbox_factory):
    """Set just after the start (a command that forks at once may get a few children in before it)."""
    sb = sandbox_factory(limits=Limits(pids=64))
    limits = sb.exec("sleep 0.2; cat /proc/self/limits").stdout.splitlines()
    line = next(x for x in limits if x.startswith("Max processes"))
    assert line.split()[2] == "56" and line.split()[3] != "56", line


def test_a_process_that_died_while_the_sandbox_idled_is_reaped_before_the_next_request(sandbox_factory):
    """pid 1 reaps before it serves: an agent that killed its processes at the pids limit gets their slots back
    for its next command, not only after that command failed to fork."""
    sb = sandbox_factory(limits=Limits(pids=64))
    pid = int(sb.exec("sleep 0.2 >/dev/null 2>&1 & echo $!").stdout)  # pid 1's child once sh exits
    time.sleep(0.6)  # it exits while no request comes (pid 1 waits up to 1 s between requests)
    state = sb.python.run(f"import os; os.path.exists('/proc/{pid}') and open('/proc/{pid}/stat').read()").value
    assert state == "False", f"process {pid} was not reaped before the next request: {state}"
