"""FlashKDA forward: per-kernel CUDA times of ours and of fla-core 0.6.0 at benchmark rows.

Same inputs and flags as ``benchmarks.kda.run`` (inference mode, fla with ``FLA_FLASH_KDA=0``); one profiled call of
each after a warm-up call, so the stage-by-stage comparison with fla is measured, not
guessed. Nothing is written to ``benchmarks/results`` (``benchmarks.kda.run`` times the rows).

With ``--ncu-range`` the torch profiler is not used: every call is warmed up twice (Triton compiles and autotunes
outside the range), then one call of each runs inside a CUDA profiler range, so ``ncu --profile-from-start off``
sees exactly one launch of every kernel with the configuration the autotuner chose
(``bash benchmarks/device/run.sh -- ncu --profile-from-start off python3 -m benchmarks.kda.profile_fwd --ncu-range``).

Usage: ``python -m benchmarks.kda.profile_fwd [--cases H64-T8192 ...] [--ours-only] [--ncu-range]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLASHKDA_DISABLE", "1")

from benchmarks.kda.registry import CASES  # noqa: E402
from benchmarks.kda.run import FLAGS, make_inputs  # noqa: E402
from benchmarks.kda.train import ncu_range, profile  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["H64-T8192"], help=f"subset of {sorted(CASES)}")
    parser.add_argument("--ours-only", action="store_true", help="profile only ours")
    parser.add_argument("--ncu-range", action="store_true", help="one call of each inside a CUDA profiler range")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("the forward profile needs a CUDA device; nothing profiled", file=sys.stderr)
        return 1
    import fla.ops.kda as fla_kda

    import flashkda

    calls = []
    for name in args.cases:
        case = CASES[name]
        x = make_inputs(case, "cuda")
        call = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        kw = dict(FLAGS, initial_state=x["initial_state"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  cu_seqlens=x.get("cu_seqlens"), cu_seqlens_cpu=x.get("cu_seqlens_cpu"))
        sides = [("ours", flashkda.chunk_kda)] + ([] if args.ours_only else [("fla", fla_kda.chunk_kda)])
        for side, fn in sides:
            calls.append((f"{name} {side}", lambda fn=fn, call=call, kw=kw: fn(*call, safe_gate=True, **kw)))
    with torch.inference_mode():
        if args.ncu_range:
            ncu_range(calls)
            return 0
        for label, fn in calls:
            print(f"=== {label}", flush=True)
            top = profile(fn)
            print(f"{label}: " + "; ".join(f"{k} {ms:.3f} ms x{c}" for k, ms, c in top[:12]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
