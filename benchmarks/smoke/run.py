"""A trivial benchmark that exercises the harness end to end: summing 1M floats.

Baseline: a Python loop over a list. Ours: `sum()` on the same list. Both in one run, results checked equal
before anything is timed.
"""

from __future__ import annotations

import argparse
import random

from benchmarks.harness import Row, time_fn, write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=1_000_000, help="number of floats")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results")
    args = parser.parse_args(argv)

    data = [random.random() for _ in range(args.n)]

    def loop_sum() -> float:
        total = 0.0
        for x in data:
            total += x
        return total

    if abs(loop_sum() - sum(data)) > 1e-6 * args.n:
        raise SystemExit("correctness gate failed: loop sum and builtin sum disagree")
    base = time_fn(loop_sum, rep=5, warmup=1)
    ours = time_fn(lambda: sum(data), rep=5, warmup=1)
    row = Row(f"n={args.n}", "python loop", base.median_ms, ours.median_ms, params={"n": args.n})
    print(f"{row.case}: loop {base.median_ms:.2f} ms, sum() {ours.median_ms:.2f} ms, {row.speedup:.1f}x")
    if not args.no_write:
        print(write_results("smoke", [row], title="smoke (harness self-check)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
