"""Tasks and verifiers: what an episode starts from, what the agent is asked, and how it is scored.

A `TaskSpec` names an image (or template/snapshot), files and commands for setup, the instruction shown to
the policy, a verifier, limits and a step budget. Verifiers score the final sandbox state with a reward in
[0, 1]: `UnitTestVerifier` copies hidden test files in only at verification time, runs them with a small
stdlib runner and returns the pass fraction; `CommandVerifier` scores by exit status or by a number the
command prints; `FileVerifier` checks a file's contents in the sandbox (one read, no process started);
`AnswerVerifier` compares the submitted answer; `CallableVerifier` runs any Python callable.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from agentenv.limits import Limits
from agentenv.rl.backends import SandboxHandle

log = logging.getLogger(__name__)


def seed_code(seed: int) -> str:
    """Interpreter code that seeds the sandbox's `random` module at an episode's reset."""
    return f"import random as _r; _r.seed({int(seed)}); del _r"


HIDDEN_DIR = "/tmp/.agentenv-verifier"
"""Where hidden test files are placed while a verifier runs (removed afterwards)."""

_RUNNER = r'''
import importlib.util, sys, traceback
path, workdir = sys.argv[1], sys.argv[2]
sys.path.insert(0, workdir)
spec = importlib.util.spec_from_file_location("hidden_tests", path)
mod = importlib.util.module_from_spec(spec)
try:
    spec.loader.exec_module(mod)
except BaseException:
    traceback.print_exc()
    print("RESULT 0/1")
    raise SystemExit(0)
tests = [getattr(mod, n) for n in sorted(dir(mod)) if n.startswith("test_") and callable(getattr(mod, n))]
passed = 0
for t in tests:
    try:
        t()
        passed += 1
        print("PASS", t.__name__)
    except BaseException as e:
        print("FAIL", t.__name__, type(e).__name__, str(e)[:200])
print("RESULT %d/%d" % (passed, max(1, len(tests))))
'''
"""Stdlib test runner: calls every ``test_*`` function of the hidden module and prints ``RESULT p/n``."""

_RESULT = re.compile(r"RESULT (\d+)/(\d+)\s*$")


@dataclass
class Verdict:
    """A verifier's score of the final state."""

    reward: float
    """In [0, 1] (e.g. the fraction of hidden tests passed)."""
    passed: int = 0
    total: int = 0
    detail: str = ""
    """Verifier output, trimmed (for logs and trajectories)."""


class Verifier:
    """Scores a sandbox at the end of an episode. Subclasses implement `__call__(handle, answer, task)`."""

    kind = "base"

    def __call__(self, handle: SandboxHandle, answer: str | None, task: TaskSpec) -> Verdict:
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {"kind": self.kind}


@dataclass
class UnitTestVerifier(Verifier):
    """Hidden unit tests: ``test_*`` functions in `tests` (Python source), run against `task.workdir`."""

    tests: str
    timeout_s: float = 30.0
    kind = "unit_tests"

    def __call__(self, handle: SandboxHandle, answer: str | None, task: TaskSpec) -> Verdict:
        handle.write(f"{HIDDEN_DIR}/runner.py", _RUNNER.encode())
        handle.write(f"{HIDDEN_DIR}/hidden_tests.py", self.tests.encode())
        try:
            r = handle.exec(f"python3 {HIDDEN_DIR}/runner.py {HIDDEN_DIR}/hidden_tests.py {task.workdir}",
                            cwd=task.workdir, timeout_s=self.timeout_s, max_output=64 << 10)
        finally:
            handle.exec(f"rm -rf {HIDDEN_DIR}", cwd="/", timeout_s=10, max_output=1024)
        m = _RESULT.search(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "")
        if m is None:
            return Verdict(0.0, 0, 0, (r.stdout + r.stderr)[-2000:])
        passed, total = int(m.group(1)), int(m.group(2))
        return Verdict(passed / total, passed, total, r.stdout[-2000:])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tests": self.tests, "timeout_s": self.timeout_s}


