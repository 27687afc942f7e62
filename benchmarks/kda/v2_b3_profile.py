"""B3 of the v2 backward in the forms of ``--forms``, each called once inside an NVTX range, for Nsight Compute.

The inputs and the stages before B3 (K1, F2, B2) are those of ``v2_train_check`` at one training row; every form runs
once untraced first (compilation, autotuning), then once inside the range ``B3 <form>``. On the GPU machine::

    ncu --nvtx --nvtx-include "B3 split/" --set full --import-source yes -o $OUT/b3-split \
        python3 -m benchmarks.kda.v2_b3_profile --forms split
    nsys profile -o $OUT/b3 python3 -m benchmarks.kda.v2_b3_profile --forms fused split --repeat 5

Usage: ``python -m benchmarks.kda.v2_b3_profile [--row H64-T8192] [--chunk 16] [--forms FORM ...] [--repeat N]``
(CUDA only; a form's name is a key of ``v2_train_check.B3_FORMS``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kda.calibrate import make_inputs  # noqa: E402
from benchmarks.kda.v2_check import FLAGS  # noqa: E402
from benchmarks.kda.v2_train_check import B3_FORMS, ROWS, stage_fns  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default=ROWS[0].name, choices=[s.name for s in ROWS])
    parser.add_argument("--chunk", type=int, default=16, choices=(16, 32))
    parser.add_argument("--forms", nargs="+", default=["fused"], choices=list(B3_FORMS))
    parser.add_argument("--repeat", type=int, default=1, help="traced calls per form (default 1)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    shape = next(s for s in ROWS if s.name == args.row)
    x, kw = make_inputs(shape, "cuda")
    kw = dict(FLAGS, **{k: v for k, v in kw.items() if k.startswith("cu_seqlens")})
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").bfloat16()
    dht = torch.randn(x["initial_state"].shape, generator=gen, device="cuda") * 0.1
    with torch.inference_mode():
        fns = stage_fns(x, kw, do, dht, args.chunk, args.forms)
        for form in args.forms:
            fn = fns[f"B3 {form}"]
            fn()
            torch.cuda.synchronize()
            with torch.cuda.nvtx.range(f"B3 {form}"):
                for _ in range(args.repeat):
                    fn()
                torch.cuda.synchronize()
            print(f"B3 {form}: traced {args.repeat} call(s) at {shape.name}, chunk {args.chunk}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
