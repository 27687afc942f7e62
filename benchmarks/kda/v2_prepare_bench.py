"""Time the v2 prepare kernel (K1) alone on the KDA prefill rows against a copy of the same bytes by torch (the
bandwidth yardstick), after a check against the emulation.

Usage (GPU): ``python -m benchmarks.kda.v2_prepare_bench [--chunk 16|32] [--rows H64-T8192 ...] [--rep 20]
[--no-write]``.
Chunk 16 (the default): K1 moves 1638 B per token-head (q, k, g, beta in; kd, qd, kr, beta, INV, Mqk, 2^Glast out):
``GB/s`` is that count over the median time. The yardstick reads three ``[T, H, 128]`` bf16 tensors and writes three
(1536 B per token-head).

Chunk 32 (``--chunk 32``): both K1 c32 kernels of `prepare32_fwd` (``wide``, ``tma``), each checked against
``emulate_prepare32`` with the gpu tests' tolerances (a kernel that fails is not timed), timed alone (``k1 <kernel>``,
1686 B per token-head) and as the whole chunk-32 forward K1 + K2 (``fwd <kernel>``: ``prepare32_fwd(...,
kernel=...)`` then ``recurrence32_fwd`` with an initial and a final state, the forwards' outputs compared with each
other); ``speedup`` is ``k1 wide`` over ``k1 tma``. Results file ``kda-v2-prepare32-<date>.json``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.harness import Row, rms_ratio, time_fn, write_results
from benchmarks.kda.registry import PREFILL
from flashkda.fwd.v2.emulate import emulate_prepare
from flashkda.fwd.v2.emulate32 import emulate_prepare32
from flashkda.fwd.v2.prepare import prepare_fwd
from flashkda.fwd.v2.workspace import build_chunk_layout
from flashkda.fwd.v2.workspace32 import build_chunk_layout32

K1_BYTES_PER_TOKEN_HEAD = 3 * 256 + 2 + 3 * 256 + 4 + 2 * 512 / 16 + 512 / 16
#: K1 c32: q, k, g, beta in (770 B); kd, qd, kr, beta out (772 B); INV, Mqk (2 x 2048 B) and 2^Glast (512 B) per
#: 32 tokens
K1_C32_BYTES_PER_TOKEN_HEAD = 3 * 256 + 2 + 3 * 256 + 4 + 2 * 2048 / 32 + 512 / 32
COPY_BYTES_PER_TOKEN_HEAD = 6 * 256
#: the gpu tests' tolerances per workspace tensor (`tests/flashkda/test_fwd_v2.py: assert_workspace_close`)
WORKSPACE_TOL = {"kd": 2e-3, "qd": 2e-3, "kr": 2e-3, "beta": 1e-5, "glast": 1e-4, "mqk": 5e-3, "inv": 5e-3}


def inputs(case, device):
    gen = torch.Generator(device=device).manual_seed(0)
    T, H = case.T, case.H
    q, k, g = (torch.randn(1, T, H, 128, generator=gen, device=device).bfloat16() for _ in range(3))
    beta = torch.randn(1, T, H, generator=gen, device=device).bfloat16()
    A_log = torch.rand(H, generator=gen, device=device) * 2 - 1
    dt_bias = torch.randn(H * 128, generator=gen, device=device) * 0.5
    cu = None
    if case.varlen:
        cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)
    return q, k, g, beta, A_log, dt_bias, build_chunk_layout(1, T, cu, device)


def check(q, k, g, beta, A_log, dt_bias, layout, ws, ref=None) -> dict:
    """Relative RMS of every workspace tensor against the emulation (or ``ref``; used chunks only)."""
    if ref is None:
        ref = emulate_prepare(q, k, g, beta, 128**-0.5, layout, -5.0, A_log, dt_bias)
    used = int(layout.seq_chunks[-1])
    out = {}
    for name in ("kd", "qd", "kr", "inv", "mqk", "glast", "beta"):
        x, r = getattr(ws, name), getattr(ref, name)
        if x.shape[0] == layout.num_chunks:
            x, r = x[:used], r[:used]
        out[f"rms({name})"] = float(f"{rms_ratio(x.float(), r.float()):.2e}")
    return out


def bench_row(case, rep: int) -> Row:
    q, k, g, beta, A_log, dt_bias, layout = inputs(case, "cuda")
    th = case.T * case.H
    extra: dict = {}
    medians = {}
    def run():
        return prepare_fwd(q, k, g, beta, 128**-0.5, layout, -5.0, A_log, dt_bias)

    extra.update(check(q, k, g, beta, A_log, dt_bias, layout, run()))
    medians["k1"] = time_fn(run, device="cuda", warmup=3, rep=rep).median_ms
    extra["k1 ms"] = round(medians["k1"], 4)
    extra["k1 GB/s"] = round(th * K1_BYTES_PER_TOKEN_HEAD / medians["k1"] / 1e6, 1)
    src = [q, k, g]
    dst = [torch.empty_like(x) for x in src]

    def copy():
        for s, d in zip(src, dst):
            d.copy_(s)

    copy_ms = time_fn(copy, device="cuda", warmup=3, rep=rep).median_ms
    extra["copy ms"] = round(copy_ms, 4)
    extra["copy GB/s"] = round(th * COPY_BYTES_PER_TOKEN_HEAD / copy_ms / 1e6, 1)
    best = min(medians.values())
    print(f"{case.name}: " + ", ".join(f"{k_}={v}" for k_, v in extra.items()), flush=True)
    return Row(case.name, "torch copy of q, k, g (1536 B per token-head)", copy_ms, best,
               params=dict(H=case.H, T=case.T, lengths=list(case.lengths)), extra=extra)


def bench_row32(case, rep: int) -> Row:
    """Both K1 c32 kernels and the chunk-32 forward with each, on one prefill row."""
    from flashkda.fwd.v2.prepare32 import KERNELS32, prepare32_fwd
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    q, k, g, beta, A_log, dt_bias, _ = inputs(case, "cuda")
    cu = None
    if case.varlen:
        cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    layout = build_chunk_layout32(1, case.T, cu, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    v = torch.randn(1, case.T, case.H, 128, generator=gen, device="cuda").bfloat16()
    h0 = torch.randn(layout.num_seqs, case.H, 128, 128, generator=gen, device="cuda") * 0.1
    ref = emulate_prepare32(q, k, g, beta, 128**-0.5, layout, -5.0, A_log, dt_bias)
    th = case.T * case.H
    extra: dict = {}
    k1_ms: dict[str, float] = {}
    outputs = {}
    for kernel in KERNELS32:
        def k1(kernel=kernel):
            return prepare32_fwd(q, k, g, beta, 128**-0.5, layout, -5.0, A_log, dt_bias, kernel=kernel)

        def fwd(kernel=kernel):
            return recurrence32_fwd(k1(kernel), v, h0, True)

        try:
            errs = check(q, k, g, beta, A_log, dt_bias, layout, k1(), ref)
        except Exception as exc:  # a kernel that does not compile or launch here is reported, not timed
            extra[f"k1 {kernel} error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        extra.update({f"{kernel} {name}": err for name, err in errs.items()})
        failed = [name for name, tol in WORKSPACE_TOL.items() if not errs[f"rms({name})"] <= tol]
        if failed:
            extra[f"k1 {kernel} error"] = f"over the tolerance: {failed}"
            continue
        outputs[kernel] = fwd()[0]
        k1_ms[kernel] = time_fn(k1, device="cuda", warmup=3, rep=rep).median_ms
        extra[f"k1 {kernel} ms"] = round(k1_ms[kernel], 4)
        extra[f"k1 {kernel} GB/s"] = round(th * K1_C32_BYTES_PER_TOKEN_HEAD / k1_ms[kernel] / 1e6, 1)
        extra[f"fwd {kernel} ms"] = round(time_fn(fwd, device="cuda", warmup=3, rep=rep).median_ms, 4)
    if len(outputs) == 2:
        extra["rms(o tma vs wide)"] = float(f"{rms_ratio(outputs['tma'].float(), outputs['wide'].float()):.2e}")
    if len(k1_ms) == 2:
        extra["k1 tma/wide speed-up"] = round(k1_ms["wide"] / k1_ms["tma"], 3)
        extra["fwd tma/wide speed-up"] = round(extra["fwd wide ms"] / extra["fwd tma ms"], 3)
    print(f"{case.name}: " + ", ".join(f"{k_}={v_}" for k_, v_ in extra.items()), flush=True)
    return Row(case.name, "K1 c32 wide (prepare32_fwd kernel='wide')", k1_ms.get("wide"), k1_ms.get("tma"),
               params=dict(H=case.H, T=case.T, lengths=list(case.lengths), chunk=32), extra=extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=16, choices=(16, 32),
                    help="16: the chunk-16 K1; 32: both K1 c32 kernels (wide, tma) and the forward with each")
    ap.add_argument("--rows", nargs="*", default=None, help=f"rows (default all): {[c.name for c in PREFILL]}")
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--no-write", action="store_true", help="print only, write no results file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    cases = [c for c in PREFILL if not args.rows or c.name in args.rows]
    rows = []
    with torch.inference_mode():
        for case in cases:
            rows.append(bench_row(case, args.rep) if args.chunk == 16 else bench_row32(case, args.rep))
            torch.cuda.empty_cache()
    if rows and not args.no_write:
        if args.chunk == 16:
            print(write_results("kda-v2-prepare", rows, title="FlashKDA v2 prepare kernel (K1)"))
        else:
            print(write_results("kda-v2-prepare32", rows,
                                title="FlashKDA v2 K1 c32: wide vs TMA kernel (alone and in the forward)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