@dataclass
class CommandVerifier(Verifier):
    """A command in the sandbox: reward 1 on exit 0 (``score="exit_code"``) or the last number it prints,
    clipped to [0, 1] (``score="stdout"``)."""

    command: str
    score: str = "exit_code"
    timeout_s: float = 30.0
    kind = "command"

    def __post_init__(self) -> None:
        if self.score not in ("exit_code", "stdout"):
            raise ValueError(f"score must be 'exit_code' or 'stdout', got {self.score!r}")

    def __call__(self, handle: SandboxHandle, answer: str | None, task: TaskSpec) -> Verdict:
        r = handle.exec(self.command, cwd=task.workdir, timeout_s=self.timeout_s, max_output=64 << 10)
        detail = (r.stdout + r.stderr)[-2000:]
        if self.score == "exit_code":
            return Verdict(float(r.exit_code == 0), int(r.exit_code == 0), 1, detail)
        numbers = re.findall(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?", r.stdout)
        reward = min(1.0, max(0.0, float(numbers[-1]))) if numbers else 0.0
        return Verdict(reward, 0, 0, detail)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "command": self.command, "score": self.score, "timeout_s": self.timeout_s}


@dataclass
class FileVerifier(Verifier):
    """Reward 1 when the sandbox file `path` (relative to `task.workdir`, or absolute) holds `expected`,
    compared with surrounding whitespace stripped; 0 when it differs or is missing. The file is read through
    the sandbox's tool server, without starting a process."""

    path: str
    expected: str
    kind = "file"

    def __call__(self, handle: SandboxHandle, answer: str | None, task: TaskSpec) -> Verdict:
        from agentenv.errors import NotFoundError, SandboxIsADirectoryError

        path = self.path if self.path.startswith("/") else f"{task.workdir.rstrip('/')}/{self.path}"
        try:
            got = handle.read(path).decode(errors="replace")
        except (NotFoundError, SandboxIsADirectoryError) as e:
            return Verdict(0.0, 0, 1, f"{path}: {type(e).__name__}")
        ok = got.strip() == self.expected.strip()
        return Verdict(float(ok), int(ok), 1, f"{path}: {got[:200]!r}")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": self.path, "expected": self.expected}


@dataclass
class AnswerVerifier(Verifier):
    """The submitted answer equals `expected` (whitespace-stripped; case-insensitive unless `exact`)."""

    expected: str
    exact: bool = False
    kind = "answer"

    def __call__(self, handle: SandboxHandle, answer: str | None, task: TaskSpec) -> Verdict:
        got = (answer or "").strip()
        ok = got == self.expected.strip() if self.exact else got.lower() == self.expected.strip().lower()
        return Verdict(float(ok), int(ok), 1, f"answer {got[:200]!r}")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "expected": self.expected, "exact": self.exact}


@dataclass
class CallableVerifier(Verifier):
    """Any Python callable ``fn(handle, answer, task) -> float | Verdict`` (runs in the host process)."""

    fn: Callable[[SandboxHandle, str | None, TaskSpec], Any]
    kind = "callable"

    def __call__(self, handle: SandboxHandle, answer: str | None, task: TaskSpec) -> Verdict:
        out = self.fn(handle, answer, task)
        if isinstance(out, Verdict):
            return out
        if isinstance(out, bool) or not isinstance(out, (int, float)):
            raise TypeError(f"verifier callable must return a float or Verdict, got {type(out).__name__}")
        return Verdict(min(1.0, max(0.0, float(out))))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "fn": getattr(self.fn, "__qualname__", repr(self.fn))}


_VERIFIERS: dict[str, type] = {"unit_tests": UnitTestVerifier, "command": CommandVerifier, "file": FileVerifier,
                               "answer": AnswerVerifier}


def verifier_from_dict(data: dict) -> Verifier:
    """Build a verifier from its JSON form (``{"kind": "unit_tests" | "command" | "file" | "answer", ...}``)."""
    if not isinstance(data, dict) or data.get("kind") not in _VERIFIERS:
        raise ValueError(f"verifier must be a dict with kind in {sorted(_VERIFIERS)}, got {data!r}")
    fields = {k: v for k, v in data.items() if k != "kind"}
    return _VERIFIERS[data["kind"]](**fields)


