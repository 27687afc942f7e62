"""Elastic EP with replicated experts (`PlacedMoELayer`, AdamW, gloo), 5 processes: two failures one after
the other (the first one's experts all re-homed from live copies on the survivors, with their optimizer
state and no checkpoint read: the dying rank deletes the checkpoint directory; the second one's from live
copies and, for an expert whose only copy was lost, from the checkpoint), and two ranks lost at once.
Every step's loss, and at the end every expert's weights and AdamW moments, equal a run on 3 ranks from
the start. Each run has a hard timeout and asserts that no process is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.ep.elastic_train import Config, run_elastic

pytestmark = pytest.mark.multiproc

CFG = Config(tokens=60)
STEPS = 9
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_elastic(["a", "b", "c"], {}, tmp_path_factory.mktemp("reference"), CFG, STEPS)


def _merged_experts(results: dict[str, dict]) -> dict[int, list[torch.Tensor]]:
    """Every logical expert's state over all ranks; all copies of a replicated expert must be equal."""
    merged: dict[int, list[torch.Tensor]] = {}
    for result in results.values():
        for e, copies in result["experts"].items():
            for arrays in copies:
                tensors = [torch.as_tensor(a) for a in arrays]
                if e in merged:
                    for a, b in zip(merged[e], tensors, strict=True):
                        torch.testing.assert_close(a, b, rtol=0, atol=0)
                merged.setdefault(e, tensors)
    return merged


def _check_against(results: dict[str, dict], reference: dict, survivors: list[str]) -> None:
    assert sorted(results) == sorted(survivors)
    for member in survivors:
        losses = results[member]["losses"]
        assert sorted(losses) == list(range(STEPS)), member
        for step in range(STEPS):
            assert losses[step] == pytest.approx(reference["a"]["losses"][step], rel=LOSS_RTOL), (member, step)
        assert results[member]["members"] == survivors
    ours = _merged_experts(results)
    ref = _merged_experts(reference)
    assert sorted(ours) == list(range(CFG.experts))
    for e in ours:  # weights and AdamW moments match the 3-rank run
        for a, b in zip(ours[e], ref[e], strict=True):
            torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-5)


def _shrinks(result: dict) -> list[dict]:
    return [e for e in result["events"] if e["kind"] == "shrink"]


def test_two_failures_one_after_the_other_from_live_replicas(tmp_path: Path, reference: dict) -> None:
    # 5 ranks x 4 slots for 8 experts: every expert has a copy on a survivor after the first kill, whose rank
    # deletes the checkpoint directory (a checkpoint read would raise). After the rebalance at step 4 (4 ranks,
    # copies by load) the second kill may lose an expert's only copy: that one comes from step 5's checkpoint.
    results = run_elastic(
        ["0", "1", "2", "3", "4"], {"1": 3, "3": 6}, tmp_path, CFG, STEPS, rebalance_every=4, wipe_by="1"
    )
    _check_against(results, reference, ["0", "2", "4"])
    for result in results.values():
        shrinks = _shrinks(result)
        assert [(s["lost"], s["step"], s["resume_step"]) for s in shrinks] == [(["1"], 3, 3), (["3"], 6, 6)]
        assert shrinks[0]["source"] == "live" and shrinks[0]["checkpoint_experts"] == {}, shrinks[0]
        # the rebalanced layout left some expert (here: 3) with its only copy on the lost rank
        assert shrinks[1]["source"] == "live" and shrinks[1]["checkpoint_experts"], shrinks[1]
        assert shrinks[0]["at"] - result["killed_at"]["1"] < 10.0, "survivors took 10 s or more to regroup"
        assert shrinks[1]["at"] - result["killed_at"]["3"] < 10.0, "survivors took 10 s or more to regroup"
        assert [e["kind"] for e in result["events"]].count("rebalance") == 2  # after steps 3 and 7


def test_two_ranks_lost_at_once(tmp_path: Path, reference: dict) -> None:
    results = run_elastic(["0", "1", "2", "3", "4"], {"1": 4, "2": 4}, tmp_path, CFG, STEPS)
    _check_against(results, reference, ["0", "3", "4"])
    for result in results.values():
        (shrink,) = _shrinks(result)
        assert shrink["lost"] == ["1", "2"] and shrink["resume_step"] == 4, shrink
        # experts whose copies were all on the two lost ranks come from the checkpoint of step 3
        assert shrink["source"] == "live", shrink
        assert shrink["at"] - max(result["killed_at"].values()) < 10.0
