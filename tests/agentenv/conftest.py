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


SESSION_HOMES: set[str] = set()
"""Every data directory a runtime used in this test session (recorded by `Store`, and `start_server` for the
server subprocesses): the end-of-session leak check looks at these, not at other users of this host."""


def _record_homes() -> None:
    from agentenv.runtime import store

    init = store.Store.__init__

    def recording_init(self, home, *args, **kwargs):
        init(self, home, *args, **kwargs)
        SESSION_HOMES.add(os.path.realpath(home))

    store.Store.__init__ = recording_init


def loop_devices(home: str) -> list[str]:
    """Loop devices whose backing file lies in data directory `home` (the disk-backed writable layers)."""
    out = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().startswith(home.rstrip("/") + "/"):
                out.append(backing.parent.parent.name)
        except OSError:  # detached meanwhile
            continue
    return sorted(out)


def host_state(homes: set[str]) -> dict[str, list[str]]:
    """The agentenv cgroups (``group/name``), layer mounts and loop devices on this host that belong to data
    dirs `homes`."""
    groups = []
    for home in sorted(homes):
        group = cgroups.group_for(home)
        groups += [f"{group}/{name}" for name in sorted({n for names in cgroups.leftover_groups(group).values()
                                                         for n in names})]
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if any(line.split()[4].startswith(home + "/") for home in homes)]
    loops = [name for home in sorted(homes) for name in loop_devices(home)]
    return {"cgroups": groups, "mounts": mounts, "loop_devices": loops}


if REASON is None:
    _record_homes()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when it left sandbox cgroups (so processes, seeds) or layer mounts of its data dirs behind."""
    if REASON is not None:
        return
    leaked = host_state(SESSION_HOMES)
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
    """What a data directory still holds: mounts, loop devices, agentenv cgroups, tool-server processes, layer
    dirs, records."""
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
    records += sorted(f"forks/{p.name}" for p in (home / "forks").glob("*")) if (home / "forks").exists() else []
    return {"mounts": mounts, "loop_devices": loop_devices(str(home)), "cgroups": cgroups.leftover_groups(group),
            "procs": procs, "layers": layers, "records": records}


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
