"""Trajectories: every step of an episode written as it happens, read back, exported, and replayed.

A trajectory is one JSONL file: a ``header`` line (task, seed, start snapshot, sandbox id, parent when the
episode was forked), one ``step`` line per tool call (action, tool output, observation, reward, timings,
sandbox and snapshot ids, token counts when the policy gives them) and an ``end`` line. Each line is
appended and, by default, fsynced before `step` returns, so a crash loses at most the step in flight.
`to_parquet` flattens many trajectories into one table; `replay` re-executes a trajectory from its start
snapshot and reports where the observations diverge.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

FSYNC_MODES = ("step", "end", "none")


class TrajectoryWriter:
    """Appends the lines of one trajectory to ``<directory>/<trajectory_id>.jsonl``.

    Args:
        directory: where trajectory files go (created if missing).
        trajectory_id: file stem (default: a fresh ``traj-...`` id).
        fsync: ``step`` (fsync every line: survives a host crash), ``end`` (fsync when the episode ends) or
            ``none`` (flush to the OS only: survives a process crash).
    """

    def __init__(self, directory: str | os.PathLike, trajectory_id: str | None = None, *, fsync: str = "step"):
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}, got {fsync!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.id = trajectory_id or f"traj-{uuid.uuid4().hex[:16]}"
        self.path = self.directory / f"{self.id}.jsonl"
        self.fsync = fsync
        self.lines: list[dict] = []
        self._lock = threading.Lock()
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, line: dict) -> None:
        """Append one line (a dict with ``kind``), flushed to the OS (and fsynced per `fsync`)."""
        text = json.dumps(line, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if self._f.closed:
                raise ValueError(f"trajectory {self.id} is closed")
            self._f.write(text)
            self._f.flush()
            if self.fsync == "step" or (self.fsync == "end" and line.get("kind") == "end"):
                os.fsync(self._f.fileno())
            self.lines.append(line)

    def branch(self, trajectory_id: str | None = None) -> TrajectoryWriter:
        """A writer for a forked continuation: same directory and mode, starting with this one's lines."""
        child = TrajectoryWriter(self.directory, trajectory_id, fsync=self.fsync)
        for line in self.lines:
            if line["kind"] == "header":
                child.write({**line, "trajectory_id": child.id,
                             "parent": {"trajectory_id": self.id, "step": self.steps_written()}})
            elif line["kind"] == "step":
                child.write({**line, "inherited": True})
        return child

    def steps_written(self) -> int:
        return sum(1 for line in self.lines if line["kind"] == "step")

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()


@dataclass
class Trajectory:
    """A trajectory read back from JSONL."""

    header: dict
    steps: list[dict]
    end: dict | None
    """None when the file stops early (the episode was cut, e.g. by a crash)."""

    @property
    def id(self) -> str:
        return self.header["trajectory_id"]


def load_trajectory(path: str | os.PathLike) -> Trajectory:
    """Read a trajectory; a torn last line (crash mid-write) is ignored.

    Raises:
        ValueError: the file has no header line.
    """
    header, steps, end = None, [], None
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                log.warning("%s:%d: torn line ignored", path, number)
                continue
            kind = line.get("kind")
            if kind == "header":
                header = line
            elif kind == "step":
                steps.append(line)
            elif kind == "end":
                end = line
    if header is None:
        raise ValueError(f"path: {path} holds no trajectory header")
    return Trajectory(header, steps, end)


PARQUET_COLUMNS = ("trajectory_id", "task_id", "index", "tool", "arguments", "observation", "error", "reward",
                   "terminated", "truncated", "latency_ms", "t_start", "sandbox_id", "snapshot_id", "prompt_tokens",
                   "completion_tokens", "inherited", "final_reward")


