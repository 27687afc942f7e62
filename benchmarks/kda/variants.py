"""FlashKDA forward: launch-configuration sweep of our two stages on one row, for benchmarks/kda/NOTES.md.

Times the intra-chunk stage at every (num_warps, maxnreg) pair and the state + output stage at every V tile, each
checked against the default configuration's outputs first (a variant that disagrees is reported, not timed).
Nothing here is a comparison with fla: ``benchmarks.kda.run`` does that.

Usage: ``python -m benchmarks.kda.variants [--case H64-T8192] [--rep N]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="H64-T8192")
    parser.add_argument("--rep", type=int, default=20)
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--maxnreg", type=int, nargs="*", default=[0, 128, 168])
    parser.add_argument("--block-v", type=int, nargs="*", default=[16, 32, 64])
    args = parser.parse_args(argv)
    import torch

    from benchmarks.harness import time_fn
    from benchmarks.kda.registry import CASES
    from benchmarks.kda.run import make_inputs
    from flashkda.chunk_fwd import dot_precision_for, work_dtype_for
    from flashkda.chunk_intra import CHUNK_SIZE, chunk_kda_fwd_intra
    from flashkda.chunk_state import chunk_kda_fwd_state_o
    from flashkda.index import build_chunk_index

    if not torch.cuda.is_available():
        print("variants needs a CUDA device", file=sys.stderr)
        return 1
    x = make_inputs(CASES[args.case], "cuda")
    q = x["q"]
    index = build_chunk_index(q.shape[0], q.shape[1], x.get("cu_seqlens"), CHUNK_SIZE)
    prec = dot_precision_for(q.dtype)

    def intra(num_warps=4, maxnreg=None):
        return chunk_kda_fwd_intra(q, x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                   q.shape[-1] ** -0.5, -5.0, True, True, True, False, True, index,
                                   work_dtype_for(q.dtype), prec, num_warps=num_warps, maxnreg=maxnreg)

    def rel(a, b):
        a, b = a.double(), b.double()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    with torch.inference_mode():
        ref = intra()
        for warps in args.warps:
            for cap in args.maxnreg:
                t0 = time.time()
                try:
                    out = intra(warps, cap or None)
                    err = max(rel(a, b) for a, b in zip(out, ref))
                    if err > 1e-3:
                        print(f"intra warps={warps} maxnreg={cap}: DISAGREES rel {err:.1e}", flush=True)
                        continue
                    t = time_fn(lambda: intra(warps, cap or None), device="cuda", rep=args.rep)
                    print(f"intra warps={warps} maxnreg={cap}: {t.median_ms:.3f} ms "
                          f"(p20-p80 {t.p20_ms:.3f}-{t.p80_ms:.3f}; rel {err:.1e}; {time.time() - t0:.0f}s)",
                          flush=True)
                except Exception as exc:  # a configuration that does not compile or launch is reported, not fatal
                    print(f"intra warps={warps} maxnreg={cap}: FAILED {type(exc).__name__}: {exc}"[:400], flush=True)
        o_ref = chunk_kda_fwd_state_o(*ref, x["initial_state"], True, False, index, q.dtype, prec)[0]
        for bv in args.block_v:
            try:
                state = lambda: chunk_kda_fwd_state_o(*ref, x["initial_state"], True, False, index, q.dtype, prec,
                                                      block_v=bv)
                err = rel(state()[0], o_ref)
                t = time_fn(state, device="cuda", rep=args.rep)
                print(f"state block_v={bv}: {t.median_ms:.3f} ms (rel {err:.1e})", flush=True)
            except Exception as exc:
                print(f"state block_v={bv}: FAILED {type(exc).__name__}: {exc}"[:400], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
