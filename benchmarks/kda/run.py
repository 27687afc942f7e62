"""FlashKDA forward benchmark: ours vs fla-core 0.6.0 in one run, correctness gate first.

Prefill rows run ``flashkda.chunk_kda`` and ``fla.ops.kda.chunk_kda`` (its Triton path: ``FLA_FLASH_KDA=0`` and
``FLASHKDA_DISABLE=1`` so neither CUTLASS FlashKDA nor our own backend serves the fla call) with the in-kernel
bounded gate (``lower_bound=-5``, ``safe_gate=True``), in-kernel L2 norm and beta sigmoid, fp32 initial and final
state, under ``torch.inference_mode()``. The decode row runs both ``fused_recurrent_kda``. Each row reports the
median ms of both, the ratio, the peak extra memory of each call, and the fraction of the HBM floor (bytes that
must move / copy bandwidth measured in the same run).

Usage: ``python -m benchmarks.kda.run [--cases NAME ...] [--no-write] [--rep N]`` (``k3infra bench kda``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLASHKDA_DISABLE", "1")

from benchmarks.harness import Row, machine_info, machine_line, rms_ratio, time_fn, write_results  # noqa: E402
from benchmarks.kda.registry import CASES, DECODE, PREFILL, Case  # noqa: E402
from benchmarks.progress import track  # noqa: E402


def make_inputs(case: Case, device: str, seed: int = 0):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    H, D = case.H, case.D
    if case.decode:
        B, T, N = len(case.lengths), 1, len(case.lengths)
    else:
        B, T, N = 1, case.T, len(case.lengths)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    x = dict(q=rn(B, T, H, D), k=rn(B, T, H, D), v=rn(B, T, H, D), g=rn(B, T, H, D), beta=rn(B, T, H))
    x["A_log"] = torch.log(torch.empty(H, device=device).uniform_(1, 16, generator=gen))
    x["dt_bias"] = rn(H * D, dtype=torch.float32)
    x["initial_state"] = rn(N, H, D, D, dtype=torch.float32) * 0.1
    if case.varlen:
        cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int64)
        x["cu_seqlens"], x["cu_seqlens_cpu"] = cu.to(device), cu
    return x


FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)


def hbm_bytes(case: Case) -> int:
    """Bytes that must move at least once: q, k, v, g, beta read; o written; fp32 state read and written."""
    D, H, T, N = case.D, case.H, case.T, len(case.lengths)
    return T * H * (4 * D * 2 + 2) + T * H * D * 2 + 2 * N * H * D * D * 4


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), 1 GiB buffers."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device=device, warmup=3, rep=10)
    return 2 * src.numel() / (t.median_ms * 1e-3)


def peak_extra_mib(fn, device: str) -> float:
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def _extra(t_ours, mem_fla: float, mem_ours: float, floor_ms: float, err_o: float) -> dict:
    return {"ours p20-p80 ms": f"{t_ours.p20_ms:.3f}-{t_ours.p80_ms:.3f}", "fla peak MiB": round(mem_fla, 1),
            "ours peak MiB": round(mem_ours, 1), "HBM floor ms": round(floor_ms, 4),
            "ours % of floor": round(100 * floor_ms / t_ours.median_ms, 1), "rms(o) vs fla": f"{err_o:.1e}"}


def stage_times(x: dict, device: str, rep: int) -> dict:
    """Median ms of our two stages alone (intra-chunk; state + output, which the state path says)."""
    from flashkda.fwd.chunk_fwd import dot_precision_for, work_dtype_for
    from flashkda.fwd.intra import CHUNK_SIZE, chunk_kda_fwd_intra
    from flashkda.fwd.state import chunk_kda_fwd_state_o, prefer_split
    from flashkda.index import build_chunk_index

    q = x["q"]
    index = build_chunk_index(q.shape[0], q.shape[1], x.get("cu_seqlens"), CHUNK_SIZE)
    prec = dot_precision_for(q.dtype)
    intra = lambda: chunk_kda_fwd_intra(q, x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                        q.shape[-1] ** -0.5, -5.0, True, True, True, False, True, index,
                                        work_dtype_for(q.dtype), prec)
    mid = intra()
    state = lambda: chunk_kda_fwd_state_o(*mid, x["initial_state"], True, False, index, q.dtype, prec)
    split = prefer_split(index.num_seqs * q.shape[2], x["v"].shape[-1], mid[0], prec)
    return {"intra ms": round(time_fn(intra, device=device, rep=rep).median_ms, 3),
            "state+o ms": round(time_fn(state, device=device, rep=rep).median_ms, 3),
            "state path": "split (state-only + output kernel)" if split else "fused",
            "intermediates": "bf16" if mid[2].element_size() == 2 else "fp32"}


def run_prefill(case: Case, device: str, bw: float, rep: int) -> Row:
    import fla.ops.kda as fla_kda
    import torch

    import flashkda

    x = make_inputs(case, device)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(FLAGS, initial_state=x["initial_state"], A_log=x["A_log"], dt_bias=x["dt_bias"],
              cu_seqlens=x.get("cu_seqlens"), cu_seqlens_cpu=x.get("cu_seqlens_cpu"))
    ours = lambda: flashkda.chunk_kda(*args, safe_gate=True, **kw)
    fla = lambda: fla_kda.chunk_kda(*args, safe_gate=True, **kw)
    with torch.inference_mode():
        o1, s1 = ours()
        o2, s2 = fla()
        err_o, err_s = rms_ratio(o1, o2), rms_ratio(s1, s2)
        finite = bool(torch.isfinite(o1).all() and torch.isfinite(s1).all())
        if not finite or err_o > 1e-2 or err_s > 1e-2:
            raise SystemExit(f"correctness gate failed on {case.name}: finite={finite} "
                             f"rms(o)={err_o:.2e} rms(state)={err_s:.2e} vs fla")
        del o1, s1, o2, s2
        t_fla = time_fn(fla, device=device, warmup=3, rep=rep)
        t_ours = time_fn(ours, device=device, warmup=3, rep=rep)
        mem_fla, mem_ours = peak_extra_mib(fla, device), peak_extra_mib(ours, device)
        stages = stage_times(x, device, rep)
    floor_ms = hbm_bytes(case) / bw * 1e3
    return Row(case.name, "fla 0.6.0 chunk_kda (Triton)", t_fla.median_ms, t_ours.median_ms,
               params=dict(H=case.H, D=case.D, T=case.T, lengths=list(case.lengths), varlen=case.varlen,
                           dtype="bf16", gate="bounded lower_bound=-5 safe_gate"),
               extra={**_extra(t_ours, mem_fla, mem_ours, floor_ms, err_o), **stages})


def run_decode(case: Case, device: str, bw: float, rep: int) -> Row:
    import fla.ops.kda as fla_kda
    import torch

    import flashkda

    x = make_inputs(case, device)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(FLAGS, initial_state=x["initial_state"], A_log=x["A_log"], dt_bias=x["dt_bias"])
    ours = lambda: flashkda.fused_recurrent_kda(*args, **kw)
    fla = lambda: fla_kda.fused_recurrent_kda(*args, **kw)
    with torch.inference_mode():
        (o1, s1), (o2, s2) = ours(), fla()
        err_o, err_s = rms_ratio(o1, o2), rms_ratio(s1, s2)
        if err_o > 1e-2 or err_s > 1e-2:
            raise SystemExit(f"correctness gate failed on {case.name}: rms(o)={err_o:.2e} rms(state)={err_s:.2e}")
        t_fla = time_fn(fla, device=device, warmup=5, rep=rep)
        t_ours = time_fn(ours, device=device, warmup=5, rep=rep)
        mem_fla, mem_ours = peak_extra_mib(fla, device), peak_extra_mib(ours, device)
    floor_ms = hbm_bytes(case) / bw * 1e3
    return Row(case.name, "fla 0.6.0 fused_recurrent_kda", t_fla.median_ms, t_ours.median_ms,
               params=dict(H=case.H, D=case.D, B=len(case.lengths), T=1, dtype="bf16", gate="bounded lower_bound=-5"),
               extra=_extra(t_ours, mem_fla, mem_ours, floor_ms, err_o))


def fp64_gate(device: str) -> None:
    """Ours against the fp64 oracle on a small varlen GVA case with the benchmark's flags, before any timing."""
    import torch

    import flashkda
    from flashkda import reference

    gen = torch.Generator(device=device).manual_seed(1)
    H, HV, D, T = 2, 4, 128, 700
    rn = lambda *s: torch.randn(*s, generator=gen, device=device)
    q, k = rn(1, T, H, D).bfloat16(), rn(1, T, H, D).bfloat16()
    v, g, beta = rn(1, T, HV, D).bfloat16(), rn(1, T, HV, D).bfloat16(), rn(1, T, HV).bfloat16()
    A_log, dt_bias, h0 = torch.zeros(HV, device=device), rn(HV * D), rn(3, HV, D, D) * 0.1
    cu = torch.tensor([0, 300, 300, T], device=device)
    kw = dict(FLAGS, initial_state=h0, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)
    with torch.inference_mode():
        o, s = flashkda.chunk_kda(q, k, v, g, beta, safe_gate=True, **kw)
        ro, rs = reference.chunk_kda_reference(q, k, v, g, beta, **kw)
    eo, es = rms_ratio(o, ro), rms_ratio(s, rs)
    print(f"fp64 gate: rms(o)={eo:.2e} rms(state)={es:.2e} (limit 5e-3)")
    if eo > 5e-3 or es > 5e-3:
        raise SystemExit("correctness gate failed against the fp64 reference")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, module in (("--train", "train"), ("--calibrate", "calibrate"), ("--dispatch", "dispatch_bench"),
                         ("--decode", "decode"), ("--host", "host")):
        if flag in argv:  # `k3infra bench kda --train | --calibrate | --dispatch | --decode | --host`
            import importlib

            return importlib.import_module(f"benchmarks.kda.{module}").main([a for a in argv if a != flag])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="run the forward+backward benchmark instead")
    parser.add_argument("--calibrate", action="store_true", help="time every backend per shape class (dispatch table)")
    parser.add_argument("--dispatch", action="store_true", help="fla's chunk_kda with the FlashKDA hook on vs off")
    parser.add_argument("--decode", action="store_true", help="decode tokens/s vs fla's fused_recurrent_kda")
    parser.add_argument("--host", action="store_true", help="host time per call of every backend (short calls)")
    parser.add_argument("--cases", nargs="*", default=None, help=f"subset of {sorted(CASES)}")
    parser.add_argument("--rep", type=int, default=20, help="timed calls per row and side (default 20)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results JSON")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("kda benchmark needs a CUDA device; nothing timed", file=sys.stderr)
        return 1
    device = "cuda"
    info = machine_info()
    print(machine_line(info))
    fp64_gate(device)
    bw = copy_bandwidth(device)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (used for the HBM floor)")
    cases = [CASES[n] for n in args.cases] if args.cases else PREFILL[:3] + DECODE + PREFILL[3:]
    rows = []
    for case in track(cases, "kda cases"):
        t0 = time.time()
        row = (run_decode if case.decode else run_prefill)(case, device, bw, args.rep)
        rows.append(row)
        print(f"{row.case:>18}: fla {row.baseline_ms:8.3f} ms  ours {row.ours_ms:8.3f} ms  {row.speedup:5.2f}x  "
              f"{row.extra}  ({time.time() - t0:.0f}s)", flush=True)
        if not args.no_write:  # after every row, so a run cut short still leaves its measured rows
            _annotate(rows)
            write_results("kda", rows, title=TITLE, info=info)
    _annotate(rows)
    if not args.no_write:
        print(write_results("kda", rows, title=TITLE, info=info))
    return 0


TITLE = "kda: FlashKDA forward vs fla 0.6.0 (H200, bf16, D=128)"


def _annotate(rows: list[Row]) -> None:
    for row in rows:
        if not row.case.startswith("decode") and row.speedup is not None and row.speedup < 3:
            row.note = "misses the 3x goal (see docs/flashkda-performance.md)"
        if row.case.startswith("decode") and row.speedup is not None and row.speedup < 1:
            row.note = "slower than fla (see docs/flashkda-performance.md)"


if __name__ == "__main__":
    raise SystemExit(main())
