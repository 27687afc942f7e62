"""Offline sm_90a compile of the v2 backward's Gluon kernels (B2, the state-gradient chain `state_grad_kernel.py`):
registers, spills, shared memory, resident CTAs, wgmma serialisation and SASS op counts.

Runs without a GPU and without torch, with Triton 3.6 (the GPU machine's version):
``/work/venv36/bin/python benchmarks/kda/v2_compile_bwd.py [--chunk 16 32] [--head-dim 128 64] [--stages 2 3]
[--sass]`` (K = 64 at 16-token chunks only, as the launcher takes it); `v2_compile.py` runs it after the forward's
kernels.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import v2_compile_recurrence as REC  # noqa: E402  (loaded as a file, like this script)

KERNEL_FILE = HERE.parents[1] / "src" / "flashkda" / "bwd" / "v2" / "state_grad_kernel.py"


def compile_state_grad(chunk: int, stages: int, use_order: bool = True, head_dim: int = 128):
    mod = REC.COMPILE.load_by_path("flashkda_v2_state_grad_kernel", KERNEL_FILE)
    fn = mod.kda_bwd_v2_state_grad_kernel
    tok, tile, g = (REC.desc_type("bf16", [chunk, head_dim]), REC.desc_type("bf16", [chunk, chunk]),
                    REC.desc_type("fp32", [1, head_dim]))
    types = dict(kd_desc=tok, qd_desc=tok, kr_desc=tok, inv_desc=tile, mqk_desc=tile, g_desc=g, beta="*fp32",
                 do="*bf16", ds="*bf16", dht="*fp32", dh0="*fp32", cu_seqlens="*i32", seq_chunks="*i32",
                 order="*i32", H="i32")
    cx = dict(C=chunk, K=head_dim, BV=64, STAGES=stages, USE_ORDER=use_order, USE_DHT=True, STORE_DH0=True, num_warps=4)
    sig, attrs = REC.COMPILE.signature(fn, types)
    src = REC.GluonASTSource(fn, sig, cx, attrs)
    return triton.compile(src, target=REC.TARGET, options=dict(num_warps=4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 64], help="K = V")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--sass", action="store_true", help="also print SASS op counts")
    ap.add_argument("--dump", default=None, help="write the ttgir/ptx of each configuration to this folder")
    args = ap.parse_args(argv)
    failed = 0
    for kk, c, st in [(kk, c, st) for kk in args.head_dim for c in args.chunk for st in args.stages
                      if kk == 128 or c == 16]:
        name = f"state_grad (B2) K={kk} C={c} BV=64 warps=4 stages={st}"
        k = REC.COMPILE.compile_and_report(name, functools.partial(compile_state_grad, c, st, head_dim=kk),
                                           args.sass, REC.RECURRENCE_OPS)
        if k is None:
            failed += 1
            continue
        if args.dump:
            REC.COMPILE.dump_asm(k, args.dump, f"state_grad_k{kk}_c{c}_s{st}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
