"""The byte counts of the v2 backward plan agree with the forward v2's documented counts."""

from benchmarks.kda.v2_bwd_floor import ROWS, checkpoint_bytes, counts, fla_saved_bytes, memory_table, workspace_bytes


def test_workspace_and_forward_floor_match_forward_docs():
    assert workspace_bytes(128, 16) == 868 and workspace_bytes(128, 32) == 916
    row = ROWS[0]  # H64 T8192: 681 MB of compulsory forward traffic (docs/flashkda-v2.md)
    assert abs(counts(row)["compulsory fwd"] - 681e6) < 1.5e6


def test_plan_saves_less_than_fla_on_every_row():
    for r in ROWS:
        assert checkpoint_bytes(r.D, 128) * r.HV < fla_saved_bytes(r), r.name
    assert memory_table().count("\n") == 7
