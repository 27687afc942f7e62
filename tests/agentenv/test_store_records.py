"""`Store.all_records` under the lock reuses what it read while the lock file's change counter stands still,
and sees every change: its own, and another writer's (another `Store` on the same data directory, i.e. another
process's runtime)."""

from __future__ import annotations

from agentenv.runtime.store import Record, Store


def _rec(sid: str, kind: str = "sandbox") -> Record:
    return Record(sid, kind, "host", 1, 1, None, ["a"], "u", False, {"memory_mb": 64, "network": {"allow": []}})


def test_records_cache_sees_every_change(tmp_path, monkeypatch):
    mine, other = Store(tmp_path), Store(tmp_path)
    mine.write_record(_rec("sb-1"))
    with mine.locked():
        assert [r.id for r in mine.all_records()] == ["sb-1"]
        reads = []
        real_open = open
        monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(a[0]) or real_open(*a, **k))
        first = mine.all_records()
        assert reads == []                                     # served from the cache: no file read
        first[0].lowers.append("changed")                      # callers get their own objects
        assert mine.all_records()[0].lowers == ["a"]
        monkeypatch.undo()
        mine.write_record(_rec("sb-2"))                        # its own change updates the cache
        mine.delete_record("sb-1")
        assert [r.id for r in mine.all_records()] == ["sb-2"]
    other.write_record(_rec("sb-2", kind="retired"))           # another writer moves the counter
    other.write_record(_rec("sb-3"))
    with mine.locked():
        assert sorted((r.id, r.kind) for r in mine.all_records()) == [("sb-2", "retired"), ("sb-3", "sandbox")]
    assert sorted(r.id for r in mine.all_records()) == ["sb-2", "sb-3"]   # outside the lock: read afresh
