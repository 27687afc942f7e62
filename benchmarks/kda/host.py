"""Host time per ``chunk_kda`` call, per backend, in one run: what bounds a call when the GPU work is short.

Per row (the calibration's inputs and K3 flags, inference), for fla 0.6.0's own path, the CUTLASS FlashKDA (through
fla's adapter, when importable) and ``flashkda.chunk_kda`` (and each of its kernel sets forced, ``flashkda v1`` /
``flashkda v2``, where both serve the row), three numbers:

- ``host us``: wall time of ``--calls`` calls issued back to back, divided by the calls, read before synchronising:
  the host's own cost of one call (Python, argument checks, allocations, launches), as long as the GPU keeps up;
- ``back-to-back us``: the same loop up to the synchronisation after the last call: the cost of one call in a
  model's layer loop (the larger of host and GPU time);
- ``idle-start ms``: median of CUDA events around one call from an idle GPU (the calibration's measure).

The host of a GPU machine drifts between (and within) runs, so the first two are medians over
``--rounds`` rounds in which every backend runs its loop once, in alternating order (``host us min`` beside).
Ours against the fastest other backend by back-to-back time is the row's speed-up. With ``--profile``, the
``cProfile`` of ours' calls (functions by own and by cumulative time) goes to the log, to say where the host time goes.

Writes ``benchmarks/results/kda-host-<date>.json``. Usage: ``python -m benchmarks.kda.host [--rows NAME ...]
[--calls N] [--rounds N] [--profile] [--no-write] [--dry-run]`` (``--dry-run``: list the rows and backends, time
nothing; runs on a CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from benchmarks.harness import Row, machine_info, machine_line, time_fn, write_results
from benchmarks.kda.calibrate import VARLEN_EVEN, _fixed, _varlen, backends, call, forced_kernels, make_inputs

#: Short calls (host-bound on Hopper) and one long call (GPU-bound) for contrast.
ROWS = [_fixed(64, 1024), _fixed(12, 2048), _fixed(64, 2048), _varlen(64, VARLEN_EVEN, "1kx8"), _fixed(64, 8192)]
OURS = "flashkda"


def host_times(runs: dict, calls: int, rounds: int, device: str) -> dict[str, dict[str, float]]:
    """Per name of ``runs`` (zero-argument calls): ``host us`` and ``back-to-back us`` per call, medians over
    ``rounds`` rounds of ``calls`` calls each (every run once per round, the order alternating), and the least
    ``host us min``; after a synchronised warm-up of three calls each."""
    import statistics

    import torch

    for run in runs.values():
        for _ in range(3):
            run()
    names = list(runs)
    samples = {name: ([], []) for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            run = runs[name]
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                run()
            issued = time.perf_counter()
            torch.cuda.synchronize(device)
            done = time.perf_counter()
            samples[name][0].append((issued - start) / calls * 1e6)
            samples[name][1].append((done - start) / calls * 1e6)
    return {name: {"host us": round(statistics.median(host), 1), "host us min": round(min(host), 1),
                   "back-to-back us": round(statistics.median(b2b), 1)}
            for name, (host, b2b) in samples.items()}


def profile_text(run, calls: int, limit: int = 40) -> str:
    """The functions of ``calls`` calls of ``run`` by own time, then by cumulative time (``cProfile``), as text."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(limit)
    stats.sort_stats("cumulative").print_stats(limit)
    return out.getvalue()


def runs_for(shape, device: str) -> dict:
    """Name -> a zero-argument call of that backend on ``shape``'s inputs (``flashkda v1``/``v2`` where both
    of our kernel sets serve the row)."""
    from flashkda.fwd.v2 import chunk_fwd

    x, kw = make_inputs(shape, device)
    fns = backends("inference")
    if call(chunk_fwd.supports_v2, x, kw):
        for kernels in ("v1", "v2"):
            fns[f"{OURS} {kernels}"] = forced_kernels(fns[OURS], kernels)
    return {name: (lambda fn=fn: call(fn, x, kw)) for name, fn in fns.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=None, help=f"row names (default all): {[s.name for s in ROWS]}")
    parser.add_argument("--calls", type=int, default=50, help="calls per host-time loop (default 50)")
    parser.add_argument("--rounds", type=int, default=9, help="host-time rounds per row (default 9)")
    parser.add_argument("--rep", type=int, default=30, help="idle-start samples per backend (default 30)")
    parser.add_argument("--profile", action="store_true", help="print the cProfile of ours' calls per row")
    parser.add_argument("--no-write", action="store_true", help="write no results JSON")
    parser.add_argument("--dry-run", action="store_true", help="list rows and backends; time nothing")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rep < 1 or args.rounds < 1:
        parser.error(f"--calls, --rounds and --rep must be >= 1, got {args.calls}, {args.rounds} and {args.rep}")
    unknown = set(args.rows or ()) - {s.name for s in ROWS}
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {[s.name for s in ROWS]}")
    shapes = [s for s in ROWS if not args.rows or s.name in args.rows]
    if args.dry_run:
        for shape in shapes:
            print(f"{shape.name}: fla, flash_kda (when importable), {OURS}, {OURS} v1/v2 (where both serve)")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("the host-time benchmark needs a CUDA device; nothing timed", file=sys.stderr)
        return 1
    device = "cuda"
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = []
    with torch.inference_mode():
        for shape in shapes:
            runs = runs_for(shape, device)
            measured = host_times(runs, args.calls, args.rounds, device)
            for name, run in runs.items():
                m = measured[name]
                m["idle-start ms"] = round(time_fn(run, device=device, warmup=2, rep=args.rep).median_ms, 4)
                print(f"{shape.name:>18} {name:<12} host {m['host us']:7.1f} us (min {m['host us min']:7.1f})  "
                      f"back-to-back {m['back-to-back us']:7.1f} us  idle-start {m['idle-start ms']:.3f} ms",
                      flush=True)
            if args.profile:
                print(profile_text(runs[OURS], args.calls), flush=True)
            others = {n: m for n, m in measured.items() if not n.startswith(OURS)}
            best = min(others, key=lambda n: others[n]["back-to-back us"])
            rows.append(Row(shape.name, f"fastest other backend back to back ({best})",
                            others[best]["back-to-back us"] / 1e3, measured[OURS]["back-to-back us"] / 1e3,
                            params=dict(H=shape.H, HV=shape.hv, T=shape.T, lengths=shape.lengths),
                            extra={f"{n} {k}": v for n, m in measured.items() for k, v in m.items()}))
            del runs
            torch.cuda.empty_cache()
    if not args.no_write:
        print(f"results: {write_results('kda-host', rows, title='kda host time per call', info=info)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
