"""Does installing k3-infra ever make ``fla.ops.kda.chunk_kda`` slower? Hook on vs off, in one run.

Per row, the same dispatched call ``fla.ops.kda.chunk_kda(...)`` is timed with FlashKDA registered and
``FLASHKDA_DISPATCH=auto`` (ours serves where the calibration says we are faster) and with
``FLASHKDA_DISPATCH=never`` (fla, or the CUTLASS FlashKDA where installed, serves everything). The two settings
alternate sample by sample (the order flips every round), each sample timing about `SAMPLE_MS` of back-to-back calls
between two CUDA events, so clock drift hits both alike and the host-side dispatch cost is measured as a program
sees it. The row keeps the medians, the ratio off/on (>= 0.98 is
the bar: no slower than noise), the spread of the "off" samples (an A/A measure of noise) and who served with the
hook on, with the dispatch's reason. Inference rows time the forward, training rows forward + backward. Writes
``benchmarks/results/kda-dispatch-<date>.json``.

Usage: ``python -m benchmarks.kda.dispatch_bench [--rows NAME ...] [--modes inference training] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.harness import Row, machine_info, machine_line, write_results
from benchmarks.kda.calibrate import VARLEN_EVEN, VARLEN_MIXED, Shape, _fixed, _varlen, call, make_inputs, training_step

ROWS = (
    [_fixed(H, 8192) for H in (64, 96, 12)]
    + [_varlen(H, VARLEN_MIXED, "mixed") for H in (64, 96, 12)]
    + [_varlen(H, VARLEN_EVEN, "1kx8") for H in (64, 96, 12)]
    + [_fixed(64, 32768), _fixed(32, 131072)]
)
BAR = 0.98
SAMPLE_MS = 8.0
"""Each sample times back-to-back calls for about this long (2 to 16 calls), so the first call's host-side work,
which starts on an idle GPU, weighs as little as it does in a program that keeps the GPU busy."""


def interleaved_samples(run, rounds: int) -> tuple[dict[str, list[float]], int]:
    """Per-call milliseconds of ``run`` under ``FLASHKDA_DISPATCH=never`` and ``auto``, sampled alternately, and
    the calls per sample."""
    import torch

    samples: dict[str, list[float]] = {"auto": [], "never": []}
    for setting in ("never", "auto"):
        os.environ["FLASHKDA_DISPATCH"] = setting
        for _ in range(2):
            run()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    end.synchronize()
    calls = max(2, min(16, round(SAMPLE_MS / max(begin.elapsed_time(end), 1e-3))))
    for i in range(rounds):
        for setting in ("never", "auto") if i % 2 == 0 else ("auto", "never"):
            os.environ["FLASHKDA_DISPATCH"] = setting
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                run()
            end.record()
            end.synchronize()
            samples[setting].append(begin.elapsed_time(end) / calls)
    os.environ["FLASHKDA_DISPATCH"] = "auto"
    return samples, calls


def served_by(x: dict, kw: dict) -> tuple[str, str]:
    """Who serves this call with the hook on, and why (our verifier's answer)."""
    from flashkda.backend import chunk_kda_verifier

    ok, reason = call(chunk_kda_verifier, x, kw)
    return ("flashkda", "calibrated faster") if ok else ("fla or flash_kda", reason)


def time_row(shape: Shape, mode: str, device: str, rounds: int) -> Row:
    import torch
    from fla.ops.kda import chunk_kda

    training = mode == "training"
    x, kw = make_inputs(shape, device, grad=training)
    if training:
        do, dht = torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])
        run = lambda: training_step(chunk_kda, x, kw, do, dht)
        ctx = torch.enable_grad
    else:
        run = lambda: call(chunk_kda, x, kw)
        ctx = torch.inference_mode
    with ctx():
        os.environ["FLASHKDA_DISPATCH"] = "auto"
        who, why = served_by(x, kw)
        samples, calls = interleaved_samples(run, rounds)
    on, off = statistics.median(samples["auto"]), statistics.median(samples["never"])
    off_sorted = sorted(samples["never"])
    quartiles = off_sorted[len(off_sorted) // 4], off_sorted[(3 * len(off_sorted)) // 4]
    return Row(f"{mode}-{shape.name}", "fla.ops.kda.chunk_kda with FLASHKDA_DISPATCH=never", off, on,
               params=dict(mode=mode, H=shape.H, T=shape.T, lengths=shape.lengths),
               extra={"served by (hook on)": who, "reason": why,
                      "samples per setting": rounds, "calls per sample": calls,
                      "off spread (q3/q1 - 1)": round(quartiles[1] / quartiles[0] - 1, 4)},
               note="" if off / on >= BAR else f"slower than {BAR}x with the hook")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=None, help="row names to run (default: all)")
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=("inference", "training"),
                        help="which calls to time (default both)")
    parser.add_argument("--rounds", type=int, default=30, help="samples per setting (alternating on/off)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results JSON")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("the dispatch benchmark needs a CUDA device; nothing timed", file=sys.stderr)
        return 1
    os.environ.pop("FLASHKDA_DISABLE", None)
    os.environ.pop("FLA_FLASH_KDA", None)  # every installed backend competes, as in a user's program
    os.environ["FLASHKDA_DISPATCH"] = "auto"
    from flashkda.backend import register_with_fla

    if not register_with_fla():
        print("FlashKDA could not register with fla", file=sys.stderr)
        return 1
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = []
    for mode in args.modes:
        for shape in ROWS:
            if args.rows and shape.name not in args.rows:
                continue
            t0 = time.time()
            row = time_row(shape, mode, "cuda", args.rounds)
            rows.append(row)
            print(f"{row.case:>28}: off {row.baseline_ms:8.3f}  on {row.ours_ms:8.3f} ms  {row.speedup:5.3f}x  "
                  f"{row.extra['served by (hook on)']}: {row.extra['reason']}  ({time.time() - t0:.0f}s)", flush=True)
            if not args.no_write:
                write_results("kda-dispatch", rows, title="kda: fla chunk_kda with the FlashKDA hook on vs off",
                              info=info)
            torch.cuda.empty_cache()
    worst = min(rows, key=lambda r: r.speedup)
    print(f"worst row: {worst.case} {worst.speedup:.3f}x (bar {BAR}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
