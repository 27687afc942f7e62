"""The v2 forward with K1 overlapped with K2 over token segments (`flashkda.fwd.v2.pipeline`) against one segment,
on the anchor rows (GPU, about a minute).

Per row: medians of CUDA events of ``chunk_kda_fwd_v2(..., segments=P)`` for P = 1 (K1 then K2), the default rule's
P, and P in ``--segments``, with K2 on the high-priority side stream (the default) and, at the rule's P, with K1 on
the side stream instead; each segmented output and final state is checked against P = 1 (relative RMS).
Varlen rows pass ``cu_seqlens_cpu`` (no host read). Results: ``benchmarks/results/kda-v2-pipeline-<date>.json``.

Usage: ``python -m benchmarks.kda.v2_pipeline_bench [--rows NAME ...] [--segments 2 4 8 16] [--rep 10]
[--budget 55] [--no-write]``.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.harness import Row, machine_info, machine_line, rms_ratio, time_fn, write_results
from benchmarks.kda.calibrate import VARLEN_EVEN, VARLEN_MIXED, _fixed, _varlen, make_inputs

COMPONENT = "kda-v2-pipeline"
ROWS = [_fixed(64, 8192), _varlen(64, VARLEN_MIXED, "mixed"), _varlen(64, VARLEN_EVEN, "1kx8"), _fixed(96, 8192),
        _fixed(12, 8192), _fixed(64, 32768), _fixed(32, 131072)]


def _call(x: dict, kw: dict, P: int, side: bool = True):
    from flashkda.fwd.v2 import chunk_kda_fwd_v2

    o, s, _ = chunk_kda_fwd_v2(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, x["initial_state"], True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=kw["lower_bound"], cu_seqlens=kw.get("cu_seqlens"), cu_seqlens_cpu=kw.get("cu_seqlens_cpu"),
        A_log=x["A_log"], dt_bias=x["dt_bias"], segments=P, recurrence_on_side=side)
    return o, s


def bench_row(shape, segments: list[int], rep: int) -> Row:
    import torch

    from flashkda.fwd.v2 import pipeline

    x, kw = make_inputs(shape, "cuda")
    rule = pipeline.default_segments(shape.B * shape.T)
    o1, s1 = _call(x, kw, 1)
    times, errors = {}, {}
    variants = [(P, True) for P in dict.fromkeys([1, rule, *segments])] + ([(rule, False)] if rule > 1 else [])
    for P, side in variants:
        name = f"P{P}" + ("" if side else "-k1side")
        if P > 1:
            o, s = _call(x, kw, P, side)
            torch.cuda.synchronize()
            errors[name] = (rms_ratio(o, o1), rms_ratio(s, s1))
        times[name] = time_fn(lambda P=P, side=side: _call(x, kw, P, side), device="cuda", warmup=2, rep=rep).median_ms
    extra = {f"{k} ms": round(v, 4) for k, v in times.items()}
    extra.update({f"{k} rms(o, state) vs P1": [float(f"{e:.2e}") for e in v] for k, v in errors.items()})
    best = min(times, key=times.get)
    extra["best"] = best
    return Row(case=shape.name, baseline="v2 P=1 (K1 then K2)", baseline_ms=times["P1"], ours_ms=times[f"P{rule}"],
               params=dict(H=shape.H, T=shape.T, lengths=shape.lengths, rule_segments=rule), extra=extra,
               note="ours = v2 with the default segments (K2 on the high-priority side stream)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names (default: all)")
    parser.add_argument("--segments", nargs="*", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--rep", type=int, default=10)
    parser.add_argument("--budget", type=float, default=55.0, help="seconds; rows after it are skipped")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("v2_pipeline_bench needs a CUDA device")
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]
    info = machine_info()
    print(machine_line(info), flush=True)
    start, results = time.monotonic(), []
    for shape in rows:
        if time.monotonic() - start > args.budget:
            print(f"[skip] {shape.name}: past the {args.budget:.0f} s budget", flush=True)
            continue
        row = bench_row(shape, args.segments, args.rep)
        results.append(row)
        cells = ", ".join(f"{k}={v}" for k, v in row.extra.items())
        print(f"[time] {row.case}: rule P={row.params['rule_segments']}, speed-up vs P1={row.speedup:.3f}, {cells}",
              flush=True)
        torch.cuda.empty_cache()
    print("\n| row | P=1 ms | rule P | rule ms | best | best ms |\n|---|---|---|---|---|---|")
    for row in results:
        best = row.extra["best"]
        print(f"| {row.case} | {row.baseline_ms:.3f} | {row.params['rule_segments']} | {row.ours_ms:.3f} | {best} | "
              f"{row.extra[f'{best} ms']:.3f} |")
    if results and not args.no_write:
        print(f"results: {write_results(COMPONENT, results, title='FlashKDA v2: K1/K2 overlap', info=info)}")
    print(f"done in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
