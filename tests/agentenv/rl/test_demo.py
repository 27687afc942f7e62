"""The `make demo` rollout: every row passes and nothing is left behind."""

from __future__ import annotations


def test_rl_demo_rows_all_pass():
    from agentenv.rl.demo import run_demo

    rows = run_demo()
    assert len(rows) >= 10
    assert [r.check for r in rows if not r.ok] == []
    assert rows[-1].result == "clean"
