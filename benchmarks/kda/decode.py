"""Decode tokens/s: ``flashkda.fused_recurrent_kda`` vs fla 0.6.0's ``fused_recurrent_kda``, in one run.

One decode step per sequence (T = 1) at batch 1, 64 and 256, H = 64, K = V = 128, bf16 inputs, fp32 V-first state
read and written (as ``KimiDeltaAttention`` keeps it), K3 flags (in-kernel L2 norm, bounded gate with ``A_log`` and
``dt_bias``, beta sigmoid). Both must agree (relative RMS of o and the state <= 1e-2) before timing. Tokens/s is
batch / median step time. Writes ``benchmarks/results/kda-decode-<date>.json``.

Usage: ``python -m benchmarks.kda.decode [--batches B ...] [--rep N]``.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.harness import Row, machine_info, machine_line, rms_ratio, time_fn, write_results
from benchmarks.kda.calibrate import GATE_TOL, Shape, call, make_inputs

FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True)


def run_batch(B: int, H: int, device: str, rep: int) -> Row:
    import fla.ops.kda as fla_kda
    import torch

    import flashkda

    x, _ = make_inputs(Shape(f"decode-B{B}-H{H}", H, 1, B=B), device)
    ours = lambda: call(flashkda.fused_recurrent_kda, x, FLAGS)
    fla = lambda: call(fla_kda.fused_recurrent_kda, x, FLAGS)
    with torch.inference_mode():
        (o1, s1), (o2, s2) = ours(), fla()
        err_o, err_s = rms_ratio(o1, o2), rms_ratio(s1, s2)
        if err_o > GATE_TOL or err_s > GATE_TOL:
            raise SystemExit(f"decode gate failed at B={B}: rms(o)={err_o:.2e} rms(state)={err_s:.2e}")
        t_fla, t_ours = (time_fn(f, device=device, warmup=10, rep=rep) for f in (fla, ours))
    return Row(f"decode-B{B}-H{H}", "fla 0.6.0 fused_recurrent_kda", t_fla.median_ms, t_ours.median_ms,
               params=dict(B=B, H=H, K=128, V=128, T=1, dtype="bf16", state="fp32 V-first"),
               extra={"fla tokens/s": round(B / (t_fla.median_ms * 1e-3)),
                      "ours tokens/s": round(B / (t_ours.median_ms * 1e-3)), "rms(o) vs fla": f"{err_o:.1e}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256], help="batch sizes (sequences)")
    parser.add_argument("--heads", type=int, default=64, help="attention heads H")
    parser.add_argument("--rep", type=int, default=100, help="timed decode steps per side")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results JSON")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("the decode benchmark needs a CUDA device; nothing timed", file=sys.stderr)
        return 1
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = []
    for B in args.batches:
        row = run_batch(B, args.heads, "cuda", args.rep)
        rows.append(row)
        print(f"{row.case:>16}: fla {row.baseline_ms:.4f} ms ({row.extra['fla tokens/s']} tok/s)  ours "
              f"{row.ours_ms:.4f} ms ({row.extra['ours tokens/s']} tok/s)  {row.speedup:.2f}x", flush=True)
    if not args.no_write:
        print(write_results("kda-decode", rows, title="kda decode: fused_recurrent_kda vs fla", info=info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
