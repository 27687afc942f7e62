"""Offline sm_90 resource report of the FlashKDA forward intra-chunk kernel(s): registers, spills, shared memory.

Compiles the Triton kernels for an H100/H200 (``GPUTarget("cuda", 90, 32)``) on a machine without a GPU, with the
ptxas that ships in Triton's wheel, and prints one line per (kernel, configuration). Nothing runs on a device, so
these numbers predict occupancy only; they are no timing.

Usage: ``python -m benchmarks.kda.resource_report [--warps 4 8] [--gate bounded softplus] [--sass] [--lines]
[--state BV:WARPS:STAGES ...] [--blocked BV:WARPS:STAGES ...] [--merge]
[--no-intra]``.
Configurations: bf16 input (tf32 products, bf16 w/kg) and fp32 input (ieee products), K = V = 128, fixed-length,
in-kernel gate with ``lower_bound`` + ``safe_gate`` (the benchmark setting) or the softplus gate (pair-by-pair
diagonal path).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from flashkda.fwd import intra, state
from flashkda.rounding import PREC_BF16, PREC_HILO

TARGET = GPUTarget("cuda", 90, 32)
#: Registers per SM and the per-thread cap on sm_90; used to report resident CTAs per SM.
REGS_PER_SM = 65536
MAX_SMEM = 227 * 1024


def kernel_spec(fn, types: dict, constexprs: dict):
    """``(fn, signature, constexprs)`` for `compile_one`: ``types`` for the runtime arguments (every other argument
    is a constexpr), and the entries of ``constexprs`` that ``fn`` takes."""
    return (fn, {n: types.get(n, "constexpr") for n in fn.arg_names},
            {n: constexprs[n] for n in fn.arg_names if n in constexprs})


def intra_configs(dtype: str, gate: str, merge: bool = False, store_local: bool = False):
    """(kernel, runtime-argument types, constexprs) for each kernel of the intra stage at one setting (``merge``:
    stacked Aqk/Akk products; ``store_local``: the training forward, which also writes Akk and the inverse)."""
    work = "bf16" if dtype == "bf16" else "fp32"
    prec = "tf32" if dtype == "bf16" else "ieee"
    bounded = gate == "bounded"
    common = dict(H=1, HV=1, K=128, V=128, BT=64, BC=16, BK=128, BV=128, BKC=intra.SLICE,
                  BS=intra.SLICE, BKN=64, USE_GATE=True, HAS_A=True,
                  HAS_BIAS=True, USE_LOWER_BOUND=bounded,
                  USE_L2NORM=True, BETA_SIGMOID=True, ALLOW_NEG_EIGVAL=False, SAFE_GATE=bounded, IS_VARLEN=False,
                  DOT_PREC=prec, INV_PREC="ieee" if prec == "ieee" else "tf32x3",
                  MERGE=merge, STORE_LOCAL=store_local, LHS=1)
    return [kernel_spec(fn, types, common) for fn, types in kernel_signatures(work)]


def kernel_signatures(work: str):
    """Runtime-argument types of the intra-stage kernels (bf16 inputs; ``work`` is the w/kg dtype)."""
    io = dict(q="*bf16", k="*bf16", v="*bf16", g="*bf16", beta="*bf16", A_log="*fp32", dt_bias="*fp32",
              cu_seqlens="*i32", chunk_offsets="*i32", chunk_map="*i32", w=f"*{work}", kg=f"*{work}",
              u="*fp32", qg="*fp32", Aqk="*fp32", gC="*fp32", AqkC="*fp32", Akk="*fp32", Minv="*fp32",
              scale="fp32",
              lower_bound="fp32", T="i32", NTS="i32", NCL="i32")
    return [(intra.chunk_kda_fwd_kernel_intra, io)]


def state_config(dtype: str, block_v: int):
    """(kernel, runtime-argument types, constexprs) of the state + output kernel (K = V = 128, initial and final
    state, fixed length)."""
    work = "bf16" if dtype == "bf16" else "fp32"
    fn = state.chunk_kda_fwd_kernel_state_o
    types = dict(w=f"*{work}", u="*fp32", qg="*fp32", kg=f"*{work}", Aqk="*fp32", gC="*fp32", o="*bf16",
                 h0="*fp32", ht="*fp32", h="*fp32", cu_seqlens="*i32", chunk_offsets="*i32", T="i32", NTS="i32",
                 PROGRAMS="i32")
    cx = dict(HV=1, K=128, V=128, BT=64, BK=128, BV=block_v, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True,
              STORE_H=False, STATE_V_FIRST=False, IS_VARLEN=False, DOT_PREC="tf32" if dtype == "bf16" else "ieee",
              DT=triton.language.float32)
    return kernel_spec(fn, types, cx)


def blocked_state_config(block_v: int):
    """(kernel, types, constexprs) of the blocked state-only pass as bf16 input runs it by default (bf16 w, kg, u,
    v_new and h; state rounded to bf16 in ``w S``, v_new as a hi/lo split in ``kgᵀ v_new``; K = V = 128)."""
    fn = state.chunk_kda_fwd_kernel_h
    types = dict(w="*bf16", u="*bf16", kg="*bf16", gC="*fp32", h="*bf16", vn="*bf16", h0="*fp32", ht="*fp32",
                 cu_seqlens="*i32", chunk_offsets="*i32", T="i32", NTS="i32", PROGRAMS="i32")
    cx = dict(HV=1, K=128, V=128, BT=64, BKB=64, NKB=2, BV=block_v, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True,
              STATE_V_FIRST=False, IS_VARLEN=False, PREC_WS=PREC_BF16, PREC_KV=PREC_HILO,
              EMULATE=False)
    return kernel_spec(fn, types, cx)


def compile_one(fn, signature, constexprs, num_warps: int, maxnreg: int | None = None, num_stages: int = 1):
    # Pointers carry the 16-byte alignment that Triton's launcher specialises on at run time (every torch
    # allocation has it): without it the loads compile to scalar 2-byte accesses, the register and spill counts
    # are not the device's (without it the intra kernel reads 255 registers and 324 B of spills; with it 255 and
    # 0, as ncu reads on the H200).
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if str(signature.get(name, "")).startswith("*")}
    src = ASTSource(fn, signature, constexprs, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=TARGET, options=options)


def ctas_per_sm(n_regs: int, num_warps: int, smem: int) -> int:
    by_regs = REGS_PER_SM // (max(n_regs, 1) * 32 * num_warps)
    by_smem = MAX_SMEM // smem if smem else 32
    return max(0, min(by_regs, by_smem, 64 // num_warps))


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_usage(kernel) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) from ``ptxas -v`` on the kernel's PTX (the ptxas Triton uses)."""
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        err = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True).stderr
    # Only the entry function's block counts: called helpers (fp32 division, sqrt slow paths) print their own.
    err = err[err.find(f"Function properties for {kernel.metadata.name}"):]
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1


