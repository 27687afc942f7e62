"""Control plane through the stock SDK: create/list/info/timeout/pause/resume/snapshot/fork/kill."""

from __future__ import annotations

import time

import pytest


def test_create_info_and_kill(e2b_env):
    from e2b import Sandbox

    sb = Sandbox.create(metadata={"run": "t1"}, timeout=60)
    info = sb.get_info()
    assert info.sandbox_id == sb.sandbox_id and info.metadata == {"run": "t1"}
    assert info.state.value == "running"
    assert 55 <= (info.end_at - info.started_at).total_seconds() <= 61
    assert sb.is_running()
    assert sb.kill() is True
    assert Sandbox.kill(sb.sandbox_id) is False  # already gone
    assert not sb.is_running()


def test_list_filters_and_paginates(e2b_env, kill_later):
    from e2b import Sandbox, SandboxQuery

    tag = f"page-{time.monotonic_ns()}"
    made = [Sandbox.create(metadata={"tag": tag}, timeout=60) for _ in range(5)]
    for sb in made:
        kill_later(sb)
    paginator = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}), limit=2)
    pages = []
    while paginator.has_next:
        pages.append([s.sandbox_id for s in paginator.next_items()])
    assert [len(p) for p in pages] == [2, 2, 1]
    assert sorted(sum(pages, [])) == sorted(sb.sandbox_id for sb in made)


def test_set_timeout_moves_the_deadline_and_the_reaper_kills(e2b_env):
    from e2b import Sandbox

    sb = Sandbox.create(timeout=60)
    sb.set_timeout(2)
    end = sb.get_info().end_at
    assert (end.timestamp() - time.time()) < 3
    deadline = time.monotonic() + 15
    while sb.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sb.is_running()
    assert Sandbox.kill(sb.sandbox_id) is False


def test_pause_resume_keeps_files_and_processes(e2b_sandbox):
    from e2b import Sandbox

    e2b_sandbox.files.write("/tmp/keep.txt", "kept")
    handle = e2b_sandbox.commands.run("sleep 60", background=True)
    handle.disconnect()
    assert e2b_sandbox.pause() is True
    assert e2b_sandbox.pause() is False  # already paused: 409
    assert Sandbox.get_info(e2b_sandbox.sandbox_id).state.value == "paused"
    resumed = Sandbox.connect(e2b_sandbox.sandbox_id)
    assert resumed.get_info().state.value == "running"
    assert resumed.files.read("/tmp/keep.txt") == "kept"
    assert handle.pid in [p.pid for p in resumed.commands.list()]


def test_snapshot_then_create_from_it(e2b_sandbox, kill_later):
    from e2b import Sandbox

    e2b_sandbox.files.write("/tmp/state.txt", "v1")
    snap = e2b_sandbox.create_snapshot()
    try:
        e2b_sandbox.files.write("/tmp/state.txt", "v2")
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        restored = Sandbox.create(snap.snapshot_id, timeout=60)
        kill_later(restored)
        assert restored.files.read("/tmp/state.txt") == "v1"
        assert e2b_sandbox.files.read("/tmp/state.txt") == "v2"
    finally:
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False


def test_named_snapshot_resolves_by_name(e2b_sandbox, kill_later):
    from e2b import Sandbox

    name = f"snap{time.monotonic_ns()}"
    e2b_sandbox.files.write("/tmp/n.txt", "named")
    snap = e2b_sandbox.create_snapshot(name=name)
    try:
        assert snap.names == [name]
        restored = Sandbox.create(name, timeout=60)
        kill_later(restored)
        assert restored.files.read("/tmp/n.txt") == "named"
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)


def test_fork_copies_files_and_diverges(e2b_sandbox):
    e2b_sandbox.files.write("/tmp/f.txt", "parent")
    kids = e2b_sandbox.fork(count=2)
    try:
        assert len(kids) == 2
        for kid in kids:
            assert kid.files.read("/tmp/f.txt") == "parent"
        kids[0].files.write("/tmp/f.txt", "kid0")
        assert kids[1].files.read("/tmp/f.txt") == "parent"
        assert e2b_sandbox.files.read("/tmp/f.txt") == "parent"
        assert e2b_sandbox.commands.run("echo parent-alive").stdout == "parent-alive\n"
    finally:
        for kid in kids:
            kid.kill()


def test_metrics_report_limits_and_memory_use(e2b_sandbox):
    e2b_sandbox.commands.run("true")  # a fresh fork is still charged to its seed; the agent is not
    (metric,) = e2b_sandbox.get_metrics()
    assert metric.cpu_count >= 1 and metric.mem_total == 512 << 20
    assert 0 < metric.mem_used < metric.mem_total


def test_unknown_template_is_not_found(e2b_env):
    from e2b import Sandbox, SandboxException

    with pytest.raises(SandboxException, match="not found"):
        Sandbox.create("no-such-template")


def test_paused_sandbox_does_not_time_out(e2b_env):
    from e2b import Sandbox

    sb = Sandbox.create(timeout=60)
    try:
        sb.set_timeout(1)
        sb.pause()
        time.sleep(2.5)  # past its deadline while paused: the reaper must leave it alone
        resumed = Sandbox.connect(sb.sandbox_id, timeout=30)
        assert resumed.commands.run("echo still-here").stdout == "still-here\n"
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_connect_to_a_killed_sandbox_is_not_found(e2b_env):
    from e2b import Sandbox, SandboxNotFoundException

    sb = Sandbox.create(timeout=60)
    sb.kill()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sb.sandbox_id)
