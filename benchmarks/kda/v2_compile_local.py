"""Offline sm_90a compile of B3, the v2 backward's chunk-local gradient kernel (Triton, `local_grad_kernel.py`):
registers, spills, shared memory, resident CTAs and SASS op counts.

Runs without a GPU and without torch, with Triton 3.6 (the GPU machine's version):
``/work/venv36/bin/python benchmarks/kda/v2_compile_local.py [--chunk 16 32] [--warps 4 8] [--stages N] [--sass]``.
The kernel file is loaded by path, with `flashkda.rounding` and `flashkda.bwd.v2.local_grad_ops` registered by
path before it, so neither ``flashkda`` nor torch is imported.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import triton
from triton.compiler import ASTSource

os.environ.pop("TRITON_INTERPRET", None)
HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src" / "flashkda"
sys.path.insert(0, str(HERE))
import v2_compile as COMPILE  # noqa: E402  (loaded as a file, like this script)

LOCAL_OPS = ("LDG", "STG", "LDS", "STS", "HMMA", "HGMMA", "BAR", "SHFL", "MUFU", "LDL", "STL")


def _kernel(feature_major: bool = False):
    sys.modules["flashkda.rounding"] = COMPILE.load_by_path("flashkda.rounding", SRC / "rounding.py")
    ops = "flashkda.bwd.v2.local_grad_ops"
    sys.modules[ops] = COMPILE.load_by_path(ops, SRC / "bwd" / "v2" / "local_grad_ops.py")
    if feature_major:
        return COMPILE.load_by_path("flashkda_v2_local_grad_fm_kernel",
                                    SRC / "bwd" / "v2" / "local_grad_fm_kernel.py").kda_bwd_v2_local_fm_kernel
    return COMPILE.load_by_path("flashkda_v2_local_grad_kernel",
                                SRC / "bwd" / "v2" / "local_grad_kernel.py").kda_bwd_v2_local_kernel


#: The kernel's argument types (bf16 inputs and workspace, fp32 partials).
TYPES = dict(q="*bf16", k="*bf16", v="*bf16", g="*bf16", do="*bf16", A_log="*fp32", dt_bias="*fp32",
             kd="*bf16", qd="*bf16", kr="*bf16", inv="*bf16", mqk="*bf16", glast="*fp32", bsig="*fp32",
             ckpt="*bf16", ds="*bf16", chunk_index="*i32", segments="*i32", dv="*bf16", dg="*bf16", dbeta="*bf16",
             part_alog="*fp32", part_dt="*fp32", scale="fp32", lower_bound="fp32")


def compile_local(num_warps: int, chunk: int = 16, has_a_log: bool = True, has_dt_bias: bool = True, group: int = 1,
                  num_stages: int | None = None, feature_major: bool = False):
    """B3's kernel at H64 (``group`` value heads per q/k head), token-major or `feature_major`."""
    fn = _kernel(feature_major)
    acc = "*bf16" if group == 1 else "*fp32"  # dq, dk: straight in q's dtype, or fp32 summed over value heads
    cx = dict(HQ=64 // group, HV=64, C=chunk, K=128, V=128, HAS_ALOG=has_a_log, HAS_DT=has_dt_bias)
    sig, attrs = COMPILE.signature(fn, dict(TYPES, dq=acc, dk=acc))
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in cx.items()}, attrs)
    options = dict(num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}))
    return triton.compile(src, target=COMPILE.TARGET, options=options)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--chunk", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--stages", type=int, default=None, help="num_stages (default: Triton's)")
    ap.add_argument("--sass", action="store_true", help="also print SASS op counts")
    ap.add_argument("--forms", nargs="+", default=["token-major", "feature-major"],
                    choices=["token-major", "feature-major"], help="kernel layouts to compile")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, target {COMPILE.TARGET}")
    jobs = [(f"local_grad (B3) {form} C={chunk} stages={args.stages}",
             lambda c=chunk, w=nw, fm=form == "feature-major": compile_local(w, c, num_stages=args.stages,
                                                                            feature_major=fm))
            for form in args.forms for chunk in args.chunk for nw in args.warps]
    failed = 0
    for name, build in jobs:
        failed += COMPILE.compile_and_report(name, build, args.sass, LOCAL_OPS) is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
