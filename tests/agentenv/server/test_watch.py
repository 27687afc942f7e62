"""Directory watches: `WatchHub`/`DirWatch` (one inotify instance for all watches, and the polling fallback) on
host directories, then through the stock SDK in a sandbox (recursive, renames, chmod, changes faster than any
poll, more watches than the host's inotify instance limit, the fallback). ``include_entry`` is in
`test_sdk_file_metadata.py`."""

from __future__ import annotations

import os
import time

import pytest

from agentenv.server.watch import DirWatch, WatchHub

CREATE, WRITE, REMOVE, RENAME, CHMOD = (f"EVENT_TYPE_{k}" for k in ("CREATE", "WRITE", "REMOVE", "RENAME", "CHMOD"))


@pytest.fixture(params=[True, False], ids=["inotify", "polling"])
def hub(request):
    with WatchHub(use_inotify=request.param) as h:
        assert (h.fd >= 0) == request.param and (h.interval is None) == request.param
        yield h


@pytest.fixture
def inotify_hub():
    with WatchHub() as h:
        assert h.fd >= 0
        yield h


def _drain(w: DirWatch, until: tuple[str, str], timeout: float = 5.0) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    while True:
        seen += w.events()
        if until in seen or time.monotonic() > deadline:
            return seen
        time.sleep(0.01)


@pytest.mark.no_runtime
def test_dir_watch_reports_what_changed(tmp_path, hub):
    with hub.watch(str(tmp_path), recursive=True) as w:
        (tmp_path / "a.txt").write_text("1")
        os.makedirs(tmp_path / "d" / "e")
        (tmp_path / "d" / "e" / "deep.txt").write_text("x")
        seen = _drain(w, ("d/e/deep.txt", CREATE))
        assert ("a.txt", CREATE) in seen and ("d", CREATE) in seen and ("d/e", CREATE) in seen
        time.sleep(0.02)  # a later mtime for the poller
        (tmp_path / "d" / "e" / "deep.txt").write_text("xy")
        os.chmod(tmp_path / "a.txt", 0o600)
        seen = _drain(w, ("a.txt", CHMOD))
        assert ("d/e/deep.txt", WRITE) in seen
        os.unlink(tmp_path / "d" / "e" / "deep.txt")
        assert ("d/e/deep.txt", REMOVE) in _drain(w, ("d/e/deep.txt", REMOVE))


@pytest.mark.no_runtime
def test_inotify_follows_a_directory_moved_within_the_tree(tmp_path, inotify_hub):
    os.makedirs(tmp_path / "old" / "sub")
    with inotify_hub.watch(str(tmp_path), recursive=True) as w:
        os.rename(tmp_path / "old", tmp_path / "new")
        seen = _drain(w, ("new", CREATE))
        assert ("old", RENAME) in seen
        (tmp_path / "new" / "sub" / "f").write_text("1")  # reported under its new path
        assert ("new/sub/f", CREATE) in _drain(w, ("new/sub/f", CREATE))


@pytest.mark.no_runtime
def test_non_recursive_watch_ignores_subdirectories(tmp_path, hub):
    os.makedirs(tmp_path / "sub")
    with hub.watch(str(tmp_path), recursive=False) as w:
        (tmp_path / "sub" / "hidden.txt").write_text("1")
        (tmp_path / "top.txt").write_text("1")
        seen = _drain(w, ("top.txt", CREATE))
    assert [name for name, _ in seen if name.startswith("sub/")] == []


@pytest.mark.no_runtime
def test_notify_descriptor_is_readable_while_events_wait(tmp_path, hub):
    import select

    with hub.watch(str(tmp_path), recursive=False, notify=True) as w:
        assert select.select([w.fd], [], [], 0.2)[0] == []  # nothing happened yet
        (tmp_path / "f").write_text("1")
        assert select.select([w.fd], [], [], 5)[0] == [w.fd]  # a stream's select wakes (inotify or a scan)
        assert ("f", CREATE) in _drain(w, ("f", CREATE))
        time.sleep(0.12)  # past two scans of the poller
        w.events()
        assert select.select([w.fd], [], [], 0)[0] == []  # drained with the events


def _inotify_fds(pid: int | str = "self") -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify"
        except OSError:
            continue
    return count


