"""Trajectories: recorded per step, survive a torn write, export to Parquet, replay reproduces or diverges."""

from __future__ import annotations

import json

import pytest

from agentenv.rl import (
    AgentEnv,
    ScriptedPolicy,
    load_suite,
    load_trajectory,
    replay,
    to_parquet,
)
from agentenv.rl.policy import tool_call
from agentenv.rl.trajectory import TrajectoryWriter


def _episode(provider, run, tmp_path, task_id: str, tokens: bool = False):
    (task,) = load_suite([task_id])

    async def main():
        async with AgentEnv(provider, record_dir=tmp_path) as env:
            await env.reset(task=task, seed=5)
            policy = ScriptedPolicy(task)
            done = False
            while not done:
                kwargs = {"prompt_tokens": 100, "completion_tokens": 20} if tokens else {}
                _, _, term, trunc, info = await env.step(policy.act({}), **kwargs)
                done = term or trunc
            return info["trajectory_id"]

    return tmp_path / f"{run(main())}.jsonl"


def test_every_step_is_recorded(provider, run, tmp_path):
    path = _episode(provider, run, tmp_path, "fix-median", tokens=True)
    traj = load_trajectory(path)
    (task,) = load_suite(["fix-median"])
    assert traj.header["task"]["id"] == "fix-median" and traj.header["seed"] == 5
    assert traj.header["start_snapshot"].startswith("snap-")
    assert [s["index"] for s in traj.steps] == list(range(len(task.solution)))
    assert [s["call"]["name"] for s in traj.steps] == [json.loads(json.dumps(a))["function"]["name"]
                                                      for a in task.solution]
    first = traj.steps[0]
    assert "def median" in first["observation"]
    assert first["sandbox_id"].startswith("sb-") and first["latency_ms"] > 0
    assert first["prompt_tokens"] == 100 and first["completion_tokens"] == 20
    assert traj.end["reward"] == 1.0 and traj.end["verdict"]["passed"] == 4


def test_replay_reproduces_recorded_trajectory(provider, run, tmp_path):
    for task_id in ("fizzbuzz", "prime-sum"):
        report = replay(_episode(provider, run, tmp_path, task_id), provider)
        assert report.ok, report.divergences
        assert report.start == "snapshot" and report.replayed_reward == 1.0


def test_replay_reports_divergence(provider, run, tmp_path):
    path = _episode(provider, run, tmp_path, "fizzbuzz")
    lines = path.read_text().splitlines()
    step = json.loads(lines[3])  # the run_shell step that prints fizzbuzz(15)
    step["observation"] = step["observation"].replace("FizzBuzz", "Fizz-Buzz")
    lines[3] = json.dumps(step)
    path.write_text("\n".join(lines) + "\n")
    report = replay(path, provider)
    assert not report.ok
    assert [d.index for d in report.divergences] == [2]
    assert "Fizz-Buzz" in report.divergences[0].recorded and "FizzBuzz" in report.divergences[0].replayed


def test_replay_rebuilds_start_when_snapshot_is_gone(provider, run, tmp_path):
    path = _episode(provider, run, tmp_path, "roman")
    data = [json.loads(x) for x in path.read_text().splitlines()]
    data[0]["start_snapshot"] = "snap-000000000000"
    path.write_text("".join(json.dumps(x) + "\n" for x in data))
    report = replay(path, provider)
    assert report.ok and report.start == "rebuilt"


def test_forked_trajectory_carries_prefix_and_replays(provider, run, tmp_path):
    (task,) = load_suite(["prime-sum"])

    async def main():
        async with AgentEnv(provider, record_dir=tmp_path) as env:
            await env.reset(task=task)
            await env.step(task.solution[0])
            (kid,) = await env.fork(1)
            await kid.step(task.solution[1])
            await kid.step(task.solution[2])
            path = kid.writer.path
            await kid.close()
            return env.writer.id, path

    parent_id, kid_path = run(main())
    traj = load_trajectory(kid_path)
    assert traj.header["parent"] == {"trajectory_id": parent_id, "step": 1}
    assert [s.get("inherited", False) for s in traj.steps] == [True, False, False]
    assert replay(kid_path, provider).ok


def test_torn_last_line_is_ignored(provider, run, tmp_path):
    path = _episode(provider, run, tmp_path, "roman")
    text = path.read_text().splitlines()
    path.write_text("\n".join(text[:-1]) + "\n" + text[-1][: len(text[-1]) // 2])  # crash mid-write of "end"
    traj = load_trajectory(path)
    assert traj.end is None and len(traj.steps) == 2


def test_writer_fsyncs_each_line_and_validates(tmp_path):
    with pytest.raises(ValueError, match="fsync must be one of"):
        TrajectoryWriter(tmp_path, fsync="sometimes")
    w = TrajectoryWriter(tmp_path, "t1")
    w.write({"kind": "header", "trajectory_id": "t1", "task": {"id": "x"}})
    # another reader sees the line before close: it reached the file, not just a buffer
    assert json.loads((tmp_path / "t1.jsonl").read_text())["trajectory_id"] == "t1"
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write({"kind": "step"})
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no trajectory header"):
        load_trajectory(tmp_path / "empty.jsonl")


def test_parquet_export(provider, run, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    paths = [_episode(provider, run, tmp_path, t) for t in ("roman", "prime-sum")]
    rows = to_parquet(paths, tmp_path / "all.parquet")
    table = pq.read_table(tmp_path / "all.parquet").to_pydict()
    assert rows == 5 and table["task_id"] == ["roman"] * 2 + ["prime-sum"] * 3
    assert table["tool"][-1] == "submit" and table["final_reward"] == [1.0] * 5
    assert table["observation"][-2] == "5736396"


def test_replay_rejects_callable_verifier(provider, run, tmp_path):
    from agentenv.rl import CallableVerifier, TaskSpec

    task = TaskSpec(id="cv", instruction="x", verifier=CallableVerifier(lambda h, a, t: 1.0))

    async def main():
        async with AgentEnv(provider, record_dir=tmp_path) as env:
            await env.reset(task=task)
            _, *_, info = await env.step(tool_call("submit"))
            return info["trajectory_id"]

    with pytest.raises(ValueError, match="Python callable"):
        replay(tmp_path / f"{run(main())}.jsonl", provider)
