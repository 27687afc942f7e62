"""FlashKDA forward: launch-configuration sweep of our two stages, for benchmarks/kda/NOTES.md.

Times the intra-chunk stage at every (warps, maxnreg, pass-2 slice) configuration and the state + output stage at every
(V tile, warps, pipeline stages) configuration, each checked against the
default configuration's outputs first (a variant that disagrees is reported, not timed). Nothing here is a
comparison with fla: ``benchmarks.kda.run`` does that.

The intra stage leaves the blocks of ``Aqk`` above the diagonal unwritten (the state stage never reads them), so
its outputs are compared where they are defined; the whole-buffer difference is printed too, because a comparison
of the whole buffer reads whatever the allocator left there.

Usage: ``python -m benchmarks.kda.variants [--cases H64-T8192 ...] [--rep N] [--intra WARPS:MAXNREG:SLICE ...]
[--state BV:WARPS:STAGES ...]`` (CUDA only). The first configuration of each list is the reference.
"""

from __future__ import annotations

import argparse
import sys
import time

#: State-stage configurations swept by default: (V tile, warps, pipeline stages).
STATE_SWEEP = ["32:4:1", "64:8:1", "16:4:1", "64:4:1", "32:8:1", "32:4:2"]
#: Intra-stage configurations swept by default: (warps, register cap or 0, pass-2 slice width).
INTRA_SWEEP = ["4:0:16", "4:0:64", "4:0:32", "4:168:16", "4:128:16", "8:0:16"]


def defined_region(Aqk, BT: int = 64, BC: int = 16):
    """``Aqk`` ``[B, T, HV, BT]`` with the entries the kernel never writes (blocks above the diagonal) zeroed."""
    import torch

    o_t = torch.arange(Aqk.shape[1], device=Aqk.device) % BT
    o_c = torch.arange(BT, device=Aqk.device)
    written = (o_c[None, :] // BC <= o_t[:, None] // BC)  # [T, BT]
    return torch.where(written[None, :, None, :], Aqk, torch.zeros((), dtype=Aqk.dtype, device=Aqk.device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["H64-T8192"])
    parser.add_argument("--rep", type=int, default=20)
    parser.add_argument("--intra", nargs="*", default=INTRA_SWEEP)
    parser.add_argument("--state", nargs="*", default=STATE_SWEEP)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("variants needs a CUDA device", file=sys.stderr)
        return 1
    for name in args.cases:
        sweep_case(name, args)
        torch.cuda.empty_cache()  # the case's inputs are gone with sweep_case's frame
    return 0


def sweep_case(name: str, args) -> None:
    import torch

    from benchmarks.harness import time_fn
    from benchmarks.kda.registry import CASES
    from benchmarks.kda.run import make_inputs
    from flashkda.chunk_fwd import dot_precision_for, work_dtype_for
    from flashkda.chunk_intra import CHUNK_SIZE, chunk_kda_fwd_intra
    from flashkda.chunk_state import chunk_kda_fwd_state_o
    from flashkda.index import build_chunk_index

    print(f"--- {name}", flush=True)
    x = make_inputs(CASES[name], "cuda")
    q = x["q"]
    index = build_chunk_index(q.shape[0], q.shape[1], x.get("cu_seqlens"), CHUNK_SIZE)
    prec = dot_precision_for(q.dtype)

    def intra(spec):
        num_warps, maxnreg, solve_slice = (int(p) for p in spec.split(":"))
        return chunk_kda_fwd_intra(q, x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                   q.shape[-1] ** -0.5, -5.0, True, True, True, False, True, index,
                                   work_dtype_for(q.dtype), prec, num_warps=num_warps, maxnreg=maxnreg or None,
                                   solve_slice=solve_slice)

    def rel(a, b):
        a, b = a.double(), b.double()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    def rel_defined(out, ref):
        return max(rel(defined_region(a) if i == 4 else a, defined_region(b) if i == 4 else b)
                   for i, (a, b) in enumerate(zip(out, ref)))

    with torch.inference_mode():
        ref = intra(args.intra[0])
        for spec in args.intra:
            t0 = time.time()
            try:
                out = intra(spec)
                err, err_all = rel_defined(out, ref), max(rel(a, b) for a, b in zip(out, ref))
                if err > 1e-3:
                    print(f"intra warps:maxnreg:slice={spec}: DISAGREES rel {err:.1e} (whole buffers {err_all:.1e})",
                          flush=True)
                    continue
                t = time_fn(lambda spec=spec: intra(spec), device="cuda", rep=args.rep)
                print(f"intra warps:maxnreg:slice={spec}: {t.median_ms:.3f} ms (p20-p80 {t.p20_ms:.3f}-"
                      f"{t.p80_ms:.3f}; rel {err:.1e}, whole buffers incl. unwritten Aqk blocks {err_all:.1e}; "
                      f"{time.time() - t0:.0f}s)", flush=True)
            except Exception as exc:  # a configuration that does not compile or launch is reported, not fatal
                print(f"intra {spec}: FAILED {type(exc).__name__}: {exc}"[:400], flush=True)
        o_ref = chunk_kda_fwd_state_o(*ref, x["initial_state"], True, False, index, q.dtype, prec, block_v=32)[0]
        for spec in args.state:
            bv, nw, ns = (int(p) for p in spec.split(":"))
            t0 = time.time()
            try:
                state = lambda bv=bv, nw=nw, ns=ns: chunk_kda_fwd_state_o(
                    *ref, x["initial_state"], True, False, index, q.dtype, prec, block_v=bv, num_warps=nw,
                    num_stages=ns)
                err = rel(state()[0], o_ref)
                if err > 1e-3:
                    print(f"state {spec}: DISAGREES rel {err:.1e}", flush=True)
                    continue
                t = time_fn(state, device="cuda", rep=args.rep)
                print(f"state BV:warps:stages={spec}: {t.median_ms:.3f} ms (rel {err:.1e}; "
                      f"{time.time() - t0:.0f}s)", flush=True)
            except Exception as exc:
                print(f"state {spec}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