@pytest.mark.no_runtime
def test_one_instance_serves_more_watches_than_the_instance_limit(tmp_path, inotify_hub):
    n = int(open("/proc/sys/fs/inotify/max_user_instances").read()) + 72
    before = _inotify_fds()
    watches = []
    for i in range(n):
        os.mkdir(tmp_path / f"d{i}")
        watches.append(inotify_hub.watch(str(tmp_path / f"d{i}"), recursive=False))
    assert _inotify_fds() == before and inotify_hub.count() == n  # no instance beyond the hub's own
    for i in range(n):
        (tmp_path / f"d{i}" / f"f{i}").write_text("x")
    for i, w in enumerate(watches):
        seen = _drain(w, (f"f{i}", WRITE))
        assert set(seen) == {(f"f{i}", CREATE), (f"f{i}", WRITE)}, (i, seen)
    for w in watches:
        w.close()
    assert inotify_hub.count() == 0


@pytest.mark.no_runtime
def test_watches_sharing_a_directory_keep_it_until_the_last_lets_go(tmp_path, inotify_hub):
    os.makedirs(tmp_path / "tree" / "sub")
    os.mkdir(tmp_path / "away")
    whole = inotify_hub.watch(str(tmp_path / "tree"), recursive=True)
    sub = inotify_hub.watch(str(tmp_path / "tree" / "sub"), recursive=False)  # the same inode: one descriptor
    try:
        (tmp_path / "tree" / "sub" / "a").write_text("1")
        assert ("sub/a", CREATE) in _drain(whole, ("sub/a", CREATE)) and ("a", CREATE) in _drain(sub, ("a", CREATE))
        # the tree's watch forgets `sub` once it moves out; the other watch of that directory must stay
        os.rename(tmp_path / "tree" / "sub", tmp_path / "away" / "sub")
        assert ("sub", RENAME) in _drain(whole, ("sub", RENAME))
        (tmp_path / "away" / "sub" / "b").write_text("2")
        assert ("b", CREATE) in _drain(sub, ("b", CREATE))
        assert [e for e in whole.events() if e[0].endswith("b")] == []
        sub.close()
        (tmp_path / "tree" / "c").write_text("3")
        assert ("c", CREATE) in _drain(whole, ("c", CREATE))
    finally:
        whole.close()
        sub.close()


def _wait_for(handle, name: str, kind: str, seen: list) -> list[tuple[str, str]]:
    deadline = time.monotonic() + 5
    while True:
        seen += handle.get_new_events()
        pairs = [(e.name, e.type.value) for e in seen]
        if (name, kind) in pairs or time.monotonic() > deadline:
            return pairs
        time.sleep(0.05)


def test_recursive_watch_through_the_sdk(e2b_sandbox):
    e2b_sandbox.files.make_dir("/tmp/rw")
    handle = e2b_sandbox.files.watch_dir("/tmp/rw", recursive=True)
    seen: list = []
    try:
        e2b_sandbox.commands.run("mkdir -p /tmp/rw/a/b")
        assert ("a", "create") in _wait_for(handle, "a/b", "create", seen)
        # then, in the watched subdirectory, steps faster than any poll: inotify queues each one
        e2b_sandbox.commands.run("echo 1 > /tmp/rw/a/b/f && mv /tmp/rw/a/b/f /tmp/rw/g && chmod 600 /tmp/rw/g "
                                 "&& touch /tmp/rw/gone && rm /tmp/rw/gone")
        pairs = _wait_for(handle, "gone", "remove", seen)
    finally:
        handle.stop()
    for expected in [("a/b/f", "create"), ("a/b/f", "write"), ("a/b/f", "rename"), ("g", "create"), ("g", "chmod"),
                     ("gone", "create"), ("gone", "remove")]:
        assert expected in pairs, (expected, pairs)


def test_watch_of_a_missing_directory_is_not_found(e2b_sandbox):
    from e2b import NotFoundException

    with pytest.raises(NotFoundException):
        e2b_sandbox.files.watch_dir("/tmp/no-such-dir")


AGENT_INOTIFY_FDS = ("for f in $(grep -la 'agentenv_envd_[w]atch' /proc/[0-9]*/cmdline); do "
                     "find ${f%/cmdline}/fd -lname 'anon_inode:inotify'; done | wc -l")
