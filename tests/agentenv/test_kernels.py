"""A Python kernel per interpreter context: a crash ends that kernel only, the next run starts a fresh one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentenv import Limits, Sandbox
from agentenv.errors import NotFoundError

REPO = Path(__file__).resolve().parents[2]
_DIE_AFTER_THE_ANSWER = """
import os, sys
sys.path.insert(0, {src!r})
from agentenv import Sandbox
from agentenv.runtime.local import NamespaceBackend
backend = NamespaceBackend({home!r})
backend._add_later = lambda cg, pid: None  # the carried kernel is never moved into the child's cgroup
backend.settle = lambda sandbox_id=None: os._exit(9)  # the tool server answered; the runtime dies right after
Sandbox.connect({sid!r}, backend=backend).fork(1)
"""
SEGFAULT = "import ctypes; ctypes.string_at(0)"
EXIT = "import os; os._exit(7)"
# past the interpreter's RLIMIT_DATA guard (which would answer MemoryError): the OOM killer must pick the kernel
OOM = ("import resource; resource.setrlimit(resource.RLIMIT_DATA, (-1, -1))\n"
       "bomb = []\nwhile True:\n    bomb.append(bytearray(1 << 20))")


@pytest.mark.parametrize("code,how", [(SEGFAULT, "SIGSEGV"), (EXIT, "exited with code 7"), (OOM, "out-of-memory")],
                         ids=["segfault", "os_exit", "oom_kill"])
def test_a_dead_kernel_is_reported_and_replaced_and_nothing_else_dies(sandbox_factory, backend, code, how):
    sb = sandbox_factory(limits=Limits(memory_mb=96))
    other = sb.python.create_context()
    sb.python.run("x = 1")
    sb.python.run("y = 'kept'", context=other)
    result = sb.python.run(code, timeout=60)
    assert result.error == "DeadKernelError", result
    assert how in result.traceback and "next run in this context starts a fresh kernel" in result.traceback
    assert sb.python.run("x").error == "NameError"  # a fresh kernel: the dead one's state is gone
    assert sb.python.run("x = 2; x").value == "2"
    assert sb.python.run("y", context=other).value == "'kept'"  # the other context's kernel lives on
    assert sb.exec("echo alive").stdout == "alive\n"
    if how == "out-of-memory":
        assert backend._cgroup(sb.id).oom_kills() >= 1


def test_kernels_are_carried_over_a_fork_and_crash_on_their_own(sandbox_factory):
    sb = sandbox_factory(limits=Limits(memory_mb=128))
    ctx = sb.python.create_context(cwd="/tmp/work")
    sb.python.run("import os; x = 'parent state'")
    sb.python.run("z = 3", context=ctx)
    kids = sb.fork(2)
    for kid in kids:
        sandbox_factory.track(kid)
    first = kids[0].python.run(SEGFAULT)
    assert first.error == "DeadKernelError" and "SIGSEGV" in first.traceback, first
    assert kids[0].python.run("z + 1", context=ctx).value == "4"
    assert kids[0].python.run("import os; os.getcwd()", context=ctx).value == "'/tmp/work'"
    for s in (sb, kids[1]):
        assert s.python.run("x").value == "'parent state'"
    assert kids[1].python.run("os.getpid() != 1").value == "True"  # its own process in the child's pid namespace
    assert sb.python.run("z", context=ctx).value == "3"


def test_contexts_can_be_listed_restarted_and_removed(sandbox):
    ctx = sandbox.python.create_context(cwd="/tmp")
    assert [c["id"] for c in sandbox.python.contexts()] == ["default", ctx]
    sandbox.python.run("a = 1", context=ctx)
    sandbox.python.restart_context(ctx)
    assert sandbox.python.run("a", context=ctx).error == "NameError"
    assert sandbox.python.run("import os; os.environ['E']", context=ctx, envs={"E": "v"}).value == "'v'"
    assert sandbox.python.run("os.environ.get('E')", context=ctx).value is None  # envs last one run
    sandbox.python.remove_context(ctx)
    with pytest.raises(NotFoundError):
        sandbox.python.run("1", context=ctx)
    with pytest.raises(NotFoundError):
        sandbox.python.restart_context("nope")
    with pytest.raises(ValueError, match="context"):
        sandbox.python.run("1", context=3)
    with pytest.raises(ValueError, match="envs"):
        sandbox.python.run("1", envs={"E": 1})


def test_gc_moves_a_carried_kernel_its_dead_runtime_left_in_the_parents_cgroup(sandbox_factory, backend):
    sb = sandbox_factory(limits=Limits(memory_mb=128))
    sb.python.run("x = 'carried'")
    code = _DIE_AFTER_THE_ANSWER.format(src=str(REPO / "src"), home=str(backend.store.home), sid=sb.id)
    subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert backend.gc()["forks"] == 1
    (rec,) = [r for r in backend.store.all_records() if r.parent == sb.id and r.kind == "sandbox"]
    kid = Sandbox.connect(rec.id, backend=backend)
    sandbox_factory.track(kid)
    assert kid.python.run("x").value == "'carried'"
    child_ns = os.readlink(f"/proc/{rec.pid}/ns/pid")
    in_child = {int(p) for p in os.listdir("/proc") if p.isdigit() and _pid_ns(p) == child_ns}
    assert len(in_child) >= 2 and in_child <= set(backend._cgroup(rec.id).pids()), in_child


def _pid_ns(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def test_a_sandbox_retired_under_its_fork_keeps_no_kernel(sandbox_factory, backend):
    sb = sandbox_factory()
    sb.python.run("x = 1")
    kid = sb.fork(1)[0]
    sandbox_factory.track(kid)
    rec = backend.store.read_record(sb.id)
    sb.destroy()  # retired, not gone: its fork nests in its namespaces
    assert backend.store.read_record(sb.id).kind == "retired"
    own_ns = _pid_ns(str(rec.pid))

    def in_own_ns():
        return {int(p) for p in os.listdir("/proc") if p.isdigit() and _pid_ns(p) == own_ns}

    # the host may list a killed process for a moment after the tool server stopped waiting for it (seen under the
    # full suite's load, never alone): it must be gone soon, and only the tool server may stay
    deadline = time.monotonic() + 5.0
    while in_own_ns() != {rec.pid} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert in_own_ns() == {rec.pid}
    assert kid.python.run("x").value == "1"
