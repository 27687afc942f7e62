"""Soak: many sandbox lifecycles with injected faults on one data directory, then a leak count.

One cycle: create, exec, snapshot, fork, restore, destroy all, with a fault injected into one sandbox in
turn (a memory bomb past `memory_mb`, a write past `disk_mb`, a fork bomb past `pids`, SIGKILL of a sandbox's
init, SIGKILL of a runtime process in the middle of forking the sandbox, SIGKILL of the HTTP server while a
client forks through it: `soak_server`). After each fault the sandbox's
siblings must still answer; after a killed fork the next runtime's `gc` must find the fork either complete
(every child answers) or undone (no child left) and the sandbox answering with its files; after the last
cycle a `gc` must find nothing to reclaim and the data directory must hold no process, mount, cgroup, layer
or record. Every failure (a cycle's exception, a sandbox lost or broken after a fault) is counted, and the first
`MAX_FAILURES` are listed in the result with their fault, phase, exception and traceback tail (``failures``).

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
MAX_FAILURES = 20
"""Failures listed in full in a result (all of them are counted)."""
TRACEBACK_LINES = 40
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
import os, time

def live_sleepers():
    pids = []
    for p in os.listdir('/proc'):
        try:
            stat = open(f'/proc/{p}/stat').read() if p.isdigit() else ''
        except OSError:
            continue
        if stat and stat[stat.index('(') + 1:stat.rindex(')')] == 'sleep' and stat[stat.rindex(')') + 2] != 'Z':
            pids.append(int(p))
    return pids

# SIGKILL lands asynchronously: wait until every sleeper has exited (a zombie holds its pid only until the
# sandbox's init reaps it before the next request), so the next command finds its pid share free again
deadline = time.monotonic() + 10
while (pids := live_sleepers()) and time.monotonic() < deadline:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    time.sleep(0.01)
if pids:
    raise RuntimeError(f"{len(pids)} sleepers still alive 10 s after SIGKILL")
"""