@dataclass
class Setup:
    """Files written and commands run once to build the task's start state (cached as a template snapshot).

    With `files_at_reset`, `files` are not baked into the template but written into each sandbox at reset
    (and at replay): tasks that differ only in their files then share one template snapshot, so a suite of
    many small generated tasks costs one template build and one snapshot instead of one per task, at one
    write per file per reset. The start state is the same either way.
    """

    files: dict[str, str] = field(default_factory=dict)
    """Absolute path -> text content."""
    commands: list[str] = field(default_factory=list)
    python: str = ""
    """Code run in the persistent interpreter (its state carries into the episode)."""
    workdir: str = "/root/task"
    files_at_reset: bool = False

    def __post_init__(self) -> None:
        if self.files_at_reset and (self.commands or self.python):
            raise ValueError("files_at_reset needs a setup without commands and python (they may read the files)")

    @property
    def key(self) -> str:
        """Identifies the template this setup builds (without the files when they are written at reset)."""
        files = {} if self.files_at_reset else self.files
        return json.dumps([files, self.commands, self.python, self.workdir], sort_keys=True)

    def __call__(self, handle: SandboxHandle) -> None:
        from agentenv.errors import SandboxError

        handle.exec(f"mkdir -p {self.workdir}", cwd="/", timeout_s=30, max_output=4096)
        if not self.files_at_reset:
            self.write_files(handle)
        for cmd in self.commands:
            r = handle.exec(cmd, cwd=self.workdir, timeout_s=60, max_output=64 << 10)
            if r.exit_code != 0:
                raise SandboxError(f"task setup command {cmd!r} failed ({r.exit_code}): {r.stderr[-500:]}")
        if self.python:
            r = handle.python(self.python, timeout_s=60)
            if r.error:
                raise SandboxError(f"task setup code raised {r.error}: {r.traceback[-500:]}")

    def write_files(self, handle: SandboxHandle) -> None:
        """Write `files` into `handle` (parents are created)."""
        for path, text in self.files.items():
            handle.write(path, text.encode())

    def at_reset(self, handle: SandboxHandle) -> None:
        """What a sandbox restored from this setup's template still needs: the files, with `files_at_reset`."""
        if self.files_at_reset:
            self.write_files(handle)


@dataclass
class TaskSpec:
    """One task: start state, instruction, verifier, limits and budget.

    Example::

        task = TaskSpec(id="hello", instruction="Create /root/task/hello.txt containing hi, then submit.",
                        verifier=CommandVerifier("grep -qx hi hello.txt"), max_steps=5)
    """

    id: str
    instruction: str
    verifier: Verifier
    image: str = "host"
    """Image name, template name or snapshot id the sandbox starts from."""
    setup: Setup = field(default_factory=Setup)
    limits: Limits = field(default_factory=lambda: Limits(memory_mb=256, pids=128))
    max_steps: int = 20
    step_timeout_s: float = 30.0
    """Per tool call, in seconds; a call past it is killed and reported to the agent as a timeout."""
    max_output_bytes: int = 16 << 10
    """Tool output kept per stream; the rest is cut and the observation says so."""
    solution: list[dict] = field(default_factory=list)
    """Reference tool calls that solve the task (used by the scripted policy in demos and tests)."""
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"id must be a non-empty str, got {self.id!r}")
        if not isinstance(self.verifier, Verifier):
            raise ValueError(f"verifier must be an agentenv.rl.tasks.Verifier, got {type(self.verifier).__name__}")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {self.max_steps!r}")
        if not isinstance(self.step_timeout_s, (int, float)) or self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be a positive number of seconds, got {self.step_timeout_s!r}")
        if isinstance(self.max_output_bytes, bool) or not isinstance(self.max_output_bytes, int) \
                or self.max_output_bytes < 64:
            raise ValueError(f"max_output_bytes must be an int >= 64, got {self.max_output_bytes!r}")

    @property
    def workdir(self) -> str:
        return self.setup.workdir

    def to_dict(self) -> dict:
        """JSON form (a `CallableVerifier` is recorded by name only and cannot be rebuilt)."""
        return {"id": self.id, "instruction": self.instruction, "verifier": self.verifier.to_dict(),
                "image": self.image, "setup": asdict(self.setup), "limits": self.limits.to_dict(),
                "max_steps": self.max_steps, "step_timeout_s": self.step_timeout_s,
                "max_output_bytes": self.max_output_bytes, "solution": self.solution, "tags": self.tags}

    @classmethod
    def from_dict(cls, data: dict) -> TaskSpec:
        if not isinstance(data, dict):
            raise ValueError(f"task must be a dict, got {type(data).__name__}")
        data = dict(data)
        data["verifier"] = verifier_from_dict(data.get("verifier"))
        data["setup"] = Setup(**data.get("setup", {}))
        if "limits" in data:
            data["limits"] = Limits.from_dict(data["limits"])
        return cls(**data)