def to_parquet(paths: list[str | os.PathLike], out: str | os.PathLike) -> int:
    """Flatten trajectories into one Parquet table (one row per step; JSON columns as strings).

    Returns:
        The number of rows written.

    Raises:
        ImportError: pyarrow is not installed (``pip install 'k3-infra[rl]'``).
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("to_parquet needs pyarrow: pip install 'k3-infra[rl]'") from e
    cols: dict[str, list] = {c: [] for c in PARQUET_COLUMNS}
    for path in paths:
        traj = load_trajectory(path)
        final = traj.end.get("reward") if traj.end else None
        for s in traj.steps:
            call = s.get("call") or {}
            row = {"trajectory_id": traj.id, "task_id": traj.header["task"]["id"], "index": s["index"],
                   "tool": call.get("name"), "arguments": json.dumps(call.get("arguments")),
                   "observation": s["observation"], "error": json.dumps(s["output"].get("error")),
                   "reward": float(s["reward"]), "terminated": bool(s["terminated"]),
                   "truncated": bool(s["truncated"]), "latency_ms": float(s["latency_ms"]),
                   "t_start": float(s["t_start"]), "sandbox_id": s["sandbox_id"], "snapshot_id": s.get("snapshot_id"),
                   "prompt_tokens": s.get("prompt_tokens"), "completion_tokens": s.get("completion_tokens"),
                   "inherited": bool(s.get("inherited", False)), "final_reward": final}
            for c in PARQUET_COLUMNS:
                cols[c].append(row[c])
    pq.write_table(pa.table(cols), str(out))
    return len(cols["index"])


@dataclass
class Divergence:
    """A replayed step whose observation differs from the recorded one."""

    index: int
    recorded: str
    replayed: str


@dataclass
class ReplayReport:
    """What `replay` found."""

    trajectory_id: str
    steps: int
    divergences: list[Divergence] = field(default_factory=list)
    recorded_reward: float | None = None
    replayed_reward: float | None = None
    start: str = ""
    """``snapshot`` (restored the recorded start snapshot) or ``rebuilt`` (re-ran the task setup)."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.divergences and self.recorded_reward == self.replayed_reward


def replay(path: str | os.PathLike, provider, *, executor=None) -> ReplayReport:
    """Re-execute a recorded trajectory from its start state and compare every observation and the reward.

    The recorded start snapshot is restored if the provider still has it; otherwise the task's setup is run
    again (the header holds the full task). Runs synchronously (call it from a worker thread in async code).

    Args:
        path: a trajectory JSONL file.
        provider: a `SandboxProvider` able to reach the snapshot (the one that recorded it, or a server).

    Returns:
        A `ReplayReport`; `report.ok` is True when nothing diverged.

    Raises:
        ValueError: the trajectory's task has a verifier that cannot be rebuilt (a Python callable).
    """
    from agentenv import errors
    from agentenv.rl.tasks import TaskSpec, seed_code
    from agentenv.rl.tools import ToolCall, ToolContext, parse_action, run_tool

    t0 = time.perf_counter()
    traj = load_trajectory(path)
    task_data = traj.header["task"]
    if task_data["verifier"]["kind"] == "callable":
        raise ValueError(f"path: trajectory {traj.id} was scored by a Python callable; replay cannot rebuild it")
    task = TaskSpec.from_dict(task_data)
    report = ReplayReport(traj.id, len(traj.steps), recorded_reward=traj.end.get("reward") if traj.end else None)
    try:
        handle = provider.restore(traj.header["start_snapshot"], task.limits)
        report.start = "snapshot"
    except errors.SandboxError:
        handle = provider.restore(provider.template(task.image, task.setup, task.limits), task.limits)
        report.start = "rebuilt"
    try:
        task.setup.at_reset(handle)
        if traj.header.get("seed") is not None:
            handle.python(seed_code(traj.header["seed"]), timeout_s=30)
        ctx = ToolContext(task.workdir, task.step_timeout_s, task.max_output_bytes)
        answer = None
        for s in traj.steps:
            call = parse_action(s["action"])
            out = run_tool(handle, call, ctx) if isinstance(call, ToolCall) else call
            if out.submitted:
                answer = out.answer
            if out.content != s["observation"]:
                report.divergences.append(Divergence(s["index"], s["observation"], out.content))
        if traj.end is not None and traj.end.get("verdict") is not None:
            report.replayed_reward = task.verifier(handle, answer, task).reward
    finally:
        handle.destroy()
    report.seconds = time.perf_counter() - t0
    return report