class Report(Counter):
    """Outcome counts, plus the first `MAX_FAILURES` failures in full (`fail`), each tagged with where the
    soak was (`at`: cycle, fault, phase) and what the running fault noted (`note`: e.g. when it killed)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[dict] = []
        self.context: dict = {}

    def at(self, **where) -> None:
        """Where the soak is now (``cycle`` and ``fault`` start a new context; ``phase`` updates it)."""
        if "cycle" in where:
            self.context = {}
        self.context.update(where)

    def note(self, **detail) -> None:
        """Facts of the running fault, listed with any failure of this cycle."""
        self.context.setdefault("noted", {}).update(detail)

    def fail(self, key: str, exc: BaseException | None = None, **detail) -> None:
        """Count outcome `key` and, among the first `MAX_FAILURES`, list it with `exc` and `detail`."""
        self[key] += 1
        self["failures_total"] += 1
        if len(self.failures) >= MAX_FAILURES:
            return
        entry = {**self.context, "outcome": key, **detail}
        if exc is not None:
            entry.update(error=type(exc).__name__, message=str(exc)[-2000:],
                         traceback="".join(traceback.format_exception(exc)).splitlines()[-TRACEBACK_LINES:])
        self.failures.append(entry)


def describe(backend, sid: str) -> dict:
    """What the host knows of sandbox `sid`: its record, whether its tool server runs, its socket, its cgroup's
    task count and memory, open forks."""
    from dataclasses import asdict

    from agentenv.runtime.store import proc_start_time

    rec = backend.store.read_record(sid)
    out: dict = {"record": None if rec is None else asdict(rec), "sock": backend.store.sock(sid).exists()}
    if rec is not None:
        out["alive"] = proc_start_time(rec.pid) == rec.start_time
        try:
            status = Path(f"/proc/{rec.pid}/status").read_text().splitlines()
            out["proc_state"] = next((line for line in status if line.startswith("State:")), "")
        except OSError:
            out["proc_state"] = "gone"
    cg = backend._cgroup(sid)
    try:
        out["cgroup"] = {"pids": (cg.path("pids") / "pids.current").read_text().strip(),
                         "memory_bytes": cg.memory_usage(), "oom_kills": cg.oom_kills()}
    except OSError as e:
        out["cgroup"] = f"unreadable: {e}"
    out["pending_forks"] = [{"fork_id": f, "writer_alive": w, "parent": p.id, "children": c}
                            for f, w, p, c in backend.store.pending_forks()]
    return out


def _inject(sb, fault: str, report: Report, others: tuple = ()) -> None:
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
            r = sb.python.run(KILL_SLEEPERS)
            if r.error:
                report.fail("fork_bomb:kill_sleepers_failed", None, error=r.error, traceback=r.traceback[-2000:])
        elif fault == "kill_init":
            os.kill(sb.backend.store.read_record(sb.id).pid, signal.SIGKILL)
            report["kill_init:sent"] += 1
        elif fault == "kill_runtime_mid_fork":
            _kill_mid_fork(sb, report)
        elif fault == "kill_server_mid_fork":
            from benchmarks.env.soak_server import kill_server_mid_fork

            kill_server_mid_fork(report)
    except errors.SandboxError as e:
        report.fail(f"{fault}:{type(e).__name__}", e)


def kill_forker_after(home: Path, sid: str, delay_s: float) -> str:
    """Start a runtime process forking sandbox `sid` of data directory `home` over and over (`_FORKER`),
    SIGKILL it `delay_s` after it is ready; returns the tail of its stderr."""
    code = _FORKER.format(src=str(REPO / "src"), repo=str(REPO), home=str(home), sid=sid)
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err)
        try:
            proc.stdout.readline()
            time.sleep(delay_s)
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        err.seek(0)
        return err.read()[-1500:].decode(errors="replace")


def _kill_mid_fork(sb, report: Report) -> None:
    """Another runtime process forks `sb` over and over and is SIGKILLed at a random instant; then this
    runtime's `gc` recovers, and every fork of `sb` is complete (each child answers) or gone."""
    from agentenv.runtime.local import NamespaceBackend

    backend: NamespaceBackend = sb.backend
    before = {r.id for r in backend.store.all_records()}
    delay = random.uniform(0.0, 0.3)
    stderr = kill_forker_after(backend.store.home, sb.id, delay)
    report.note(kill_after_s=round(delay, 4), forker_stderr=stderr,
                pending_forks_before_gc=describe(backend, sb.id)["pending_forks"])
    recovered = backend.gc()
    report.note(gc=recovered)
    report["kill_runtime_mid_fork:forks_recovered"] += recovered.get("forks", 0)
    for rec in backend.store.all_records():
        if rec.id in before or rec.parent != sb.id:
            continue
        out = error = None
        try:
            kid = type(sb).connect(rec.id, backend=backend)
            out = kid.exec("cat /root/f", timeout=10).stdout
            kid.destroy()
        except Exception as e:  # noqa: BLE001 - counted: a fork left half made
            error = e
            backend.destroy(rec.id)
        if out == "hi\n":
            report["kill_runtime_mid_fork:child_complete"] += 1
        else:
            report.fail("kill_runtime_mid_fork:child_broken", error, child=rec.id, stdout=out)


