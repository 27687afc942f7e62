"""Soak: many sandbox lifecycles with injected faults on one data directory, then a leak count.

One cycle: create, exec, snapshot, fork, restore, destroy all, with a fault injected into one sandbox in
turn (a memory bomb past `memory_mb`, a write past `disk_mb`, a fork bomb past `pids`, SIGKILL of a sandbox's
init, SIGKILL of a runtime process in the middle of forking the sandbox). After each fault the sandbox's
siblings must still answer; after a killed fork the next runtime's `gc` must find the fork either complete
(every child answers) or undone (no child left) and the sandbox answering with its files; after the last
cycle a `gc` must find nothing to reclaim and the data directory must hold no process, mount, cgroup, layer
or record.

Run: ``python -m benchmarks.env.soak --cycles 1000`` (root; writes benchmarks/results/env-soak-*.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from benchmarks.progress import track

FAULTS = ("none", "oom", "disk_full", "fork_bomb", "kill_init", "kill_runtime_mid_fork")
log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
_FORKER = """
import sys
sys.path[:0] = [{src!r}, {repo!r}]
from agentenv import Sandbox
from agentenv.runtime.local import NamespaceBackend
backend = NamespaceBackend({home!r})
sb = Sandbox.connect({sid!r}, backend=backend)
print("ready", flush=True)
for i in range(1000):
    if i % 2:
        sb.exec("echo $RANDOM >> /root/g")  # a changed sandbox: this fork seals its layer and moves it
    sb.fork(2)
"""
OOM = "python3 -c 'b = []\nwhile True: b.append(bytearray(1 << 20))'"
DISK_FULL = "dd if=/dev/zero of=/root/fill bs=1M count=64 2>&1; echo rc=$?"
# past the pids limit; the sleepers stay, holding the sandbox at its limit (a new command then gets "Cannot
# fork" at once), while the sandbox's API must still answer (files, interpreter)
FORK_BOMB = "for i in $(seq 200); do sleep 30 >/dev/null 2>&1 & done 2>/dev/null"
KILL_SLEEPERS = """
import os
for p in os.listdir('/proc'):
    try:
        if p.isdigit() and open(f'/proc/{p}/comm').read().strip() == 'sleep':
            os.kill(int(p), 9)
    except OSError:
        pass
"""


def _inject(sb, fault: str, report: Counter) -> None:
    """Run `fault` in `sb`; count what the sandbox did (survived, error raised)."""
    from agentenv import errors

    try:
        if fault == "oom":
            r = sb.exec(OOM, timeout=30)
            report[f"oom:exit_{r.exit_code}"] += 1
        elif fault == "disk_full":
            r = sb.exec(DISK_FULL, timeout=30)
            report["disk_full:enospc" if "No space left" in r.stdout else "disk_full:other"] += 1
        elif fault == "fork_bomb":
            r = sb.exec(FORK_BOMB, timeout=10)
            report[f"fork_bomb:exit_{r.exit_code}"] += 1
            n = len(sb.python.run("import os; [p for p in os.listdir('/proc') if p.isdigit()]").value.split(","))
            report[f"fork_bomb:{'held' if n <= 64 else 'not_held'}_by_pids_limit"] += 1
            # the sleepers also count against the parent's share (a fork's user namespace nests in its parent's,
            # and RLIMIT_NPROC counts up that chain): end them through the interpreter, which needs no fork
            sb.python.run(KILL_SLEEPERS)
        elif fault == "kill_init":
            os.kill(sb.backend.store.read_record(sb.id).pid, signal.SIGKILL)
            report["kill_init:sent"] += 1
        elif fault == "kill_runtime_mid_fork":
            _kill_mid_fork(sb, report)
    except errors.SandboxError as e:
        report[f"{fault}:{type(e).__name__}"] += 1


def _kill_mid_fork(sb, report: Counter) -> None:
    """Another runtime process forks `sb` over and over and is SIGKILLed at a random instant; then this
    runtime's `gc` recovers, and every fork of `sb` is complete (each child answers) or gone."""
    from agentenv.runtime.local import NamespaceBackend

    backend: NamespaceBackend = sb.backend
    before = {r.id for r in backend.store.all_records()}
    code = _FORKER.format(src=str(REPO / "src"), repo=str(REPO), home=str(backend.store.home), sid=sb.id)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        proc.stdout.readline()
        time.sleep(random.uniform(0.0, 0.3))
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    recovered = backend.gc()
    report["kill_runtime_mid_fork:forks_recovered"] += recovered.get("forks", 0)
    for rec in backend.store.all_records():
        if rec.id in before or rec.parent != sb.id:
            continue
        try:
            kid = type(sb).connect(rec.id, backend=backend)
            ok = kid.exec("cat /root/f", timeout=10).stdout == "hi\n"
            kid.destroy()
        except Exception:  # noqa: BLE001 - counted: a fork left half made
            ok = False
            backend.destroy(rec.id)
        report[f"kill_runtime_mid_fork:child_{'complete' if ok else 'broken'}"] += 1


