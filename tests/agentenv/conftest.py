"""Fixtures for the sandbox runtime: a data directory per session, sandboxes killed in finalizers, leak checks.

The runtime needs root, cgroup v1 controllers and /usr/bin/python3 (CI runs as root on such a machine);
elsewhere these tests are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from agentenv.runtime import cgroups


def _unusable() -> str | None:
    if os.geteuid() != 0:
        return "the namespace backend needs root"
    if not cgroups.available():
        return "cgroup v1 memory/pids/cpu/freezer hierarchies are not writable here"
    if not Path("/usr/bin/python3").exists():
        return "/usr/bin/python3 is missing (the tool server runs with it)"
    return None


REASON = _unusable()


def host_state() -> dict[str, set[str]]:
    """Every agentenv cgroup on this host (``group/name``) and every mount of a sandbox layer or overlay."""
    groups = set()
    pids_root = cgroups.CGROUP_ROOT / "pids"
    if pids_root.is_dir():
        for group in pids_root.glob("agentenv-*"):
            groups |= {f"{group.name}/{name}" for name in
                       next(iter(cgroups.leftover_groups(group.name).values()), [])}
    mounts = {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if "/layers/" in line.split()[4]}
    return {"cgroups": groups, "mounts": mounts}


_BEFORE = host_state() if REASON is None else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when it leaves sandbox cgroups (so processes, seeds) or layer mounts behind on the host."""
    if _BEFORE is None:
        return
    now = host_state()
    leaked = {kind: sorted(now[kind] - _BEFORE[kind]) for kind in now}
    if any(leaked.values()):
        session.config.get_terminal_writer().line(f"agentenv leak check: the tests left {leaked}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "no_runtime: runs without root or cgroups (pure-Python checks)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if REASON is None:
        return
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here) and "no_runtime" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason=REASON))


def leftovers(home: Path) -> dict:
    """What a data directory still holds: mounts, agentenv cgroups, tool-server processes, layer dirs, records."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(str(home))]
    group = cgroups.group_for(str(home))
    procs = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if f"/{group}/" in Path(f"/proc/{name}/cgroup").read_text():
                    procs.append(int(name))
            except OSError:
                continue
    layers = sorted(p.name for p in (home / "layers").iterdir() if not p.name.startswith("i"))
    records = sorted(p.name for p in (home / "sandboxes").iterdir())
    return {"mounts": mounts, "cgroups": cgroups.leftover_groups(group), "procs": procs, "layers": layers,
            "records": records}


@pytest.fixture(scope="session")
def leak_report():
    """`leak_report(home)`: what a data directory still holds (see `leftovers`)."""
    return leftovers


@pytest.fixture(scope="session")
def home():
    path = Path(tempfile.mkdtemp(prefix="agentenv-test-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def backend(home):
    from agentenv.runtime.local import NamespaceBackend

    backend = NamespaceBackend(home)
    yield backend
    backend.gc(everything=True)
    left = leftovers(home)
    assert not any(left.values()), f"sandbox runtime leaked: {left}"


@pytest.fixture
def sandbox_factory(backend):
    """`make(**kwargs)` creates sandboxes that are destroyed when the test ends, whatever happens."""
    from agentenv import Sandbox

    made: list = []

    def make(source: str = "host", **kwargs):
        sb = Sandbox.create(source, backend=backend, **kwargs)
        made.append(sb)
        return sb

    make.track = made.append
    yield make
    for sb in reversed(made):
        sb.destroy()


@pytest.fixture
def sandbox(sandbox_factory):
    return sandbox_factory()
