import pytest

from agentenv import Sandbox, SandboxNotFoundError


def _track(factory, sandboxes):
    for sb in sandboxes:
        factory.track(sb)
    return sandboxes


def test_fork_keeps_python_shell_and_files(sandbox_factory):
    parent = sandbox_factory()
    parent.python.run("import collections\ncounter = collections.Counter(a=41)")
    parent.shell.run("cd /tmp && export LEVEL=deep && hello() { echo hello $1; }")
    parent.files.write("/root/state.txt", "v1")
    (child,) = _track(sandbox_factory, parent.fork(1))
    assert child.id != parent.id
    assert child.python.run("counter['a'] + 1").value == "42"
    assert child.shell.run("echo $PWD $LEVEL; hello child").stdout == "/tmp deep\nhello child\n"
    assert child.files.read("/root/state.txt") == "v1"


def test_forks_are_isolated_from_parent_and_each_other(sandbox_factory):
    parent = sandbox_factory()
    parent.files.write("/root/f", "parent")
    parent.python.run("x = 'parent'")
    kids = _track(sandbox_factory, parent.fork(3))
    for i, kid in enumerate(kids):
        kid.files.write("/root/f", f"kid{i}")
        kid.python.run(f"x = 'kid{i}'")
    assert parent.files.read("/root/f") == "parent" and parent.python.run("x").value == "'parent'"
    for i, kid in enumerate(kids):
        assert kid.files.read("/root/f") == f"kid{i}"
        assert kid.python.run("x").value == f"'kid{i}'"
        # own pid namespace: the tool server, its launcher, its Python kernel, and this pipeline (sh, ls, grep)
        assert int(kid.exec("ls /proc | grep -c '^[0-9]'").stdout) <= 6


def test_parent_keeps_working_after_fork_and_can_fork_again(sandbox_factory):
    parent = sandbox_factory()
    parent.files.write("/root/a", "1")
    _track(sandbox_factory, parent.fork(1))
    parent.files.write("/root/a", "2")
    (second,) = _track(sandbox_factory, parent.fork(1))
    assert second.files.read("/root/a") == "2"
    (grandchild,) = _track(sandbox_factory, second.fork(1))
    assert grandchild.files.read("/root/a") == "2"


def test_destroying_parent_keeps_forks_alive(sandbox_factory, backend):
    parent = Sandbox.create(backend=backend)
    parent.python.run("v = 7")
    kids = _track(sandbox_factory, parent.fork(2))
    parent.destroy()
    assert [k.python.run("v").value for k in kids] == ["7", "7"]
    with pytest.raises(SandboxNotFoundError):
        Sandbox.connect(parent.id, backend=backend)


def test_snapshot_restores_files_and_interpreter_many_times(sandbox_factory, backend):
    sb = sandbox_factory()
    sb.files.write("/root/data", "snap")
    sb.python.run("seen = ['before']")
    snap = sb.snapshot()
    sb.files.write("/root/data", "after")
    sb.python.run("seen.append('after')")
    restored = [Sandbox.restore(snap, backend=backend) for _ in range(2)]
    _track(sandbox_factory, restored)
    for r in restored:
        assert r.files.read("/root/data") == "snap"
        assert r.python.run("seen").value == "['before']"
    restored[0].files.write("/root/data", "changed")
    assert restored[1].files.read("/root/data") == "snap"
    sb.destroy()
    again = _track(sandbox_factory, [Sandbox.restore(snap, backend=backend)])[0]
    assert again.files.read("/root/data") == "snap"
    backend.destroy(snap)
    with pytest.raises(SandboxNotFoundError):
        Sandbox.restore(snap, backend=backend)


def test_create_from_snapshot_id(sandbox_factory, backend):
    sb = sandbox_factory()
    sb.python.run("k = 3")
    snap = sb.snapshot()
    other = sandbox_factory(snap)
    assert other.python.run("k").value == "3"
    backend.destroy(snap)


def test_pause_and_resume(sandbox_factory):
    sb = sandbox_factory()
    sb.pause()
    sb.resume()
    assert sb.exec("echo thawed").stdout == "thawed\n"


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_bad_fork_count_raises_value_error(sandbox, n):
    with pytest.raises(ValueError, match="n must"):
        sandbox.fork(n)


@pytest.mark.slow
def test_fork_depth_limit_gives_a_clear_error_and_sandbox_survives(sandbox_factory, backend):
    current = sandbox_factory()
    with pytest.raises(ValueError, match="fork depth limit"):
        for level in range(40):
            current.files.write("/root/level", str(level))  # every fork seals a layer and moves the parent
            (current,) = _track(sandbox_factory, current.fork(1))
    assert current.exec("echo still here").stdout == "still here\n"
    # the failed fork did not move the sandbox: its record still names the layer it writes to
    current.files.write("/root/after", "x")
    upper = backend.store.read_record(current.id).upper
    assert (backend.store.diff(upper) / "root" / "after").read_text() == "x"


def test_snapshot_of_unchanged_sandbox_and_snapshot_of_a_restore(sandbox_factory, backend):
    sb = sandbox_factory()
    sb.python.run("depth = 0")
    first = sb.snapshot()  # nothing written yet: no layer to seal
    restored = _track(sandbox_factory, [Sandbox.restore(first, backend=backend)])[0]
    restored.files.write("/root/level", "1")
    restored.python.run("depth += 1")
    second = restored.snapshot()
    restored.files.write("/root/level", "changed after the snapshot")
    again = _track(sandbox_factory, [Sandbox.restore(second, backend=backend)])[0]
    assert again.files.read("/root/level") == "1" and again.python.run("depth").value == "1"
    assert "sleep" not in again.exec("ps -eo comm").stdout
    for snap in (second, first):
        backend.destroy(snap)