def cycle(backend, i: int, report: Counter, profile: dict | None = None) -> None:
    """One lifecycle with fault `FAULTS[i % len(FAULTS)]` injected into the first forked child; with
    `profile`, adds the ms of each phase to ``profile[fault][phase]``."""
    from agentenv import Limits, Sandbox, errors

    fault = FAULTS[i % len(FAULTS)]
    made = []
    clock = [time.perf_counter()]

    def mark(phase: str) -> None:
        now = time.perf_counter()
        if profile is not None:
            profile.setdefault(fault, {}).setdefault(phase, []).append((now - clock[0]) * 1e3)
        clock[0] = now

    try:
        sb = Sandbox.create("host", backend=backend, limits=Limits(memory_mb=128, pids=64, disk_mb=32))
        made.append(sb)
        assert sb.exec("echo hi > /root/f && cat /root/f").stdout == "hi\n"
        snap = sb.snapshot()
        kids = sb.fork(2)
        made += kids
        restored = Sandbox.restore(snap, backend=backend)
        made.append(restored)
        mark("create_snapshot_fork_restore")
        _inject(kids[0], fault, report)
        mark("fault")
        if fault != "kill_init":
            try:
                alive = (kids[0].files.read("/root/f") == "hi\n" and kids[0].python.run("6 * 7").value == "42"
                         and kids[0].exec("cat /root/f", timeout=10).stdout == "hi\n")
            except errors.SandboxError:
                alive = False
            report[f"{fault}:sandbox_{'answers' if alive else 'lost'}_after"] += 1
        for name, other in (("parent", sb), ("sibling", kids[1]), ("restored", restored)):
            r = other.exec("cat /root/f")
            if r.stdout != "hi\n":
                report["sibling_broken"] += 1
                log.warning("soak cycle %d (%s): %s answered %r %r (exit %s)", i, fault, name, r.stdout,
                            r.stderr[-300:], r.exit_code)
        try:
            backend.destroy(snap)
        except errors.SandboxNotFoundError:
            pass
        report["cycles_ok"] += 1
        mark("checks")
    except Exception as e:  # noqa: BLE001 - counted and reported, the soak goes on
        report[f"cycle_error:{type(e).__name__}"] += 1
        log.warning("soak cycle %d (%s): %s", i, fault, "".join(traceback.format_exception(e))[-3000:])
    finally:
        for sb in reversed(made):
            sb.destroy()
        mark("destroy")


def soak(home: Path, cycles: int, max_seconds: float | None = None) -> dict:
    """`cycles` lifecycles (fewer if `max_seconds` runs out first) on a fresh backend at `home`; counts, wall
    time and what was left behind."""
    from agentenv.runtime.local import NamespaceBackend
    from tests.agentenv.conftest import leftovers

    backend = NamespaceBackend(home)
    report: Counter = Counter()
    profile: dict = {}
    start = time.perf_counter()
    done = 0
    for i in track(range(cycles), "soak cycles"):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        cycle(backend, i, report, profile)
        done += 1
    seconds = time.perf_counter() - start
    gc_found = backend.gc()  # the seed stays; anything else it finds was leaked
    backend.gc(everything=True)
    left = leftovers(home)
    mean_ms = {fault: {phase: round(sum(v) / len(v), 1) for phase, v in phases.items()}
               for fault, phases in profile.items()}
    return {"cycles": done, "cycles_asked": cycles, "seconds": round(seconds, 2),
            "counts": dict(sorted(report.items())),
            "mean_ms_by_fault_and_phase": mean_ms,
            "gc_reclaimed_after_soak": gc_found, "leftovers": left, "leaked": any(left.values())}


def main() -> None:
    from benchmarks.harness import Row, write_results

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=1000, help="sandbox lifecycles to run (default 1000)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop starting cycles after this long (the result says how many ran)")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="agentenv-soak-", dir="/tmp"))
    try:
        result = soak(home, args.cycles, args.max_seconds)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result, indent=1))
    row = Row(case=f"soak-{result['cycles']}", baseline="none (correctness run)", baseline_ms=None,
              ours_ms=result["seconds"] * 1e3 / max(result["cycles"], 1), extra=result,
              note="ours_ms: mean ms per lifecycle (create, exec, snapshot, fork 2, restore, fault, destroy)")
    scratch = Path(tempfile.mkdtemp())
    print(write_results("env-soak", [row], markdown=scratch / "BENCHMARKS.md"))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
