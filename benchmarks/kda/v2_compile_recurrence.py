"""Offline sm_90a compile of the v2 recurrence kernel (K2): registers, spills, shared memory, SASS op counts.

Runs without a GPU and without torch, with Triton 3.6 (the GPU machine's version):
``/work/venv36/bin/python benchmarks/kda/v2_compile_recurrence.py [--head-dim 128 64] [--bv 64 128] [--stages 2 3]
[--sass]`` (``BV`` above the head width is skipped).
The kernel file is loaded by path, so ``flashkda`` (and torch) are not imported.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

TARGET = GPUTarget("cuda", 90, 32)
KERNEL_FILE = Path(__file__).resolve().parents[2] / "src" / "flashkda" / "fwd" / "v2" / "recurrence_kernel.py"
RECURRENCE_OPS = ("LDL", "STL", "HGMMA", "BAR", "LDS", "STS", "SHFL", "SYNCS", "UTMALDG")


def _load_compile_script():
    spec = importlib.util.spec_from_file_location("v2_compile", Path(__file__).resolve().parent / "v2_compile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


COMPILE = _load_compile_script()
"""`v2_compile.py` (loaded by path: both scripts run as files under Triton 3.6): ptxas, SASS and dump helpers."""


def load_kernel_module(path: Path = KERNEL_FILE):
    return COMPILE.load_by_path("flashkda_v2_recurrence_kernel", path)


def desc_type(dtype: str, block: list[int]) -> str:
    """The signature string Triton's launcher gives a Gluon TensorDescriptor of ``dtype`` and ``block``."""
    bits = {"bf16": 16, "fp32": 32}[dtype]
    gl_dtype = {"bf16": gl.bfloat16, "fp32": gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    assert layout.element_bitwidth == bits
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout}>"


def compile_recurrence(block_v: int, stages: int, use_order: bool = True, every: int = 0, head_dim: int = 128):
    mod = load_kernel_module()
    fn = mod.kda_fwd_v2_recurrence_kernel
    tok, tile = desc_type("bf16", [16, head_dim]), desc_type("bf16", [16, 16])
    types = dict(kd_desc=tok, qd_desc=tok, kr_desc=tok, inv_desc=tile, mqk_desc=tile, glast="*fp32",
                 beta="*fp32", v="*bf16", o="*bf16", h0="*fp32", ht="*fp32", cu_seqlens="*i32",
                 seq_chunks="*i32", order="*i32", ckpt="*bf16", ck_offsets="*i32", H="i32")
    num_warps = block_v // 16
    cx = dict(K=head_dim, BV=block_v, STAGES=stages, USE_ORDER=use_order, USE_H0=True, STORE_HT=True, EVERY=every,
              num_warps=num_warps)
    sig, attrs = COMPILE.signature(fn, types)
    src = GluonASTSource(fn, sig, cx, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 64], help="K = V")
    ap.add_argument("--bv", type=int, nargs="+", default=[64])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--every", type=int, nargs="+", default=[0, 8],
                    help="checkpoint every N chunks (0: the inference kernel, 8: training's F2)")
    ap.add_argument("--sass", action="store_true", help="also print SASS op counts")
    ap.add_argument("--dump", default=None, help="write the ttgir/ptx of the first configuration to this folder")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, target {TARGET}")
    failed = 0
    configs = [(kk, bv, st, e) for kk in args.head_dim for bv in args.bv for st in args.stages for e in args.every
               if bv <= kk]
    for kk, bv, st, every in configs:
        name = (f"recurrence K={kk} BV={bv} warps={bv // 16} stages={st}"
                + (f" checkpoints every={every}" if every else ""))
        k = COMPILE.compile_and_report(name, functools.partial(compile_recurrence, bv, st, every=every, head_dim=kk),
                                       args.sass, RECURRENCE_OPS)
        if k is None:
            failed += 1
            continue
        if args.dump:
            COMPILE.dump_asm(k, args.dump, f"recurrence_k{kk}_bv{bv}_s{st}_e{every}")
            args.dump = None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
