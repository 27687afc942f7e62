"""Writable layer on disk (its own ext4 on a loop device) against in memory (tmpfs): what each costs.

One run, both kinds interleaved rep by rep on one data directory: create, snapshot, restore, fork(1),
fork(8) (ms per call), destroy, and a write of more than `memory_mb` (only the disk kind survives it).

Run: ``python -m benchmarks.env.disk --reps 30`` (root; writes benchmarks/results/env-disk-*.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.progress import track

KINDS = {"disk": False, "tmpfs": True}
OPS = ("create", "snapshot", "restore", "fork1", "fork8", "destroy")


def _ms(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def one_rep(backend, in_memory: bool, samples: dict) -> None:
    """One create/snapshot/restore/fork/destroy round with the writable layer on disk or in memory."""
    from agentenv import Limits, Sandbox

    limits = Limits(memory_mb=256, disk_mb=256, disk_in_memory=in_memory)
    made = []
    try:
        ms, sb = _ms(lambda: Sandbox.create("host", backend=backend, limits=limits))
        made.append(sb)
        samples["create"].append(ms)
        sb.exec("head -c 4000000 /dev/urandom > /root/state")
        ms, snap = _ms(sb.snapshot)
        samples["snapshot"].append(ms)
        ms, restored = _ms(lambda: Sandbox.restore(snap, backend=backend))
        made.append(restored)
        samples["restore"].append(ms)
        ms, kids = _ms(lambda: sb.fork(1))
        made += kids
        samples["fork1"].append(ms)
        ms, kids = _ms(lambda: sb.fork(8))
        made += kids
        samples["fork8"].append(ms / 8)
        start = time.perf_counter()
        for s in reversed(made):
            s.destroy()
        made.clear()
        backend.destroy(snap)
        samples["destroy"].append((time.perf_counter() - start) * 1e3 / 12)
    finally:
        for s in reversed(made):
            s.destroy()


def _memory(cg) -> dict:
    """The memory cgroup's view: peak usage, limit hits, and its page cache (dirty, under writeback) now."""
    path = cg.path("memory")
    stat = dict(line.split() for line in (path / "memory.stat").read_text().splitlines())
    read = lambda name: int((path / name).read_text())  # noqa: E731
    return {"max_usage_mb": read("memory.max_usage_in_bytes") >> 20, "limit_hits": read("memory.failcnt"),
            "cache_mb": int(stat["cache"]) >> 20, "dirty_mb": int(stat["dirty"]) >> 20,
            "writeback_mb": int(stat["writeback"]) >> 20, "oom_kills": cg.oom_kills()}


def big_write(backend, in_memory: bool, memory_mb: int = 512, disk_mb: int = 1024, write_mb: int = 700) -> dict:
    """Write `write_mb` (no fsync) into a sandbox of `memory_mb`/`disk_mb`: dd's exit, the memory cgroup's
    view right after, and whether the sandbox answers after."""
    from agentenv import Limits, Sandbox, errors

    sb = Sandbox.create("host", backend=backend, limits=Limits(memory_mb=memory_mb, disk_mb=disk_mb,
                                                               disk_in_memory=in_memory))
    try:
        start = time.perf_counter()
        try:
            r = sb.exec(f"dd if=/dev/zero of=/root/big bs=1M count={write_mb} 2>/dev/null; echo $?", timeout=120)
            outcome = {"exit": r.exit_code, "dd_rc": r.stdout.strip(), "memory": _memory(backend._cgroup(sb.id))}
        except errors.SandboxError as e:
            outcome = {"error": f"{type(e).__name__}: {e}"[:200]}
        outcome["seconds"] = round(time.perf_counter() - start, 2)
        try:
            outcome["answers_after"] = sb.exec("echo ok", timeout=10).stdout == "ok\n"
        except errors.SandboxError as e:
            outcome["answers_after"] = False
            outcome["after_error"] = f"{type(e).__name__}: {e}"[:200]
        return outcome
    finally:
        try:
            sb.destroy()
        except errors.SandboxError:
            pass


def main() -> None:
    from agentenv.runtime.local import NamespaceBackend
    from benchmarks.harness import Row, Timing, write_results

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="agentenv-disk-", dir="/var/tmp"))
    samples = {kind: {op: [] for op in OPS} for kind in KINDS}
    try:
        backend = NamespaceBackend(home)
        for in_memory in KINDS.values():  # warm: seed, templates
            one_rep(backend, in_memory, {op: [] for op in OPS})
        for _ in track(range(args.reps), "disk vs tmpfs reps"):
            for kind, in_memory in KINDS.items():
                one_rep(backend, in_memory, samples[kind])
        writes = {kind: big_write(backend, in_memory) for kind, in_memory in KINDS.items()}
        writes["disk_mem64_write120"] = big_write(backend, False, 64, 160, 120)
        backend.gc(everything=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    rows = []
    for op in OPS:
        disk, tmpfs = (Timing.from_samples(samples[k][op]) for k in KINDS)
        rows.append(Row(case=f"layer-{op}", baseline="tmpfs writable layer", baseline_ms=tmpfs.median_ms,
                        ours_ms=disk.median_ms, params={"reps": args.reps},
                        extra={"disk": disk.__dict__, "tmpfs": tmpfs.__dict__},
                        note="ms per call (fork8, destroy: per sandbox)"))
    rows.append(Row(case="write-700MB-mem512-disk1024", baseline="tmpfs writable layer", baseline_ms=None,
                    ours_ms=None, extra=writes, note="disk must succeed and answer after; tmpfs is OOM-killed"))
    print(json.dumps({r.case: [r.ours_ms, r.baseline_ms] for r in rows}, indent=1), json.dumps(writes, indent=1))
    scratch = Path(tempfile.mkdtemp())
    print(write_results("env-disk", rows, markdown=scratch / "BENCHMARKS.md"))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
