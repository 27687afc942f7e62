"""What a kernel process per interpreter context costs: fork with live kernels, a fresh kernel, a crash.

Interleaved rep by rep on one data directory: `fork(1)` of a sandbox whose interpreter was never used (no
kernel: the baseline) vs one with 1 and with 2 live kernels (default plus a context, each holding about 100 MB
of Python objects); a first run in a fresh context (the kernel's start); a segfault in a kernel and the next run
(its replacement). Median ms.

Run: ``python -m benchmarks.env.kernels --reps 20`` (root; writes benchmarks/results/env-kernels-*.json).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

STATE = "state = list(range(2_500_000))"  # about 100 MB of objects, shared copy-on-write by a carried kernel


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run(home: Path, reps: int) -> dict[str, list[float]]:
    from agentenv import Limits, Sandbox
    from agentenv.runtime.local import NamespaceBackend

    backend = NamespaceBackend(home)
    limits = Limits(memory_mb=512)
    times: dict[str, list[float]] = {k: [] for k in ("fork_no_kernel", "fork_1_kernel", "fork_2_kernels",
                                                     "kernel_start", "crash", "run_after_crash")}
    try:
        bare = Sandbox.create("host", backend=backend, limits=limits)
        one = Sandbox.create("host", backend=backend, limits=limits)
        two = Sandbox.create("host", backend=backend, limits=limits)
        one.python.run(STATE)
        two.python.run(STATE)
        two.python.run(STATE, context=two.python.create_context())
        for _ in range(reps):
            for name, sb in (("fork_no_kernel", bare), ("fork_1_kernel", one), ("fork_2_kernels", two)):
                kids: list = []
                times[name].append(_ms(lambda sb=sb, kids=kids: kids.extend(sb.fork(1))))
                for kid in kids:
                    kid.destroy()
            ctx = bare.python.create_context()
            times["kernel_start"].append(_ms(lambda ctx=ctx: bare.python.run("1", context=ctx)))
            times["crash"].append(_ms(lambda ctx=ctx: bare.python.run("import ctypes; ctypes.string_at(0)",
                                                                      context=ctx)))
            times["run_after_crash"].append(_ms(lambda ctx=ctx: bare.python.run("1", context=ctx)))
            bare.python.remove_context(ctx)
        for sb in (bare, one, two):
            sb.destroy()
    finally:
        backend.gc(everything=True)
    return times


def main() -> None:
    from benchmarks.harness import Row, write_results

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    home = Path(tempfile.mkdtemp(prefix="agentenv-kernels-", dir="/tmp"))
    try:
        times = run(home, args.reps)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [Row(case=f"fork(1) with {n}", baseline="fork(1), no kernel", baseline_ms=med["fork_no_kernel"],
                ours_ms=med[key], extra={"reps": args.reps})
            for n, key in (("1 live kernel", "fork_1_kernel"), ("2 live kernels", "fork_2_kernels"))]
    rows += [Row(case=name, baseline="none", baseline_ms=None, ours_ms=med[name], extra={"reps": args.reps})
             for name in ("kernel_start", "crash", "run_after_crash")]
    for row in rows:
        print(f"{row.case}: {row.ours_ms:.1f} ms (baseline {row.baseline_ms})")
    scratch = Path(tempfile.mkdtemp())
    print(write_results("env-kernels", rows, markdown=scratch / "BENCHMARKS.md"))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
