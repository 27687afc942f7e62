"""FlashKDA backward: launch-configuration sweep of the gated-product kernels and the state passes, for NOTES.md.

Times ``flashkda.chunk_kda`` forward + backward at a training row with the fused gate chain
(``chunk_kda_gated_dots_gates_bwd``: K slice, warps), the K-sliced ``Akk``/``Aqk`` recompute
(``chunk_kda_gated_dots``: K slice, warps) and the V block of the two state passes (``flashkda.chunk_bwd_h``: the
state recompute and the reverse pass; default: the finest split that gives 256 programs, down to 16) set to each
configuration in turn, every configuration's gradients
checked against the default's first (relative RMS <= 1e-3; a configuration that disagrees is reported, not timed).
Nothing is compared with fla here (``benchmarks.kda.train`` does that) and nothing is written.

Usage: ``python -m benchmarks.kda.bwd_sweep [--case B1-T8192-H64] [--rep N] [--gates BK:WARPS ...]
[--dots BK:WARPS ...] [--bv BV ...]`` (CUDA only). The first entry of the first two lists is the default.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.harness import time_fn
from benchmarks.kda.train import GRAD_NAMES, TRAIN_CASES, make_inputs, rms_ratio, step

GATES_SWEEP = ["32:4", "16:4", "16:2", "32:8", "64:8"]
DOTS_SWEEP = ["32:4", "16:4", "64:4", "32:8"]
BV_SWEEP = ["32", "64"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="B1-T8192-H64", choices=sorted(TRAIN_CASES))
    parser.add_argument("--rep", type=int, default=10)
    parser.add_argument("--gates", nargs="*", default=GATES_SWEEP)
    parser.add_argument("--dots", nargs="*", default=DOTS_SWEEP)
    parser.add_argument("--bv", nargs="*", default=BV_SWEEP)
    parser.add_argument("--device", default="cuda", help="cpu runs the kernels in Triton's interpreter (smoke test)")
    args = parser.parse_args(argv)
    import torch
    import triton

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("the backward sweep needs a CUDA device; nothing timed", file=sys.stderr)
        return 1
    import flashkda
    from flashkda import chunk_bwd_gated as gated
    from flashkda import chunk_bwd_h

    c = TRAIN_CASES[args.case]
    x, extra = make_inputs(c["B"], c["T"], c["H"], c["lengths"], device)
    N = c["B"] if c["lengths"] is None else len(c["lengths"])
    do = torch.randn(c["B"], c["T"], c["H"], 128, device=device, dtype=torch.bfloat16)
    dht = torch.randn(N, c["H"], 128, 128, device=device)
    run = lambda: step(flashkda.chunk_kda, x, extra, do, dht)  # noqa: E731
    defaults = (gated.GATES_BWD_BK, gated.GATES_BWD_WARPS, gated.GATED_DOTS_BK, gated.GATED_DOTS_WARPS)
    ref = None
    block_v = chunk_bwd_h._block_v
    configs = [("gates", s) for s in args.gates] + [("dots", s) for s in args.dots[1:]] + [("bv", s) for s in args.bv]
    try:
        for kind, spec in configs:
            bk, warps = (int(v) for v in (spec + ":0").split(":")[:2])
            gated.GATES_BWD_BK, gated.GATES_BWD_WARPS, gated.GATED_DOTS_BK, gated.GATED_DOTS_WARPS = defaults
            chunk_bwd_h._block_v = block_v
            if kind == "gates":
                gated.GATES_BWD_BK, gated.GATES_BWD_WARPS = bk, warps
            elif kind == "dots":
                gated.GATED_DOTS_BK, gated.GATED_DOTS_WARPS = bk, warps
            else:
                chunk_bwd_h._block_v = lambda K, V, programs, bv=bk: min(bv, triton.next_power_of_2(V))
            _, _, grads = run()
            if ref is None:
                ref = grads
            worst = max(rms_ratio(grads[n], ref[n]) for n in GRAD_NAMES)
            if worst > 1e-3:
                print(f"{args.case} {kind} {spec}: gradients differ from the default's (worst {worst:.1e}); not timed")
                continue
            t = time_fn(run, device=device, warmup=2, rep=args.rep)
            print(f"{args.case} {kind} {spec}: {t.median_ms:.2f} ms (p20-p80 {t.p20_ms:.2f}-{t.p80_ms:.2f}), "
                  f"worst diff {worst:.1e}", flush=True)
    finally:
        gated.GATES_BWD_BK, gated.GATES_BWD_WARPS, gated.GATED_DOTS_BK, gated.GATED_DOTS_WARPS = defaults
        chunk_bwd_h._block_v = block_v
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
