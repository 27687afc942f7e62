"""FlashKDA v2's kernels one call each inside NVTX ranges, for Nsight Compute and Nsight Systems.

At one row of ``v2_train_check`` (its inputs, K3 flags): the inference forward (``forward``: the default chunk size;
``forward-c32``), the training stages (``F1`` = K1, ``F2`` = K2 with checkpoint stores, ``B2``) and B3 in the forms of
``--forms`` (``v2_train_check.B3_FORMS``). Every stage runs once untraced first (compilation, autotuning), then
``--repeat`` times inside the range of its name. On the GPU machine::

    ncu --nvtx --nvtx-include "B3 split/" --set full --import-source yes -o $OUT/b3-split \\
        python3 -m benchmarks.kda.v2_profile --forms split
    ncu --nvtx --nvtx-include "forward-c32/" --set full -o $OUT/fwd python3 -m benchmarks.kda.v2_profile \\
        --stages forward-c32 --forms
    nsys profile -o $OUT/v2 python3 -m benchmarks.kda.v2_profile --stages forward F1 F2 B2 --forms split

Usage: ``python -m benchmarks.kda.v2_profile [--row H64-T8192] [--chunk 16] [--stages NAME ...] [--forms FORM ...]
[--repeat N]`` (CUDA only; ``--chunk`` is the training stages' chunk size).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kda.v2_check import v2_call  # noqa: E402
from benchmarks.kda.v2_train_check import B3_FORMS, ROWS, row_inputs, stage_fns  # noqa: E402

#: The inference forwards by name: ``chunk_kda_fwd_v2``'s ``chunk_size``.
FORWARDS = {"forward": None, "forward-c32": 32}
#: The training stages by name: their keys in `v2_train_check.stage_fns`.
TRAIN_STAGES = {"F1": "F1 (K1)", "F2": "F2 (K2 + checkpoints)", "B2": "B2 (dS chain)"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default=ROWS[0].name, choices=[s.name for s in ROWS])
    parser.add_argument("--chunk", type=int, default=16, choices=(16, 32), help="the training stages' chunk size")
    parser.add_argument("--stages", nargs="*", default=[], choices=[*FORWARDS, *TRAIN_STAGES])
    parser.add_argument("--forms", nargs="*", default=["split"], choices=list(B3_FORMS), help="B3's forms")
    parser.add_argument("--repeat", type=int, default=1, help="traced calls per stage (default 1)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if not args.stages and not args.forms:
        parser.error("nothing to profile: give --stages and/or --forms")
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    from functools import partial

    from flashkda.fwd.v2 import chunk_kda_fwd_v2

    shape = next(s for s in ROWS if s.name == args.row)
    x, kw, do, dht = row_inputs(shape, "cuda")
    with torch.inference_mode():
        calls = {name: partial(v2_call, partial(chunk_kda_fwd_v2, chunk_size=chunk), x, kw)
                 for name, chunk in FORWARDS.items() if name in args.stages}
        if args.forms or set(args.stages) & set(TRAIN_STAGES):
            fns = stage_fns(x, kw, do, dht, args.chunk, args.forms)
            calls.update({name: fns[key] for name, key in TRAIN_STAGES.items() if name in args.stages})
            calls.update({f"B3 {form}": fns[f"B3 {form}"] for form in args.forms})
        for name, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            with torch.cuda.nvtx.range(name):
                for _ in range(args.repeat):
                    fn()
                torch.cuda.synchronize()
            print(f"{name}: traced {args.repeat} call(s) at {shape.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
