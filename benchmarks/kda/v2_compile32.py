"""Offline sm_90a compile of the chunk-32 v2 kernels (K1 `prepare32_kernel.py`, K2 `recurrence32_kernel.py`):
registers, spills, shared memory, resident CTAs, wgmma serialisation and SASS op counts.

Runs without a GPU and without torch, with Triton 3.6 (the GPU machine's version):
``/work/venv36/bin/python benchmarks/kda/v2_compile32.py [--chunk 32] [--stages 2 3] [--sass]``;
`v2_compile.py` runs it after the other kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import v2_compile_recurrence as REC  # noqa: E402  (loaded as a file, like this script)

V2_DIR = HERE.parents[1] / "src" / "flashkda" / "fwd" / "v2"
KERNEL_FILE = V2_DIR / "recurrence32_kernel.py"


def compile_prepare32(has_a_log: bool = True, has_dt_bias: bool = True, group: int = 1, maxnreg: int | None = None):
    return REC.COMPILE.compile_prepare(has_a_log, has_dt_bias, group, "prepare32_kernel.py",
                                       "kda_fwd_v2_prepare32_kernel", maxnreg)


def compile_recurrence32(chunk: int, block_v: int, stages: int, use_order: bool = True, every: int = 0):
    mod = REC.COMPILE.load_by_path("flashkda_v2_recurrence32_kernel", KERNEL_FILE)
    fn = mod.kda_fwd_v2_recurrence32_kernel
    tok, tile, g = (REC.desc_type("bf16", [chunk, 128]), REC.desc_type("bf16", [chunk, chunk]),
                    REC.desc_type("fp32", [1, 128]))
    types = dict(kd_desc=tok, qd_desc=tok, kr_desc=tok, inv_desc=tile, mqk_desc=tile, g_desc=g, beta="*fp32",
                 v="*bf16", o="*bf16", h0="*fp32", ht="*fp32", cu_seqlens="*i32", seq_chunks="*i32",
                 order="*i32", ckpt="*bf16", ck_offsets="*i32", H="i32")
    num_warps = block_v // 16
    cx = dict(C=chunk, BV=block_v, STAGES=stages, USE_ORDER=use_order, USE_H0=True, STORE_HT=True, EVERY=every,
              num_warps=num_warps)
    sig, attrs = REC.COMPILE.signature(fn, types)
    src = REC.GluonASTSource(fn, sig, cx, attrs)
    return triton.compile(src, target=REC.TARGET, options=dict(num_warps=num_warps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, nargs="+", default=[32])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--sass", action="store_true", help="also print SASS op counts")
    ap.add_argument("--dump", default=None, help="write the ttgir/ptx of the first configuration to this folder")
    args = ap.parse_args(argv)
    failed = 0
    jobs = [(f"prepare32 A_log={a} dt_bias={b} GVA group={grp}", REC.COMPILE.PREPARE_OPS,
             lambda a=a, b=b, grp=grp: compile_prepare32(a, b, grp))
            for a, b, grp in ((True, True, 1), (False, False, 1), (True, True, 2))]
    jobs += [(f"recurrence32 C={c} BV=64 warps=4 stages={st}" + (f" checkpoints every={e}" if e else ""),
              REC.RECURRENCE_OPS, lambda c=c, st=st, e=e: compile_recurrence32(c, 64, st, every=e))
             for c in args.chunk for st in args.stages for e in (0, 4)]
    for name, ops, make in jobs:
        k = REC.COMPILE.compile_and_report(name, make, args.sass, ops)
        if k is None:
            failed += 1
            continue
        if args.dump:
            REC.COMPILE.dump_asm(k, args.dump, name.split()[0])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
