"""`StateFile`: two slots written in place; a torn or missing slot never loses the other one's state."""

from __future__ import annotations

import json

import pytest

from agentenv.server.state import StateFile


def test_save_alternates_slots_and_load_takes_the_newest(tmp_path):
    sf = StateFile(tmp_path / "sandboxes.json")
    for i in range(5):
        sf.save({"n": i, "pad": "x" * (100 - 20 * i)})  # shrinking states: each slot must be truncated
    sf.close()
    raws = [json.loads(p.read_bytes()) for p in sf.paths]
    assert sorted(r["seq"] for r in raws) == [4, 5]
    assert StateFile(tmp_path / "sandboxes.json").load() == {"n": 4, "pad": "x" * 20}


@pytest.mark.parametrize("damage", ["torn", "garbage", "missing"], ids=["torn", "garbage", "missing"])
def test_a_damaged_newest_slot_falls_back_to_the_other(tmp_path, damage):
    sf = StateFile(tmp_path / "s.json")
    sf.save({"n": 1})
    sf.save({"n": 2})
    sf.close()
    newest = max(sf.paths, key=lambda p: json.loads(p.read_bytes())["seq"])
    if damage == "torn":
        newest.write_bytes(newest.read_bytes()[:10])
    elif damage == "garbage":
        newest.write_bytes(b"\xff\x00")
    else:
        newest.unlink()
    assert StateFile(tmp_path / "s.json").load() == {"n": 1}


def test_a_plain_file_from_an_older_server_is_read_and_then_superseded(tmp_path):
    (tmp_path / "sandboxes.json").write_text(json.dumps({"sandboxes": {"a": {}}, "snapshots": {}}))
    sf = StateFile(tmp_path / "sandboxes.json")
    assert sf.load() == {"sandboxes": {"a": {}}, "snapshots": {}}
    sf.save({"sandboxes": {}, "snapshots": {}})
    sf.save({"sandboxes": {"b": {}}, "snapshots": {}})  # overwrites the old plain file's slot
    sf.close()
    assert StateFile(tmp_path / "sandboxes.json").load() == {"sandboxes": {"b": {}}, "snapshots": {}}


def test_saves_continue_the_sequence_found_on_disk(tmp_path):
    first = StateFile(tmp_path / "s.json")
    for i in range(3):
        first.save({"n": i})
    first.close()
    second = StateFile(tmp_path / "s.json")  # a restarted server saves without loading first
    second.save({"n": "after restart"})
    second.close()
    assert StateFile(tmp_path / "s.json").load() == {"n": "after restart"}


def test_nothing_on_disk_loads_none(tmp_path):
    assert StateFile(tmp_path / "s.json").load() is None
