"""A runtime killed in the middle of a fork: the next runtime's gc finds the fork complete or undone."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

from agentenv import Sandbox

REPO = Path(__file__).resolve().parents[2]

_DIE_BEFORE_MOVE = """
import os, sys
sys.path.insert(0, {src!r})
from agentenv import Sandbox
from agentenv.runtime import client
from agentenv.runtime.local import NamespaceBackend
backend = NamespaceBackend({home!r})
sb = Sandbox.connect({sid!r}, backend=backend)
sb.exec("echo changed > /root/changed")
def die(self, msg, fds=()):
    os._exit(9)  # the tool server answered the fork and waits for its new root: it never comes
client.Connection.send = die
sb.fork(2)
"""

_DIE_CARRYING_KERNELS = """
import os, sys
sys.path.insert(0, {src!r})
from agentenv import Sandbox
from agentenv.runtime.local import NamespaceBackend
backend = NamespaceBackend({home!r})
sb = Sandbox.connect({sid!r}, backend=backend)
sb.exec("echo changed > /root/changed")
def die(self, cg, pid):
    os._exit(9)  # told of the first kernel carried into a child; the tool server still carries the others
NamespaceBackend._add_later = die
sb.fork(2)
"""

_FORK_FOREVER = """
import sys
sys.path.insert(0, {src!r})
from agentenv import Sandbox
from agentenv.runtime.local import NamespaceBackend
backend = NamespaceBackend({home!r})
sb = Sandbox.connect({sid!r}, backend=backend)
print("ready", flush=True)
for i in range(1000):
    sb.exec(f"echo {{i}} >> /root/count")
    sb.fork(2)
"""


def _run(script: str, backend, sid: str, *, kill_after_s: float | None = None) -> None:
    code = script.format(src=str(REPO / "src"), home=str(backend.store.home), sid=sid)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if kill_after_s is None:
            proc.wait(timeout=60)
        else:
            proc.stdout.readline()
            time.sleep(kill_after_s)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _children(backend, sid: str) -> list:
    return [r for r in backend.store.all_records() if r.parent == sid and r.kind == "sandbox"]


def test_runtime_dying_before_the_move_undoes_the_fork(sandbox_factory, backend):
    sb = sandbox_factory()
    sb.files.write("/root/f", "before")
    layer_before = backend.store.read_record(sb.id).upper
    _run(_DIE_BEFORE_MOVE, backend, sb.id)
    assert list(backend.store.forks.glob("*.json")), "the killed runtime left no note of its fork"
    assert backend.gc()["forks"] == 1
    assert _children(backend, sb.id) == []  # the tool server killed them; gc dropped their records
    assert backend.store.read_record(sb.id).upper == layer_before  # the parent stays on its layer
    assert sb.files.read("/root/f") == "before" and sb.files.read("/root/changed") == "changed\n"
    sb.files.write("/root/after", "still writable")
    (kid,) = sb.fork(1)
    sandbox_factory.track(kid)
    assert kid.files.read("/root/after") == "still writable"


def test_runtime_killed_at_random_instants_mid_fork_leaves_complete_forks_only(sandbox_factory, backend):
    rng = random.Random(7)
    sb = sandbox_factory()
    sb.files.write("/root/f", "mine")
    for _ in range(6):
        _run(_FORK_FOREVER, backend, sb.id, kill_after_s=rng.uniform(0.0, 0.15))
        backend.gc()
        assert not list(backend.store.forks.glob("*.json"))
        count = sb.exec("cat /root/count").stdout
        for rec in _children(backend, sb.id):
            kid = Sandbox.connect(rec.id, backend=backend)
            try:  # a kept fork is whole: it answers, with the parent's files as of the fork
                assert kid.files.read("/root/f") == "mine"
                assert count.startswith(kid.exec("cat /root/count").stdout)
                assert backend.store.read_record(kid.id).pid in backend._cgroup(kid.id).pids()
            finally:
                kid.destroy()
        assert sb.files.read("/root/f") == "mine"



def _undone(backend, sb, layer_before: str) -> None:
    """The fork is undone: no child, the parent on its layer (writes land in the layer its record names),
    its files and its kernels' state kept."""
    assert sb.python.run("x", timeout=5).value == "42"  # first, bounded: a parent stuck in the rollback hangs
    assert _children(backend, sb.id) == []
    rec = backend.store.read_record(sb.id)
    assert rec.upper == layer_before
    assert sb.files.read("/root/f") == "before" and sb.files.read("/root/changed") == "changed\n"
    sb.files.write("/root/after", "still writable")
    assert (backend.store.diff(rec.upper) / "root" / "after").read_text() == "still writable"


def test_runtime_dying_before_the_move_undoes_the_fork_of_a_sandbox_with_a_kernel(sandbox_factory, backend):
    # the kernel's copy in each child is the parent tool server's child: the rollback must reap it, or the
    # killed child (pid 1 of its namespace) never exits and the parent waits for it forever
    sb = sandbox_factory()
    sb.files.write("/root/f", "before")
    sb.python.run("x = 6 * 7")
    layer_before = backend.store.read_record(sb.id).upper
    _run(_DIE_BEFORE_MOVE, backend, sb.id)
    assert backend.gc()["forks"] == 1
    _undone(backend, sb, layer_before)


def test_runtime_dying_while_kernels_are_carried_undoes_the_fork(sandbox_factory, backend):
    # the tool server cannot tell the host a carried kernel's pid: the fork was never answered, so it is
    # undone (not kept as done while the parent stays on the layer its children now read)
    sb = sandbox_factory()
    sb.files.write("/root/f", "before")
    sb.python.run("x = 6 * 7")
    for _ in range(3):
        sb.python.run("y = 1", context=sb.python.create_context())
    layer_before = backend.store.read_record(sb.id).upper
    _run(_DIE_CARRYING_KERNELS, backend, sb.id)
    assert backend.gc()["forks"] == 1
    _undone(backend, sb, layer_before)