def sass_counts(kernel) -> dict[str, int]:
    """Counts of a few SASS opcodes (local-memory traffic, tensor-core ops) via the wheel's cuobjdump."""
    cuobjdump = _tool("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    ops = ("LDL", "STL", "HMMA", "HGMMA", "BAR", "SHFL")
    return {op: sum(1 for line in out.splitlines() if f" {op}" in line) for op in ops}


def line_profile(kernel, trips: list[int], path: str, top: int = 25) -> None:
    """Prints the SASS instructions per source line of the file ``path``, loops counted ``trips`` times.

    Each instruction is charged to its outermost line in that file (``nvdisasm -gi`` line info, inlined helpers
    folded into their call site); a backward branch closes a loop, and the i-th loop in address order runs
    ``trips[i]`` times (1 when ``trips`` is shorter). Static counts times trips: an estimate of the instructions
    one thread executes, to find where a kernel's instructions go without a device (the intra kernel's estimate,
    13.3k, matched ncu's 13.7k per warp on the H200).
    """
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([_tool("nvdisasm"), "-gi", "-c", f.name], capture_output=True, text=True).stdout
    source = os.path.basename(path)
    with open(path) as f:
        code = f.read().splitlines()
    ins, labels, where = [], {}, None
    for text in out.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)(.*)', text)
        if m:
            chain = [(m.group(1), int(m.group(2)))] + [(file, int(n)) for file, n in
                                                      re.findall(r'inlined at "([^"]+)", line (\d+)', m.group(3))]
            here = [n for file, n in chain if os.path.basename(file) == source]
            where = here[-1] if here else None
            continue
        m = re.match(r"^\.(L_x_\d+):", text.strip())
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*)", text)
        if m:
            ins.append((where, m.group(1)))
    weight = [1] * len(ins)
    loops = 0
    for i, (_, text) in enumerate(ins):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", text)
        if m and labels.get(m.group(1), i) < i:
            trip = trips[loops] if loops < len(trips) else 1
            for j in range(labels[m.group(1)], i + 1):
                weight[j] = trip
            loops += 1
    per_line = {}
    for (line, _), w in zip(ins, weight):
        per_line[line] = per_line.get(line, 0) + w
    total = sum(per_line.values())
    print(f"  ~{total} instructions per thread ({loops} loops, trips {trips[:loops]}); top lines of {source}:")
    for line, n in sorted(per_line.items(), key=lambda kv: -kv[1])[:top]:
        text = code[line - 1].strip() if line else "(no line)"
        print(f"  {n:>6} {100 * n / total:5.1f}%  {line or '-':>4}  {text[:90]}")


