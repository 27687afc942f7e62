"""Every ```python block of README.md runs, each in a fresh interpreter from the repository's `src/`.

The words after ``python`` on a block's opening line say what it needs: nothing (CPU, runs everywhere), ``gpu`` (a
CUDA device; skipped without one), ``sandbox`` (the AgentEnv runtime: root and cgroup v1; skipped with the reason
elsewhere; its own data directory, reclaimed afterwards), ``e2b`` (the same, plus an `agentenv serve` this test
starts and points the stock SDK at through ``E2B_API_URL``/``E2B_SANDBOX_URL``/``E2B_API_KEY``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python(?P<tags>[^\n]*)\n(?P<code>.*?)^```\s*$", re.S | re.M)
KNOWN_TAGS = {"gpu", "sandbox", "e2b"}


def readme_blocks(text: str) -> list[tuple[int, set[str], str]]:
    """``(line, tags, code)`` of every ```python block of a markdown text."""
    return [(text[: m.start()].count("\n") + 1, set(m["tags"].split()), m["code"]) for m in FENCE.finditer(text)]


BLOCKS = readme_blocks((ROOT / "README.md").read_text())


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _sandbox_unusable() -> str | None:
    from tests.agentenv.conftest import REASON

    return REASON


def _run(code: str, env: dict[str, str], cwd: Path) -> None:
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"


def test_blocks_are_found_and_tagged_known_words():
    assert len(BLOCKS) >= 4
    assert all(tags <= KNOWN_TAGS for _, tags, _ in BLOCKS), [tags for _, tags, _ in BLOCKS]
    assert readme_blocks("x\n```python gpu\nprint(1)\n```\n") == [(2, {"gpu"}, "print(1)\n")]


@pytest.mark.parametrize("line,tags,code", BLOCKS, ids=[f"line{line}-{'-'.join(sorted(t)) or 'cpu'}"
                                                        for line, t, _ in BLOCKS])
def test_readme_block_runs(line, tags, code, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # each block chooses for itself
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    if "gpu" in tags and not _cuda():
        pytest.skip("needs a CUDA device")
    if tags & {"sandbox", "e2b"}:
        reason = _sandbox_unusable()
        if reason:
            pytest.skip(reason)
        from agentenv.runtime.local import NamespaceBackend
        from tests.agentenv.conftest import SESSION_HOMES

        home = tmp_path / "home"
        SESSION_HOMES.add(os.path.realpath(home))  # the session's leak check covers it
        env["AGENTENV_HOME"] = str(home)
        server = None
        try:
            if "e2b" in tags:
                from tests.agentenv.server.conftest import start_server

                server = start_server(home, tmp_path / "state")
                env.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY=server.api_key)
            _run(code, env, tmp_path)
        finally:
            if server is not None:
                server.stop()
            NamespaceBackend(home).gc(everything=True)
        return
    _run(code, env, tmp_path)
