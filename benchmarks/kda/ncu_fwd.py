"""FlashKDA forward under Nsight Compute: one call of ours and one of fla-core 0.6.0 inside a profiler range.

Warms both up first (Triton compiles and autotunes outside the range), then opens the CUDA profiler range and
calls each once, so ``ncu --profile-from-start off`` sees exactly one launch of every kernel of each forward, with
the launch configuration the autotuner chose. Same inputs and flags as ``benchmarks.kda.run``.

Usage (on the device): ``ncu --profile-from-start off --clock-control none --set full -o $OUT/fwd python3 -m
benchmarks.kda.ncu_fwd --cases H64-T8192``; ``ncu -i $OUT/fwd.ncu-rep --page details`` prints the report.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLASHKDA_DISABLE", "1")

from benchmarks.kda.registry import CASES  # noqa: E402
from benchmarks.kda.run import FLAGS, make_inputs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["H64-T8192"], help=f"subset of {sorted(CASES)}")
    parser.add_argument("--ours-only", action="store_true", help="profile only ours")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("the Nsight Compute run needs a CUDA device; nothing profiled", file=sys.stderr)
        return 1
    import fla.ops.kda as fla_kda

    import flashkda

    sides = [("ours", flashkda.chunk_kda)] + ([] if args.ours_only else [("fla", fla_kda.chunk_kda)])
    calls = []
    for name in args.cases:
        x = make_inputs(CASES[name], "cuda")
        kw = dict(FLAGS, initial_state=x["initial_state"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  cu_seqlens=x.get("cu_seqlens"), cu_seqlens_cpu=x.get("cu_seqlens_cpu"), safe_gate=True)
        for side, fn in sides:
            calls.append((f"{name} {side}", fn, (x["q"], x["k"], x["v"], x["g"], x["beta"]), kw))
    with torch.inference_mode():
        for _, fn, call, kw in calls:
            for _ in range(2):
                fn(*call, **kw)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for label, fn, call, kw in calls:
            torch.cuda.nvtx.range_push(label)
            fn(*call, **kw)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        torch.cuda.cudart().cudaProfilerStop()
    print("profiled: " + ", ".join(label for label, *_ in calls), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
