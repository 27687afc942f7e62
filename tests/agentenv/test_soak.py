"""The CI soak (benchmarks/env/soak.py): 1,000 lifecycles with injected faults, on four worker processes (each on
its own data directory; on the 2-core CI machine a lifecycle waits on process starts and the kernel often enough
that four finish sooner than two), leave nothing behind."""

from __future__ import annotations

import json

import pytest

CI_CYCLES = 1000
CI_WORKERS = 4


@pytest.mark.timeout(1200)
def test_soak_with_faults_leaks_nothing():
    from benchmarks.env.soak import FAULTS, soak_parallel

    result = soak_parallel(CI_WORKERS, CI_CYCLES, None)
    assert result["cycles"] == CI_CYCLES, result
    # each failure in full (fault, phase, exception, traceback): pytest's own repr would cut it short
    assert result["failures"] == [], json.dumps(result["failures"], indent=1, default=str)[-20000:]
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
