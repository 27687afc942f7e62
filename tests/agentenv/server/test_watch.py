"""Directory watches: `DirWatch` (inotify and its polling fallback) on a host directory, then through the stock
SDK in a sandbox (recursive, renames, chmod, changes faster than any poll). (``include_entry`` needs envd
0.6.3, which would also promise file metadata; we report 0.5.7, so the SDK refuses it before calling.)"""

from __future__ import annotations

import os
import time

import pytest

from agentenv.server.watch import DirWatch

CREATE, WRITE, REMOVE, RENAME, CHMOD = (f"EVENT_TYPE_{k}" for k in ("CREATE", "WRITE", "REMOVE", "RENAME", "CHMOD"))


def _drain(w: DirWatch, until: tuple[str, str], timeout: float = 5.0) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    while until not in seen and time.monotonic() < deadline:
        seen += w.events()
        time.sleep(w.interval or 0.01)
    return seen


@pytest.mark.no_runtime
@pytest.mark.parametrize("use_inotify", [True, False], ids=["inotify", "polling"])
def test_dir_watch_reports_what_changed(tmp_path, use_inotify):
    with DirWatch(str(tmp_path), recursive=True, use_inotify=use_inotify) as w:
        assert (w.fd >= 0) == use_inotify and (w.interval is None) == use_inotify
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
def test_inotify_follows_a_directory_moved_within_the_tree(tmp_path):
    os.makedirs(tmp_path / "old" / "sub")
    with DirWatch(str(tmp_path), recursive=True) as w:
        os.rename(tmp_path / "old", tmp_path / "new")
        seen = _drain(w, ("new", CREATE))
        assert ("old", RENAME) in seen
        (tmp_path / "new" / "sub" / "f").write_text("1")  # reported under its new path
        assert ("new/sub/f", CREATE) in _drain(w, ("new/sub/f", CREATE))


@pytest.mark.no_runtime
def test_non_recursive_watch_ignores_subdirectories(tmp_path):
    os.makedirs(tmp_path / "sub")
    with DirWatch(str(tmp_path), recursive=False) as w:
        (tmp_path / "sub" / "hidden.txt").write_text("1")
        (tmp_path / "top.txt").write_text("1")
        seen = _drain(w, ("top.txt", CREATE))
    assert [name for name, _ in seen if name.startswith("sub/")] == []


def _wait_for(handle, name: str, kind: str, seen: list) -> list[tuple[str, str]]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (name, kind) not in [(e.name, e.type.value) for e in seen]:
        seen += handle.get_new_events()
        time.sleep(0.05)
    return [(e.name, e.type.value) for e in seen]


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
