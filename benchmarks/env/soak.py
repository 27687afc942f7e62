"""Soak: many sandbox lifecycles with injected faults on one data directory, then a leak count.

One cycle: create, exec, snapshot, fork, restore, destroy all, with a fault injected into one sandbox in
turn (a memory bomb past `memory_mb`, a write past `disk_mb`, a fork bomb past `pids`, SIGKILL of a sandbox's
init, SIGKILL of a runtime process in the middle of forking the sandbox, SIGKILL of the HTTP server while a
client forks through it: `soak_server`). After each fault the sandbox's
siblings must still answer; after a killed fork the next runtime's `gc` must find the fork either complete
(every child answers) or undone (no child left) and the sandbox answering with its files; after the last
cycle a `gc` must find nothing to reclaim and the data directory must hold no process, mount, cgroup, layer
or record.

Run: ``python -m benchmarks.env.soak --cycles 10000 --workers 3`` (root; writes
benchmarks/results/env-soak-*.json). Each worker is a process with its own data directory; their counts add up.
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

FAULTS = ("none", "oom", "disk_full", "fork_bomb", "kill_init", "kill_runtime_mid_fork", "kill_server_mid_fork")
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


def _inject(sb, fault: str, report: Counter, others: tuple = ()) -> None:
    """Run `fault` in `sb`; count what the sandbox did (survived, error raised). `others`: sandboxes of the same
    fork tree, which must fork their own commands while a fork bomb holds `sb` at its share."""
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
            for other in others:  # each sandbox's processes count against its own share only
                r = other.exec("cat /root/f | cat", timeout=10)
                report[f"fork_bomb:others_{'fork' if r.stdout == 'hi' + chr(10) else 'cannot_fork'}_while_held"] += 1
            # the agent ends its bomb through the interpreter (while the bomb holds the share, a new command
            # cannot fork; the interpreter and the files API need no new process)
            sb.python.run(KILL_SLEEPERS)
        elif fault == "kill_init":
            os.kill(sb.backend.store.read_record(sb.id).pid, signal.SIGKILL)
            report["kill_init:sent"] += 1
        elif fault == "kill_runtime_mid_fork":
            _kill_mid_fork(sb, report)
        elif fault == "kill_server_mid_fork":
            from benchmarks.env.soak_server import kill_server_mid_fork

            kill_server_mid_fork(report)
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
        _inject(kids[0], fault, report, others=(sb, kids[1], restored))
        mark("fault")
        if fault != "kill_init":
            try:
                alive = (kids[0].files.read("/root/f") == "hi\n" and kids[0].python.run("6 * 7").value == "42"
                         and kids[0].exec("cat /root/f", timeout=10).stdout == "hi\n")
            except errors.SandboxError:
                alive = False
            report[f"{fault}:sandbox_{'answers' if alive else 'lost'}_after"] += 1
        for name, other in (("parent", sb), ("sibling", kids[1]), ("restored", restored)):
            r = other.exec("cat /root/f | cat")  # a pipeline forks: the fork bomb must not take their share
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


def soak(home: Path, cycles: int, max_seconds: float | None = None, *, offset: int = 0) -> dict:
    """`cycles` lifecycles (fewer if `max_seconds` runs out first) on a fresh backend at `home`; counts, wall
    time and what was left behind. `offset`: index of the first cycle (which fault comes first)."""
    from agentenv.runtime.local import NamespaceBackend
    from tests.agentenv.conftest import leftovers

    backend = NamespaceBackend(home)
    report: Counter = Counter()
    profile: dict = {}
    start = time.perf_counter()
    done = 0
    for i in track(range(offset, offset + cycles), "soak cycles"):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        cycle(backend, i, report, profile)
        done += 1
    seconds = time.perf_counter() - start
    gc_found = backend.gc()  # the seed stays; anything else it finds was leaked
    backend.gc(everything=True)
    left = leftovers(home)
    mean_ms = {fault: {phase: [round(sum(v) / len(v), 1), len(v)] for phase, v in phases.items()}
               for fault, phases in profile.items()}
    return {"cycles": done, "cycles_asked": cycles, "seconds": round(seconds, 2),
            "counts": dict(sorted(report.items())),
            "mean_ms_by_fault_and_phase": mean_ms, "mean_ms_format": "[mean ms, count]",
            "gc_reclaimed_after_soak": gc_found, "leftovers": left, "leaked": any(left.values())}


def soak_parallel(workers: int, cycles: int, max_seconds: float | None) -> dict:
    """`cycles` lifecycles split over `workers` processes (own data directory each); their results summed."""
    per = -(-cycles // workers)
    outs = [Path(tempfile.mkstemp(suffix=".json")[1]) for _ in range(workers)]
    cmd = [sys.executable, "-m", "benchmarks.env.soak", "--cycles", str(per)]
    if max_seconds is not None:
        cmd += ["--max-seconds", str(max_seconds)]
    procs = [subprocess.Popen([*cmd, "--offset", str(w * per), "--worker-out", str(out)], cwd=REPO)
             for w, out in enumerate(outs)]
    start = time.perf_counter()
    for proc in procs:
        proc.wait()
    results = []
    for proc, out in zip(procs, outs):
        text = out.read_text()
        out.unlink()
        if proc.returncode != 0 or not text:
            raise RuntimeError(f"soak worker exited {proc.returncode} without a result")
        results.append(json.loads(text))
    counts: Counter = Counter()
    gc_found: Counter = Counter()
    mean_ms: dict = {}
    for r in results:
        counts.update(r["counts"])
        gc_found.update(r["gc_reclaimed_after_soak"])
        for fault, phases in r["mean_ms_by_fault_and_phase"].items():
            for phase, (mean, n) in phases.items():
                total, count = mean_ms.setdefault(fault, {}).get(phase, (0.0, 0))
                mean_ms[fault][phase] = (total + mean * n, count + n)
    mean_ms = {f: {p: [round(t / max(n, 1), 1), n] for p, (t, n) in ph.items()} for f, ph in mean_ms.items()}
    return {"cycles": sum(r["cycles"] for r in results), "cycles_asked": cycles, "workers": workers,
            "seconds": round(time.perf_counter() - start, 2), "counts": dict(sorted(counts.items())),
            "mean_ms_by_fault_and_phase": mean_ms, "mean_ms_format": "[mean ms, count]",
            "gc_reclaimed_after_soak": dict(gc_found), "leftovers": [r["leftovers"] for r in results],
            "leaked": any(r["leaked"] for r in results)}


def main() -> None:
    from benchmarks.harness import Row, write_results

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=1000, help="sandbox lifecycles to run (default 1000)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop starting cycles after this long (the result says how many ran)")
    parser.add_argument("--workers", type=int, default=1, help="processes running cycles side by side")
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.workers > 1:
        result = soak_parallel(args.workers, args.cycles, args.max_seconds)
    else:
        home = Path(tempfile.mkdtemp(prefix="agentenv-soak-", dir="/tmp"))
        try:
            result = soak(home, args.cycles, args.max_seconds, offset=args.offset)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        if args.worker_out:
            Path(args.worker_out).write_text(json.dumps(result))
            return
    print(json.dumps(result, indent=1))
    row = Row(case=f"soak-{result['cycles']}", baseline="none (correctness run)", baseline_ms=None,
              ours_ms=result["seconds"] * 1e3 / max(result["cycles"], 1), extra=result,
              note="ours_ms: wall ms per lifecycle (create, exec, snapshot, fork 2, restore, fault, destroy), "
                   "all workers together")
    scratch = Path(tempfile.mkdtemp())
    print(write_results("env-soak", [row], markdown=scratch / "BENCHMARKS.md"))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
