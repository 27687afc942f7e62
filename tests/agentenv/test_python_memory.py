"""A memory bomb in the persistent interpreter gets MemoryError; the sandbox and the interpreter live on."""

from __future__ import annotations

from agentenv import Limits

BOMB = "bomb = []\nwhile True:\n    bomb.append(bytearray(1 << 20))"


def test_memory_bomb_in_python_gets_memory_error_and_the_sandbox_lives(sandbox_factory, backend):
    sb = sandbox_factory(limits=Limits(memory_mb=128))
    sb.python.run("kept = 41")
    result = sb.python.run(BOMB, timeout=60)
    assert result.error == "MemoryError", result
    assert "live on" in result.traceback
    assert backend._cgroup(sb.id).oom_kills() == 0
    assert sb.python.run("del bomb; kept + 1").value == "42"  # same interpreter, its state kept
    assert sb.exec("echo alive").stdout == "alive\n"
    big = sb.python.run("len(bytearray(40 << 20))")  # the limit is lifted between runs and fits real work
    assert big.value == str(40 << 20), big


def test_memory_bomb_in_a_fork_leaves_the_parent_and_siblings(sandbox_factory):
    sb = sandbox_factory(limits=Limits(memory_mb=96))
    sb.python.run("x = 'state'")
    kids = sb.fork(2)
    for kid in kids:
        sandbox_factory.track(kid)
    assert kids[0].python.run(BOMB, timeout=60).error == "MemoryError"
    for s in (sb, *kids):
        assert s.python.run("x").value == "'state'"
