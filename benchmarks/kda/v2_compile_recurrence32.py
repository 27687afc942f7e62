"""Offline sm_90a compile of the chunk-C v2 recurrence kernel (K2, `recurrence32_kernel.py`): registers, spills,
shared memory, wgmma serialisation and SASS op counts.

Runs without a GPU and without torch, with Triton 3.6 (the GPU machine's version):
``/work/venv36/bin/python benchmarks/kda/v2_compile_recurrence32.py [--chunk 32] [--stages 2 3] [--sass]``;
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

KERNEL_FILE = HERE.parents[1] / "src" / "flashkda" / "fwd" / "v2" / "recurrence32_kernel.py"


def compile_recurrence32(chunk: int, block_v: int, stages: int, use_order: bool = True):
    mod = REC.COMPILE.load_by_path("flashkda_v2_recurrence32_kernel", KERNEL_FILE)
    fn = mod.kda_fwd_v2_recurrence32_kernel
    tok, tile, g = (REC.desc_type("bf16", [chunk, 128]), REC.desc_type("bf16", [chunk, chunk]),
                    REC.desc_type("fp32", [1, 128]))
    types = dict(kd_desc=tok, qd_desc=tok, kr_desc=tok, inv_desc=tile, mqk_desc=tile, g_desc=g, beta="*fp32",
                 v="*bf16", o="*bf16", h0="*fp32", ht="*fp32", cu_seqlens="*i32", seq_chunks="*i32",
                 order="*i32", H="i32")
    num_warps = block_v // 16
    cx = dict(C=chunk, BV=block_v, STAGES=stages, USE_ORDER=use_order, USE_H0=True, STORE_HT=True,
              num_warps=num_warps)
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
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
    for c in args.chunk:
        for st in args.stages:
            name = f"recurrence32 C={c} BV=64 warps=4 stages={st}"
            try:
                k = compile_recurrence32(c, 64, st)
            except Exception as exc:  # report every configuration
                failed += 1
                print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:4000]}")
                continue
            regs, spill, serialised = REC.COMPILE.ptxas_usage(k)
            line = (f"{name}: regs={regs} spill_stores={spill}B{' WGMMA-SERIALIZED' if serialised else ''} "
                    f"smem={k.metadata.shared}B")
            if args.sass:
                line += f" sass={REC.COMPILE.sass_counts(k, REC.RECURRENCE_OPS)}"
            print(line)
            if args.dump:
                REC.COMPILE.dump_asm(k, args.dump, f"recurrence32_c{c}_s{st}")
                args.dump = None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
