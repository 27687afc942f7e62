"""Offline sm_90 resource report of the FlashKDA backward kernels: registers, spills, shared memory, CTAs per SM.

Compiles the training kernels (``flashkda.bwd``) for an H100/H200 on a machine without a GPU, with the
helpers of `benchmarks.kda.resource_report` (``triton.compile`` on an ``ASTSource``, the wheel's ``ptxas -v``).
Nothing runs, so the numbers predict occupancy only; they are no timing. K = V = 128, C = 64, bf16 callers
(``tf32`` / bf16 operands) and fp32 callers (``ieee``).

Usage: ``python -m benchmarks.kda.bwd_resource_report [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import sys

import triton

from benchmarks.kda.resource_report import compile_one, ctas_per_sm, ptxas_usage
from flashkda.bwd import gated_dots, gates, prologue, recompute, state, state_tokens, wy
from flashkda.rounding import PREC_BF16, PREC_HILO

K = V = 128
C = 64


def configs() -> list[tuple[str, object, dict, dict, int]]:
    """``(name, kernel, signature, constexprs, num_warps)`` of every backward kernel at the benchmark shape."""
    out = []

    def add(name, fn, types, cx, nw):
        # a name in cx is a constexpr even where `types` was built over every argument name
        sig = {n: "constexpr" if n in cx else types.get(n, "constexpr") for n in fn.arg_names}
        out.append((name, fn, sig, {n: cx[n] for n in fn.arg_names if n in cx}, nw))

    f32 = "*fp32"
    for prec in ("tf32", "ieee"):
        add(f"gated_dots bwd {prec}", gated_dots.chunk_kda_bwd_kernel_gated_dots,
            dict(q=f32, k=f32, gam=f32, dakk=f32, daqk=f32, dakk_rs=f32, daqk_scale="fp32", dq=f32, dk=f32,
                 dgam=f32), dict(C=C, K=K, BC=gated_dots.BC, BK=K, DOT_PRECISION=prec, HAS_RS=True), 8)
    blocks = gated_dots.chunk_kda_bwd_kernel_gated_dots_gates_blocks
    for prec in ("tf32", "ieee"):
        for bk, nw in ((32, 4), (16, 4), (32, 8), (32, 2), (16, 2), (64, 8)):
            add(f"gates blocks {prec} BK{bk}", blocks, {**{n: f32 for n in blocks.arg_names}, "scale": "fp32"},
                dict(C=C, K=K, BC=gated_dots.BC, BK=bk, DOT_PRECISION=prec, HAS_RS=True), nw)
    add("ut", wy.chunk_kda_bwd_kernel_ut, {n: f32 for n in wy.chunk_kda_bwd_kernel_ut.arg_names},
        dict(C=C, K=K, V=V, BD=32, BV=V), 4)
    gates_kernel = gates.chunk_kda_bwd_kernel_gates
    add("gates", gates_kernel, {**{n: f32 for n in gates_kernel.arg_names}, "scale": "fp32"}, dict(C=C, K=K, BK=32), 4)
    for bv in (16, 32, 64):
        state_kernels = (("recompute_h", state.chunk_kda_recompute_kernel_h, ("PREC_WS", "PREC_KV")),
                         ("bwd_dh", state.chunk_kda_bwd_kernel_dh, ("PREC_AD", "PREC_KD", "PREC_QD", "PREC_WD")))
        for name, fn, precs in state_kernels:
            types = {n: f32 for n in fn.arg_names}
            types["chunk_offsets"] = "*i32"
            cx = dict(HV=1, C=C, K=K, V=V, BV=bv, BKB=64, NKB=K // 64, USE_H0=True, STORE_H=True, STORE_HT=False,
                      USE_DHT=True, STORE_DH0=True, EMULATE=False, **{n: PREC_BF16 for n in precs})
            add(f"{name} BV{bv}", fn, types, cx, 4)
    # raw-input kernels (bf16 inputs, bounded in-kernel gate, L2 norm, beta sigmoid)
    gate = dict(USE_L2=True, USE_GATE=True, USE_A=True, USE_BIAS=True, USE_LB=True, USE_SIGMOID=True)
    raw = dict(q="*bf16", k="*bf16", v="*bf16", g="*bf16", beta="*bf16", A_log=f32, dt_bias=f32, tok="*i64",
               lower_bound="fp32", beta_scale="fp32", scale="fp32", hv0="i32", NCL="i32")
    fn = recompute.chunk_kda_recompute_operands_kernel
    add("recompute operands", fn, {**{n: f32 for n in fn.arg_names}, **raw, "minv": "*bf16", "w": "*bf16",
                                   "qg": "*bf16", "kend": "*bf16"},
        dict(H=16, HV=16, HS=8, C=C, K=K, V=V, BV=V, PREC=PREC_HILO, EMULATE=False, **gate), 8)
    fn = prologue.chunk_kda_prologue_fwd_kernel
    for store in (True, False):
        add(f"prologue fwd{'' if store else ' no factors'}", fn, {**{n: f32 for n in fn.arg_names}, **raw},
            dict(H=16, HV=16, HVS=8, C=C, K=K, V=V, BV=V, STORE_FACTORS=store, **gate), 8)
    fn = state_tokens.chunk_kda_bwd_kernel_dh_tokens
    types = {**{n: f32 for n in fn.arg_names}, "qg": "*bf16", "kg": "*bf16", "w": "*bf16", "aqk": "*bf16",
             "do": "*bf16", "dv_new": "*bf16", "cu_seqlens": "*i32", "chunk_offsets": "*i32", "T": "i32", "NTS": "i32",
             "NCL": "i32", "NCD": "i32"}
    add("dh_tokens BV64", fn, types, dict(HV=16, HS=8, K=K, V=V, BT=C, BKB=64, NKB=K // 64, BV=64, USE_DHT=True,
                                          STORE_DH0=True, IS_VARLEN=True, PREC=PREC_BF16, EMULATE=False), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the kernel names to compile")
    args = ap.parse_args(argv)
    print(f"target sm_90 | triton {triton.__version__} | K = V = {K}, C = {C} | no device timing")
    print(f"{'kernel':<26} {'warps':>5} {'regs':>5} {'spill B':>8} {'smem B':>7} {'CTA/SM':>6}")
    for name, fn, sig, cx, nw in configs():
        if args.only and not any(s in name for s in args.only):
            continue
        try:
            kern = compile_one(fn, sig, cx, nw, None, 1)
        except Exception as e:  # noqa: BLE001 - report and continue with the other kernels
            print(f"{name:<26} {nw:>5} compile failed: {e!r}"[:300], flush=True)
            continue
        regs, spills = ptxas_usage(kern)
        smem = kern.metadata.shared
        print(f"{name:<26} {nw:>5} {regs:>5} {spills:>8} {smem:>7} {ctas_per_sm(regs, nw, smem):>6}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
