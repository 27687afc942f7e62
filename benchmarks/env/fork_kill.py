"""Stress: SIGKILL a runtime process at random instants while it forks a sandbox, then `gc` and check the sandbox.

Each round, another runtime process forks one sandbox over and over (the soak's `_FORKER`: every other fork
follows a write, so the parent moves onto a new writable layer) and is SIGKILLed after a random delay; this
process's `gc` then finishes or undoes the fork. The sandbox must answer (files, interpreter, commands) with
its files, its record must name the writable layer its tool server really writes to, and every child left
must answer with the parent's files. Failures are printed (and listed in the JSON) with what the host knew.
With ``--kernels``, the sandbox keeps a live Python kernel (its copy is carried into every child); without,
the check's kernel is ended before the next round, as in the soak.

Run: ``python -m benchmarks.env.fork_kill --rounds 200 [--kernels]`` (root; its own data directory; prints a
JSON summary). Not a CI test: a round takes about a second.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.env.soak import Report, describe, kill_forker_after


def _check_parent(backend, sb, round_no: int, report: Report) -> bool:
    """The sandbox answers with its files, and writes land in the writable layer its record names."""
    from agentenv import errors

    marker = f"m{round_no}-{os.urandom(3).hex()}"
    got = error = None
    try:
        # the bounded request first: a tool server that hangs must fail the check, not the stress
        got = [sb.python.run("6 * 7", timeout=5).value, sb.files.read("/root/f"),
               sb.exec(f"cat /root/f && touch /root/{marker}", timeout=10).stdout]
    except errors.SandboxError as e:
        error = e
    if got != ["42", "hi\n", "hi\n"]:
        report.fail("parent_lost", error, got=got, sandbox=describe(backend, sb.id))
        return False
    rec = backend.store.read_record(sb.id)
    if not (backend.store.diff(rec.upper) / "root" / marker).exists():
        report.fail("parent_record_names_another_layer", None, sandbox=describe(backend, sb.id))
        return False
    report["parent_answers"] += 1
    return True


def _check_children(backend, sb, before: set[str], report: Report) -> None:
    from agentenv import Sandbox

    for rec in backend.store.all_records():
        if rec.id in before or rec.parent != sb.id:
            continue
        out = error = None
        try:
            out = Sandbox.connect(rec.id, backend=backend).exec("cat /root/f", timeout=10).stdout
        except Exception as e:  # noqa: BLE001 - listed: a fork left half made
            error = e
        if out == "hi\n":
            report["child_complete"] += 1
        else:
            report.fail("child_broken", error, child=rec.id, stdout=out)
        backend.destroy(rec.id)


def stress(home: Path, rounds: int, max_delay_s: float, kernels: bool) -> dict:
    from agentenv import Limits, Sandbox
    from agentenv.runtime.local import NamespaceBackend
    from tests.agentenv.conftest import leftovers

    backend = NamespaceBackend(home)
    report = Report()
    start = time.perf_counter()
    sb = None
    for i in range(rounds):
        report.at(cycle=i, fault="kill_runtime_mid_fork", phase="setup")
        if sb is None:
            sb = Sandbox.create("host", backend=backend, limits=Limits(memory_mb=128, pids=64, disk_mb=32))
            sb.exec("echo hi > /root/f")
        before = {r.id for r in backend.store.all_records()}
        delay = random.uniform(0.0, max_delay_s)
        stderr = kill_forker_after(home, sb.id, delay)
        report.note(kill_after_s=round(delay, 4), forker_stderr=stderr, before_gc=describe(backend, sb.id))
        report.at(phase="gc")
        recovered = backend.gc()
        report.note(gc=recovered)
        report["forks_recovered"] += recovered.get("forks", 0)
        report.at(phase="check")
        ok = _check_parent(backend, sb, i, report)
        _check_children(backend, sb, before, report)
        if ok and not kernels:
            sb.python.restart_context()
        if not ok:
            failed = report.failures[-1] if report.failures else {}
            print(json.dumps(failed, indent=1, default=str), file=sys.stderr, flush=True)
            try:
                sb.destroy()
            except Exception:  # noqa: BLE001 - gone already
                pass
            sb = None
    if sb is not None:
        sb.destroy()
    gc_found = backend.gc()
    backend.gc(everything=True)
    left = leftovers(home)
    return {"rounds": rounds, "max_delay_s": max_delay_s, "kernels": kernels,
            "seconds": round(time.perf_counter() - start, 1),
            "counts": dict(sorted(report.items())), "failures": report.failures,
            "gc_reclaimed_after": gc_found, "leftovers": left}


def main() -> None:
    from benchmarks.harness import Row, write_results

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=100, help="kills (default 100)")
    parser.add_argument("--max-delay", type=float, default=0.3, help="kill 0..this many seconds after the "
                        "forker is ready (default 0.3)")
    parser.add_argument("--kernels", action="store_true", help="keep a live Python kernel in the forked sandbox")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="agentenv-forkkill-", dir="/tmp"))
    try:
        result = stress(home, args.rounds, args.max_delay, args.kernels)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result, indent=1, default=str))
    row = Row(case=f"fork-kill-{args.rounds}{'-kernels' if args.kernels else ''}", baseline="none (correctness run)",
              baseline_ms=None, ours_ms=result["seconds"] * 1e3 / max(args.rounds, 1), extra=result,
              note="ours_ms: wall ms per round (a forker started and SIGKILLed, gc, checks)")
    scratch = Path(tempfile.mkdtemp())
    print(write_results("env-fork-kill", [row], markdown=scratch / "BENCHMARKS.md"))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
