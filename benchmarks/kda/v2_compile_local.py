"""Offline sm_90a compile of B3, the v2 backward's chunk-local gradient kernels (`local_split_kernel.py`: B3a, the
state part, per V block; B3b, K1 backwards per chunk, in Triton there and in Gluon in `local_k1_gluon.py`):
registers, spills, shared memory, resident CTAs and SASS op counts.

Runs without a GPU and without torch, with Triton 3.6 (the GPU machine's version):
``/work/venv36/bin/python benchmarks/kda/v2_compile_local.py [--chunk 16 32] [--warps 4 8] [--stages N]
[--block-v 128 64] [--maxnreg N ...] [--kernels ...] [--head-dim 128 64] [--sass]`` (``--head-dim``: the Gluon
B3b's widths). The kernel files are loaded by path, with `flashkda.rounding` and `flashkda.bwd.v2.local_grad_ops`
registered by path before them, so neither ``flashkda`` nor torch is imported.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import triton
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

os.environ.pop("TRITON_INTERPRET", None)
HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src" / "flashkda"
sys.path.insert(0, str(HERE))
import v2_compile as COMPILE  # noqa: E402  (loaded as a file, like this script)

LOCAL_OPS = ("LDG", "STG", "LDS", "STS", "HMMA", "HGMMA", "BAR", "SHFL", "MUFU", "LDL", "STL")


def _module(file: str):
    sys.modules["flashkda.rounding"] = COMPILE.load_by_path("flashkda.rounding", SRC / "rounding.py")
    ops = "flashkda.bwd.v2.local_grad_ops"
    sys.modules[ops] = COMPILE.load_by_path(ops, SRC / "bwd" / "v2" / "local_grad_ops.py")
    return COMPILE.load_by_path(f"flashkda_v2_{Path(file).stem}", SRC / "bwd" / "v2" / file)


def _compile(fn, types: dict, cx: dict, num_warps: int, maxnreg: int | None = None, num_stages: int | None = None,
             gluon: bool = False):
    sig, attrs = COMPILE.signature(fn, types)
    source = GluonASTSource if gluon else ASTSource
    src = source(fn, sig, {(fn.arg_names.index(n),): v for n, v in cx.items()}, attrs)
    options = dict(num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}),
                   **({} if num_stages is None else {"num_stages": num_stages}))
    return triton.compile(src, target=COMPILE.TARGET, options=options)


#: Argument types the kernels share (bf16 inputs and workspace, fp32 scratch and partials).
TYPES = dict(q="*bf16", k="*bf16", v="*bf16", g="*bf16", do="*bf16", A_log="*fp32", dt_bias="*fp32",
             kd="*bf16", qd="*bf16", kr="*bf16", inv="*bf16", mqk="*bf16", glast="*fp32", bsig="*fp32",
             ckpt="*bf16", ds="*bf16", chunk_index="*i32", segments="*i32", dv="*bf16", dg="*bf16", dbeta="*bf16",
             part_alog="*fp32", part_dt="*fp32", part_ck="*fp32", part_cc="*fp32", part_k="*fp32", part_c="*fp32",
             scale="fp32", lower_bound="fp32", NT="i32", NTS="i32", bounds="*i32", grp="i32", segment0="i32")


def compile_state(num_warps: int, chunk: int = 16, block_v: int = 128, maxnreg: int | None = None,
                  num_stages: int | None = None):
    """B3a, the split's state part, ``block_v`` value columns per program (``maxnreg``: the register cap)."""
    fn = _module("local_split_kernel.py").kda_bwd_v2_local_state_kernel
    return _compile(fn, TYPES, dict(HV=64, C=chunk, K=128, V=128, BV=block_v), num_warps, maxnreg, num_stages)


def compile_chunk(num_warps: int, chunk: int = 16, block_v: int = 128, group: int = 1, maxnreg: int | None = None):
    """B3b in Triton, the split's chunk-parallel K1 backwards, summing ``128 / block_v`` partials."""
    fn = _module("local_split_kernel.py").kda_bwd_v2_local_chunk_kernel
    acc = "*bf16" if group == 1 else "*fp32"
    cx = dict(HQ=64 // group, HV=64, C=chunk, K=128, NV=128 // block_v, HAS_ALOG=True, HAS_DT=True)
    return _compile(fn, dict(TYPES, dq=acc, dk=acc), cx, num_warps, maxnreg)


def _gluon_module(file: str):
    """A Gluon kernel file of ``bwd/v2``, with the forward K1 module it takes its layout constants from."""
    k1 = "flashkda.fwd.v2.prepare_kernel"
    sys.modules[k1] = COMPILE.load_by_path(k1, SRC / "fwd" / "v2" / "prepare_kernel.py")
    return COMPILE.load_by_path(f"flashkda_v2_{Path(file).stem}", SRC / "bwd" / "v2" / file)


def compile_chunk_gluon(block_v: int = 128, group: int = 1, maxnreg: int | None = None, head_dim: int = 128):
    """B3b in Gluon (16-token chunks, head width ``head_dim``, its own warp count), summing ``head_dim / block_v``
    partials."""
    mod = _gluon_module("local_k1_gluon.py")
    acc = "*bf16" if group == 1 else "*fp32"
    cx = dict(HQ=64 // group, HV=64, K=head_dim, NV=head_dim // block_v, HAS_ALOG=True, HAS_DT=True)
    return _compile(mod.kda_bwd_v2_k1_gluon_kernel, dict(TYPES, dq=acc, dk=acc), cx, int(mod.NUM_WARPS), maxnreg,
                    gluon=True)


KERNELS = ("state", "chunk", "chunk-gluon")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--chunk", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--block-v", type=int, nargs="+", default=[128],
                    help="B3a/B3b: value columns per B3a (the library's: 128)")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[0],
                    help="register caps to try (0, the default: none, ptxas' own)")
    ap.add_argument("--stages", type=int, default=None, help="num_stages of the walking kernels (default: Triton's)")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 64],
                    help="the Gluon B3b's head widths K (default: both); at K = 64 one block of 64 value columns")
    ap.add_argument("--sass", action="store_true", help="also print SASS op counts")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, target {COMPILE.TARGET}")
    jobs = []
    for chunk, cap in ((c, r or None) for c in args.chunk for r in args.maxnreg):
        for nw in args.warps:
            for bv in args.block_v:
                if "state" in args.kernels:
                    jobs.append((f"local_state (B3a) C={chunk} BV={bv} maxnreg={cap}",
                                 lambda c=chunk, w=nw, b=bv, r=cap: compile_state(w, c, b, r, args.stages)))
                if "chunk" in args.kernels:
                    jobs.append((f"local_chunk (B3b Triton) C={chunk} NV={128 // bv} maxnreg={cap}",
                                 lambda c=chunk, w=nw, b=bv, r=cap: compile_chunk(w, c, b, maxnreg=r)))
        if "chunk-gluon" in args.kernels and chunk == 16:
            for kk in args.head_dim:
                for bv in args.block_v if kk == 128 else [kk]:
                    jobs.append((f"local_k1_gluon (B3b Gluon) C=16 K={kk} NV={kk // bv} maxnreg={cap}",
                                 lambda b=bv, r=cap, kk=kk: compile_chunk_gluon(b, maxnreg=r, head_dim=kk)))
    failed = 0
    for name, build in jobs:
        failed += COMPILE.compile_and_report(name, build, args.sass, LOCAL_OPS) is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