def report(fn, sig, cx, dtype: str, gate: str, nw: int, cap: int, sass: bool, num_stages: int = 1,
           name: str | None = None, trips: list[int] | None = None) -> None:
    name = name or fn.__name__.removeprefix("chunk_kda_fwd_kernel_")
    try:
        kern = compile_one(fn, sig, cx, nw, cap or None, num_stages)
    except Exception as e:  # noqa: BLE001 - report and continue with the other configurations
        print(f"{name:<32} {dtype:<5} {gate:<9} {nw:>5} {cap:>4} compile failed: {e!r}"[:200])
        return
    n_regs, n_spills = ptxas_usage(kern)
    smem = kern.metadata.shared
    line = (f"{name:<32} {dtype:<5} {gate:<9} {nw:>5} {cap:>4} {n_regs:>5} {n_spills:>8} {smem:>7} "
            f"{ctas_per_sm(n_regs, nw, smem):>6}")
    if sass:
        line += "  " + " ".join(f"{k}={v}" for k, v in sass_counts(kern).items())
    print(line, flush=True)
    if trips is not None:
        line_profile(kern, trips, fn.fn.__code__.co_filename)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--gate", nargs="+", default=["bounded", "softplus"])
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[0],
                    help="register caps per thread to try (0: none, as the launcher's default)")
    ap.add_argument("--sass", action="store_true", help="also count LDL/STL/HMMA/HGMMA/BAR/SHFL in the SASS")
    ap.add_argument("--state", nargs="*", default=[], metavar="BV:WARPS:STAGES",
                    help="also (or with --no-intra, only) the state + output kernel at these configurations")
    ap.add_argument("--blocked", nargs="*", default=[], metavar="BV:WARPS:STAGES",
                    help="also the blocked state-only pass (bf16 input defaults); with --lines, 128 chunk steps")
    ap.add_argument("--merge", action="store_true", help="intra kernel with the stacked Aqk/Akk products")
    ap.add_argument("--no-intra", action="store_true")
    ap.add_argument("--store-local", action="store_true", help="intra kernel of the training forward (STORE_LOCAL)")
    ap.add_argument("--lines", action="store_true",
                    help="intra kernel: instructions per source line, loop trips folded in (see line_profile)")
    args = ap.parse_args(argv)
    print(f"target sm_90 | triton {triton.__version__} | K = V = 128, BT = 64, BC = 16 | no device timing")
    head = (f"{'kernel':<32} {'dtype':<5} {'gate':<9} {'warps':>5} {'cap':>4} {'regs':>5} {'spill B':>8} "
            f"{'smem B':>7} {'CTA/SM':>6}")
    print(head)
    print("-" * len(head))
    for spec in args.state:
        bv, nw, ns = (int(p) for p in spec.split(":"))
        for dtype in args.dtype:
            fn, sig, cx = state_config(dtype, bv)
            report(fn, sig, cx, dtype, "-", nw, 0, args.sass, ns, name=f"state_o {spec}")
    for spec in args.blocked:
        bv, nw, ns = (int(p) for p in spec.split(":"))
        fn, sig, cx = blocked_state_config(bv)
        report(fn, sig, cx, "bf16", "-", nw, 0, args.sass, ns, name=f"h_blocked {spec}",
               trips=[128] if args.lines else None)
    for dtype in args.dtype if not args.no_intra else []:
        for gate in args.gate:
            for fn, sig, cx in intra_configs(dtype, gate, args.merge, args.store_local):
                for nw in args.warps:
                    for cap in args.maxnreg:
                        # loops in address order: L2 norms, pass 1, pass 2 (w, then u)
                        trips = [cx["K"] // cx["BKN"], cx["K"] // cx["BKC"], cx["K"] // cx["BS"], cx["V"] // cx["BS"]]
                        report(fn, sig, cx, dtype, gate, nw, cap, args.sass, trips=trips if args.lines else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
