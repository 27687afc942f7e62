"""Offline sm_90a compile of the v2 forward kernels: registers, spills, shared memory and resident CTAs per SM.

Runs without a GPU and without torch, with Triton 3.6 (the GPU machine's version):
``/work/venv36/bin/python benchmarks/kda/v2_compile.py [--sass] [--dump DIR] [--no-recurrence]
[--head-dim 128 64]``.
Kernel files are loaded by path, so ``flashkda`` (and torch) are not imported. The prepare kernel (K1) is compiled
here; the recurrence kernel (K2) and the chunk-32 kernels by ``v2_compile_recurrence.py`` and
``v2_compile32.py`` (with the chunk-32 K1) beside this file, run after K1 when present.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource

TARGET = GPUTarget("cuda", 90, 32)
HERE = Path(__file__).resolve().parent
V2_DIR = HERE.parents[1] / "src" / "flashkda" / "fwd" / "v2"
REGS_PER_SM, SMEM_PER_SM, MAX_CTAS, MAX_WARPS = 65536, 228 * 1024, 32, 64
PREPARE_OPS = ("LDG", "STG", "LDS", "STS", "LDSM", "HMMA", "BAR", "SHFL", "MUFU", "LDL", "STL")


def load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def signature(fn, types: dict) -> tuple[dict, dict]:
    """``fn``'s compile signature (``types`` by argument name, every other argument constexpr) and the 16-byte
    divisibility attribute of each pointer argument."""
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    return sig, {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}


def compile_prepare(has_a_log: bool = True, has_dt_bias: bool = True, group: int = 1,
                    file: str = "prepare_kernel.py", kernel: str = "kda_fwd_v2_prepare_batched_kernel",
                    maxnreg: int | None = None, head_dim: int = 128):
    """Compile a prepare kernel (the chunk-16 one by default; ``file``/``kernel`` name another with its arguments;
    ``maxnreg`` overrides the module's register cap; ``head_dim``: K, for a kernel that takes it)."""
    mod = load_by_path(f"flashkda_v2_{Path(file).stem}", V2_DIR / file)
    fn = getattr(mod, kernel)
    types = dict(q="*bf16", k="*bf16", g="*bf16", beta_in="*bf16", A_log="*fp32", dt_bias="*fp32",
                 chunk_index="*i32", kd="*bf16", qd="*bf16", kr="*bf16", inv="*bf16", mqk="*bf16",
                 glast="*fp32", beta="*fp32", scale="fp32", gate_scale="fp32", NT="i32", H="i32")
    sig, attrs = signature(fn, types)
    cx = dict(GROUP=group, HAS_A_LOG=has_a_log, HAS_DT_BIAS=has_dt_bias)
    num_warps = int(mod.NUM_WARPS)
    if "K" in fn.arg_names:
        cx["K"] = head_dim
    options = dict(num_warps=num_warps, maxnreg=int(maxnreg or mod.MAX_REGISTERS))
    return triton.compile(GluonASTSource(fn, sig, cx, attrs), target=TARGET, options=options)


def ptxas_usage(kernel) -> tuple[int, int, bool]:
    """(registers per thread, spill-store bytes, wgmma serialised) from ``ptxas -v`` on the kernel's PTX."""
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        err = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True).stderr
    # ptxas C7514: every wgmma waited for right after its issue (no overlap)
    serialised = "wgmma.mma_async instructions are serialized" in err
    err = err[err.find(f"Function properties for {kernel.metadata.name}"):]
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1, serialised


def ctas_per_sm(regs: int, num_warps: int, smem: int) -> int:
    """Resident CTAs per sm_90 SM allowed by registers (allocated per warp in 256-register units), shared memory,
    warps and the CTA cap."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * num_warps)
    by_smem = SMEM_PER_SM // (smem + 1024) if smem else MAX_CTAS
    return min(by_regs, by_smem, MAX_WARPS // num_warps, MAX_CTAS)


def sass_counts(kernel, ops: tuple[str, ...]) -> dict[str, int]:
    """How many SASS instructions of each opcode in ``ops`` the kernel's cubin holds."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    return {op: sum(1 for line in out.splitlines() if f" {op}" in line) for op in ops}


def dump_asm(kernel, folder: str, stem: str) -> None:
    """Write the kernel's ttgir, llir and ptx to ``folder/stem.*``."""
    os.makedirs(folder, exist_ok=True)
    for ext in ("ttgir", "llir", "ptx"):
        with open(os.path.join(folder, f"{stem}.{ext}"), "w") as f:
            f.write(kernel.asm[ext])


def report(name: str, kernel, sass: bool, ops) -> str:
    """One line of a compiled kernel's resources (and SASS op counts with ``sass``)."""
    regs, spill, serialised = ptxas_usage(kernel)
    nw = kernel.metadata.num_warps
    line = (f"{name}: warps={nw} regs={regs} spill_stores={spill}B smem={kernel.metadata.shared}B "
            f"ctas/SM={ctas_per_sm(regs, nw, kernel.metadata.shared)}{' WGMMA-SERIALIZED' if serialised else ''}")
    return line + (f" sass={sass_counts(kernel, ops)}" if sass else "")


def compile_and_report(name: str, build, sass: bool, ops):
    """``build()`` one configuration and print its `report` line, or its failure (every configuration is reported,
    a failing one does not stop the rest): the kernel, or None when it failed to compile."""
    try:
        kernel = build()
    except Exception as exc:
        print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:4000]}")
        return None
    print(report(name, kernel, sass, ops))
    return kernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="also print SASS op counts")
    ap.add_argument("--dump", default=None, help="write the prepare kernel's ttgir/ptx to this folder (prepare_k<K>.*)")
    ap.add_argument("--no-recurrence", action="store_true", help="skip the recurrence kernel's compile")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 64], help="K1's head widths K (default: both)")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, target {TARGET}")
    failed = 0
    for head_dim in args.head_dim:
        for a_log, bias, group in [(True, True, 1), (False, False, 1), (True, True, 2)]:
            name = f"prepare K={head_dim} A_log={a_log} dt_bias={bias} GVA group={group}"
            build = functools.partial(compile_prepare, a_log, bias, group, head_dim=head_dim)
            k = compile_and_report(name, build, args.sass, PREPARE_OPS)
            if k is None:
                failed += 1
                continue
            if args.dump and (a_log, bias, group) == (True, True, 1):
                dump_asm(k, args.dump, f"prepare_k{head_dim}")
    for script in ("v2_compile_recurrence.py", "v2_compile32.py", "v2_compile_bwd.py"):
        rec = HERE / script
        if not args.no_recurrence and rec.exists():
            failed += load_by_path(rec.stem, rec).main(["--sass"] if args.sass else [])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
