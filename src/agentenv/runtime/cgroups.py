"""Per-sandbox cgroups (v1 hierarchies): memory, pids, CPU quota and the freezer.

Each sandbox gets `<root>/<controller>/<group>/<name>` in the memory, pids, cpu and freezer hierarchies, where
`group` is ``agentenv-<hash of the data directory>`` so runtimes on different data directories never touch
each other's groups.
Processes join by pid; children inherit. Removing a cgroup needs it empty, so `destroy` first kills what is
left (through the freezer: freeze, SIGKILL, thaw, so nothing forks away meanwhile) and then rmdir's.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu", "freezer")


def group_for(home: str) -> str:
    """The parent group name for a data directory."""
    import hashlib

    return "agentenv-" + hashlib.sha256(os.path.realpath(home).encode()).hexdigest()[:12]
CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupLimits:
    """Resource limits applied to one sandbox's cgroup."""

    memory_bytes: int
    """Hard memory limit (RSS + page cache + tmpfs pages, incl. the writable layer), in bytes."""
    pids: int
    """Maximum number of tasks (processes and threads)."""
    cpus: float
    """CPU quota in cores (0.5 = half a core over each 100 ms period); 0 means unlimited."""


def available(root: Path = CGROUP_ROOT) -> bool:
    """Whether every controller we need has a writable v1 hierarchy under `root`."""
    return all(os.access(root / c, os.W_OK) for c in CONTROLLERS)


class Cgroup:
    """One sandbox's cgroup across the v1 controllers.

    Args:
        name: the leaf name, unique per sandbox (its id).
        group: the parent group (`group_for(home)`).
        root: where the v1 hierarchies are mounted.
    """

    def __init__(self, name: str, group: str, root: Path = CGROUP_ROOT):
        for arg, value in (("name", name), ("group", group)):
            if not value or "/" in value or value in (".", ".."):
                raise ValueError(f"{arg} must be a single path component, got {value!r}")
        self.name = name
        self.group = group
        self.root = root

    def path(self, controller: str) -> Path:
        return self.root / controller / self.group / self.name

    def create(self, limits: CgroupLimits) -> None:
        """Create the groups and write `limits`; existing groups are reused."""
        for controller in CONTROLLERS:
            self.path(controller).mkdir(parents=True, exist_ok=True)
        mem = self.path("memory")
        (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        # no swap on these hosts, but cap it anyway where the knob exists
        memsw = mem / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(limits.memory_bytes))
        (self.path("pids") / "pids.max").write_text(str(limits.pids))
        cpu = self.path("cpu")
        (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        quota = -1 if limits.cpus <= 0 else max(1000, int(limits.cpus * CFS_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, pid: int) -> None:
        """Move `pid` (a host pid) into every controller's group."""
        for controller in CONTROLLERS:
            (self.path(controller) / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """Host pids currently in the group (read from the pids controller)."""
        try:
            text = (self.path("pids") / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(line) for line in text.split()]

    def freeze(self) -> None:
        self._set_freezer("FROZEN")

    def thaw(self) -> None:
        self._set_freezer("THAWED")

    def _set_freezer(self, state: str) -> None:
        state_file = self.path("freezer") / "freezer.state"
        state_file.write_text(state)
        deadline = time.monotonic() + 5.0
        while state_file.read_text().strip() != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup freezer of {self.name} did not reach {state} within 5 s")
            time.sleep(0.0005)

    def oom_kills(self) -> int:
        """How many OOM kills the memory controller has done in this group."""
        try:
            for line in (self.path("memory") / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except FileNotFoundError:
            pass
        return 0

    def memory_usage(self) -> int:
        return int((self.path("memory") / "memory.usage_in_bytes").read_text())

    def kill_all(self, timeout_s: float = 30.0) -> None:
        """SIGKILL every process in the group and wait until it is empty."""
        freezer = self.path("freezer")
        if not freezer.exists():
            return
        try:
            self.freeze()
        except (OSError, TimeoutError) as error:
            log.debug("freeze before kill failed for %s: %s", self.name, error)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.thaw()
        except (OSError, TimeoutError) as error:
            log.debug("thaw after kill failed for %s: %s", self.name, error)
        deadline = time.monotonic() + timeout_s
        while self.pids():
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.name} still has processes {self.pids()} after SIGKILL")
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.001)

    def destroy(self) -> None:
        """Kill what is left and remove the groups (idempotent)."""
        self.kill_all()
        for controller in CONTROLLERS:
            path = self.path(controller)
            # EBUSY while the last task is being torn down; on a loaded host that can take well over 0.4 s
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("could not remove cgroup %s", path)
                        break
                    time.sleep(0.002)


def warm_migration_lock(root: Path = CGROUP_ROOT) -> None:
    """Start the RCU grace period that the next cgroup move would wait for, without moving anything.

    Every v1 move takes the global cgroup_threadgroup_rwsem for writing, and the first writer after a
    quiet spell waits for an RCU grace period (about 7 ms on this VM: HZ=250); writers that follow
    within about one more grace period do not wait. Writing our own pid to the pids group we are already
    in takes that lock and moves nothing, so a fork calls this before its children exist, and their
    moves a few ms later find the lock warm. Errors are ignored: it is only an optimisation.
    """
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(","):
                (root / "pids" / path.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
                return
    except (OSError, ValueError) as error:
        log.debug("warming the cgroup migration lock failed: %s", error)


def leftover_groups(group: str, root: Path = CGROUP_ROOT) -> dict[str, list[str]]:
    """Names of the sandbox groups under `group`, per controller (for gc and leak checks)."""
    found: dict[str, list[str]] = {}
    for controller in CONTROLLERS:
        base = root / controller / group
        if base.is_dir():
            names = sorted(p.name for p in base.iterdir() if p.is_dir())
            if names:
                found[controller] = names
    return found