def cycle(backend, i: int, report: Report, profile: dict | None = None) -> None:
    """One lifecycle with fault `FAULTS[i % len(FAULTS)]` injected into the first forked child; with
    `profile`, adds the ms of each phase to ``profile[fault][phase]``."""
    from agentenv import Limits, Sandbox, errors

    fault = FAULTS[i % len(FAULTS)]
    made = []
    clock = [time.perf_counter()]
    report.at(cycle=i, fault=fault, phase="create_snapshot_fork_restore")

    def mark(phase: str, following: str) -> None:
        now = time.perf_counter()
        if profile is not None:
            profile.setdefault(fault, {}).setdefault(phase, []).append((now - clock[0]) * 1e3)
        clock[0] = now
        report.at(phase=following)

    try:
        sb = Sandbox.create("host", backend=backend, limits=Limits(memory_mb=128, pids=64, disk_mb=32))
        made.append(sb)
        assert sb.exec("echo hi > /root/f && cat /root/f").stdout == "hi\n"
        snap = sb.snapshot()
        kids = sb.fork(2)
        made += kids
        restored = Sandbox.restore(snap, backend=backend)
        made.append(restored)
        mark("create_snapshot_fork_restore", "fault")
        _inject(kids[0], fault, report, others=(sb, kids[1], restored))
        mark("fault", "checks")
        if fault != "kill_init":
            got = error = None
            answers: list = []  # each answer in full (a python error, a command's stderr and exit code)
            try:
                answers.append(kids[0].files.read("/root/f"))
                answers.append(kids[0].python.run("6 * 7"))
                answers.append(kids[0].exec("cat /root/f", timeout=10))
                got = [answers[0], answers[1].value, answers[2].stdout]
            except errors.SandboxError as e:
                error = e
            if got == ["hi\n", "42", "hi\n"]:
                report[f"{fault}:sandbox_answers_after"] += 1
            else:
                report.fail(f"{fault}:sandbox_lost_after", error, got=got, answers=[repr(a)[-1500:] for a in answers],
                            sandbox=describe(backend, kids[0].id))
        for name, other in (("parent", sb), ("sibling", kids[1]), ("restored", restored)):
            r = other.exec("cat /root/f | cat")  # a pipeline forks: the fork bomb must not take their share
            if r.stdout != "hi\n":
                report.fail("sibling_broken", None, sandbox=name, stdout=r.stdout, stderr=r.stderr[-300:],
                            exit_code=r.exit_code)
                log.warning("soak cycle %d (%s): %s answered %r %r (exit %s)", i, fault, name, r.stdout,
                            r.stderr[-300:], r.exit_code)
        try:
            backend.destroy(snap)
        except errors.SandboxNotFoundError:
            pass
        report["cycles_ok"] += 1
        mark("checks", "destroy")
    except Exception as e:  # noqa: BLE001 - counted and listed, the soak goes on
        report.fail(f"cycle_error:{type(e).__name__}", e)
        log.warning("soak cycle %d (%s): %s", i, fault, "".join(traceback.format_exception(e))[-3000:])
    finally:
        for sb in reversed(made):
            sb.destroy()
        mark("destroy", "between_cycles")


def soak(home: Path, cycles: int, max_seconds: float | None = None, *, offset: int = 0) -> dict:
    """`cycles` lifecycles (fewer if `max_seconds` runs out first) on a fresh backend at `home`; counts, wall
    time and what was left behind. `offset`: index of the first cycle (which fault comes first)."""
    from agentenv.runtime.local import NamespaceBackend
    from tests.agentenv.conftest import leftovers

    backend = NamespaceBackend(home)
    report = Report()
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
            "counts": dict(sorted(report.items())), "failures": report.failures,
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
    failures = []
    for w, r in enumerate(results):
        counts.update(r["counts"])
        failures += [{"worker": w, **f} for f in r["failures"]]
        gc_found.update(r["gc_reclaimed_after_soak"])
        for fault, phases in r["mean_ms_by_fault_and_phase"].items():
            for phase, (mean, n) in phases.items():
                total, count = mean_ms.setdefault(fault, {}).get(phase, (0.0, 0))
                mean_ms[fault][phase] = (total + mean * n, count + n)
    mean_ms = {f: {p: [round(t / max(n, 1), 1), n] for p, (t, n) in ph.items()} for f, ph in mean_ms.items()}
    return {"cycles": sum(r["cycles"] for r in results), "cycles_asked": cycles, "workers": workers,
            "seconds": round(time.perf_counter() - start, 2), "counts": dict(sorted(counts.items())),
            "failures": sorted(failures, key=lambda f: f["cycle"])[:MAX_FAILURES],
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
