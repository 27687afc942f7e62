"""A CI-sized soak (benchmarks/env/soak.py): lifecycles with injected faults leave nothing behind."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

CI_CYCLES = 25  # `python -m benchmarks.env.soak` runs 1,000 or more


def test_soak_with_faults_leaks_nothing():
    from benchmarks.env.soak import FAULTS, soak

    home = Path(tempfile.mkdtemp(prefix="agentenv-soak-", dir="/tmp"))
    try:
        result = soak(home, CI_CYCLES)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert result["failures"] == [], result["failures"]  # each with its fault, phase, exception and traceback
    counts = result["counts"]
    assert counts.get("cycles_ok") == CI_CYCLES, counts
    assert not counts.get("sibling_broken"), counts
    per_fault = {f: sum(1 for i in range(CI_CYCLES) if FAULTS[i % len(FAULTS)] == f) for f in FAULTS}
    assert counts.get("disk_full:enospc") == per_fault["disk_full"], counts
    assert counts.get("oom:sandbox_answers_after") == per_fault["oom"], counts
    assert counts.get("fork_bomb:held_by_pids_limit") == per_fault["fork_bomb"], counts
    assert counts.get("fork_bomb:sandbox_answers_after") == per_fault["fork_bomb"], counts
    assert counts.get("fork_bomb:others_fork_while_held") == 3 * per_fault["fork_bomb"], counts
    assert counts.get("kill_runtime_mid_fork:sandbox_answers_after") == per_fault["kill_runtime_mid_fork"], counts
    assert not counts.get("kill_runtime_mid_fork:child_broken"), counts
    assert counts.get("kill_server_mid_fork:sandbox_adopted") == per_fault["kill_server_mid_fork"], counts
    assert counts.get("kill_server_mid_fork:parent_answers") == per_fault["kill_server_mid_fork"], counts
    assert not counts.get("kill_server_mid_fork:child_broken"), counts
    assert not counts.get("kill_server_mid_fork:leaked"), counts
    assert result["gc_reclaimed_after_soak"] == {"forks": 0, "records": 0, "cgroups": 0, "layers": 0,
                                                     "network": 0}, result
    assert not result["leaked"], result["leftovers"]