"""Inotify instances the sandbox's envd agent holds (the bracket keeps grep from matching this command)."""


def test_more_watches_than_the_instance_limit_share_one_instance(e2b_sandbox):
    n = int(e2b_sandbox.commands.run("cat /proc/sys/fs/inotify/max_user_instances").stdout) + 72
    e2b_sandbox.commands.run("mkdir -p /tmp/many/0 /tmp/many/1 /tmp/many/2 /tmp/many/3")
    handles = [e2b_sandbox.files.watch_dir(f"/tmp/many/{i % 4}") for i in range(n)]
    try:
        assert int(e2b_sandbox.commands.run(AGENT_INOTIFY_FDS).stdout) == 1
        # created and removed within microseconds: only inotify sees both (a 50 ms scan sees neither)
        e2b_sandbox.commands.run("for d in 0 1 2 3; do touch /tmp/many/$d/f$d && rm /tmp/many/$d/f$d; done")
        for i, handle in enumerate(handles):
            seen: list = []
            pairs = _wait_for(handle, f"f{i % 4}", "remove", seen)
            assert (f"f{i % 4}", "create") in pairs and (f"f{i % 4}", "remove") in pairs, (i, pairs)
    finally:
        for handle in handles:
            handle.stop()


HOLD_INSTANCES = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
fds = []
while len(fds) < 100000 and libc.inotify_init1(0) >= 0:
    fds.append(1)
open("/tmp/held", "w").write(f"holding {len(fds)} {ctypes.get_errno()}")
sys.stdin.read()
"""


def test_watch_falls_back_to_polling_when_no_inotify_instance_is_left_and_later_ones_use_inotify(e2b_sandbox):
    import errno

    e2b_sandbox.files.make_dir("/tmp/pw")
    e2b_sandbox.files.write("/tmp/hold.py", HOLD_INSTANCES)
    holder = e2b_sandbox.commands.run("python3 /tmp/hold.py", background=True, stdin=True)
    try:
        deadline = time.monotonic() + 10
        while not e2b_sandbox.files.exists("/tmp/held") and time.monotonic() < deadline:
            time.sleep(0.02)
        held = e2b_sandbox.commands.run("cat /tmp/held").stdout
        assert held.split()[2] == str(errno.EMFILE), held  # the instance limit is reached
        handle = e2b_sandbox.files.watch_dir("/tmp/pw", recursive=True)  # the agent's first watch: no inotify
    finally:
        e2b_sandbox.commands.kill(holder.pid)
    try:
        assert int(e2b_sandbox.commands.run(AGENT_INOTIFY_FDS).stdout) == 0
        seen: list = []
        e2b_sandbox.commands.run("mkdir /tmp/pw/d && echo 1 > /tmp/pw/d/f")
        assert ("d", "create") in _wait_for(handle, "d/f", "create", seen)
        time.sleep(0.1)  # past a scan: the next steps are seen one by one
        e2b_sandbox.commands.run("echo 22 >> /tmp/pw/d/f")
        assert ("d/f", "write") in _wait_for(handle, "d/f", "write", seen)
        e2b_sandbox.commands.run("rm /tmp/pw/d/f")
        assert ("d/f", "remove") in _wait_for(handle, "d/f", "remove", seen)
        # the instances are free again (the holder is gone): the next watch gets one, the first keeps polling
        while holder.pid in [p.pid for p in e2b_sandbox.commands.list()] and time.monotonic() < deadline + 10:
            time.sleep(0.02)
        later = e2b_sandbox.files.watch_dir("/tmp/pw")
        try:
            assert int(e2b_sandbox.commands.run(AGENT_INOTIFY_FDS).stdout) == 1
            e2b_sandbox.commands.run("touch /tmp/pw/quick && rm /tmp/pw/quick")  # too fast for a scan
            later_seen: list = []
            pairs = _wait_for(later, "quick", "remove", later_seen)
            assert ("quick", "create") in pairs and ("quick", "remove") in pairs, pairs
            e2b_sandbox.commands.run("touch /tmp/pw/slow")
            assert ("slow", "create") in _wait_for(handle, "slow", "create", seen)
        finally:
            later.stop()
    finally:
        handle.stop()
