"""Time the v2 prepare kernel (K1) alone on the KDA prefill rows against a copy of the same bytes by torch (the
bandwidth yardstick), after a check against the emulation. ``--chunk 32`` times the chunk-32 kernel instead, checked
against ``emulate_prepare32``.

Usage (GPU): ``python -m benchmarks.kda.v2_prepare_bench [--chunk 16|32] [--rows H64-T8192 ...] [--rep 20]
[--no-write]``.
K1 moves 1638 B per token-head (q, k, g, beta in; kd, qd, kr, beta, INV, Mqk, 2^Glast out): ``GB/s`` is that count
over the median time. The yardstick reads three ``[T, H, 128]`` bf16 tensors and writes three (1536 B per token-head).
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from benchmarks.harness import Row, rms_ratio, time_fn, write_results
from benchmarks.kda.registry import PREFILL
from flashkda.fwd.v2.emulate import emulate_prepare
from flashkda.fwd.v2.prepare import prepare_fwd
from flashkda.fwd.v2.workspace import build_chunk_layout

K1_BYTES_PER_TOKEN_HEAD = 3 * 256 + 2 + 3 * 256 + 4 + 2 * 512 / 16 + 512 / 16
COPY_BYTES_PER_TOKEN_HEAD = 6 * 256


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


def check(ws, ref, layout) -> dict:
    """Relative RMS of every workspace tensor against the emulation's ``ref`` (used chunks only)."""
    used = int(layout.seq_chunks[-1])
    out = {}
    for name in ("kd", "qd", "kr", "inv", "mqk", "glast", "beta"):
        x, r = getattr(ws, name), getattr(ref, name)
        if x.shape[0] == layout.num_chunks:
            x, r = x[:used], r[:used]
        out[f"rms({name})"] = float(f"{rms_ratio(x.float(), r.float()):.2e}")
    return out


def _kernels(case, chunk: int):
    """``(q, k, g, layout, emulated workspace, name, launcher)`` of the chunk size's K1 kernel."""
    q, k, g, beta, A_log, dt_bias, layout = inputs(case, "cuda")
    args = (q, k, g, beta, 128**-0.5)
    if chunk == 16:
        ref = emulate_prepare(*args, layout, -5.0, A_log, dt_bias)
        return q, k, g, layout, ref, "k1", lambda: prepare_fwd(*args, layout, -5.0, A_log, dt_bias)
    from flashkda.fwd.v2.emulate32 import emulate_prepare32
    from flashkda.fwd.v2.prepare32 import prepare32_fwd
    from flashkda.fwd.v2.workspace32 import build_chunk_layout32

    cu = None
    if case.varlen:
        cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    layout = build_chunk_layout32(1, case.T, cu, q.device)
    ref = emulate_prepare32(*args, layout, -5.0, A_log, dt_bias)
    return q, k, g, layout, ref, "k1 c32", functools.partial(prepare32_fwd, *args, layout, -5.0, A_log, dt_bias)


def bench_row(case, rep: int, chunk: int = 16) -> Row:
    th = case.T * case.H
    q, k, g, layout, ref, name, run = _kernels(case, chunk)
    extra = check(run(), ref, layout)
    k1_ms = time_fn(run, device="cuda", warmup=3, rep=rep).median_ms
    extra[f"{name} ms"] = round(k1_ms, 4)
    extra[f"{name} GB/s"] = round(th * K1_BYTES_PER_TOKEN_HEAD / k1_ms / 1e6, 1)
    src = [q, k, g]
    dst = [torch.empty_like(x) for x in src]

    def copy():
        for s, d in zip(src, dst):
            d.copy_(s)

    copy_ms = time_fn(copy, device="cuda", warmup=3, rep=rep).median_ms
    extra["copy ms"] = round(copy_ms, 4)
    extra["copy GB/s"] = round(th * COPY_BYTES_PER_TOKEN_HEAD / copy_ms / 1e6, 1)
    print(f"{case.name}: " + ", ".join(f"{k_}={v}" for k_, v in extra.items()), flush=True)
    return Row(case.name, "torch copy of q, k, g (1536 B per token-head)", copy_ms, k1_ms,
               params=dict(H=case.H, T=case.T, lengths=list(case.lengths)), extra=extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=None, help=f"rows (default all): {[c.name for c in PREFILL]}")
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--chunk", type=int, choices=(16, 32), default=16,
                    help="16: the chunk-16 K1; 32: the chunk-32 K1")
    ap.add_argument("--no-write", action="store_true", help="print only, write no results file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    cases = [c for c in PREFILL if not args.rows or c.name in args.rows]
    rows = []
    with torch.inference_mode():
        for case in cases:
            rows.append(bench_row(case, args.rep, args.chunk))
            torch.cuda.empty_cache()
    if rows and not args.no_write:
        print(write_results("kda-v2-prepare", rows, title="FlashKDA v2 prepare kernel (K1)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
