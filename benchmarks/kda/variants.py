"""FlashKDA forward: launch-configuration sweep of our two stages (docs/flashkda-performance.md).

Times the intra-chunk stage at every (warps, maxnreg, pass-2 slice) configuration and the state + output stage at every
(V tile, warps, pipeline stages) configuration, each checked against the
default configuration's outputs first (a variant that disagrees is reported, not timed). Nothing here is a
comparison with fla: ``benchmarks.kda.run`` does that.

The intra stage leaves the blocks of ``Aqk`` above the diagonal unwritten (the state stage never reads them), so
its outputs are compared where they are defined; the whole-buffer difference is printed too, because a comparison
of the whole buffer reads whatever the allocator left there.

The split state path is swept too: ``--hb`` the state-only pass on 64-row state tiles at per-product operand
precisions, then the parallel output kernel (autotuned). It stores states in bf16, so it is compared with the fused
stage at 5e-3 relative.

Usage: ``python -m benchmarks.kda.variants [--cases H64-T8192 ...] [--rep N]
[--intra WARPS:MAXNREG:SLICE[:PASS1_SLICE[:MERGE]] ...] [--state BV:WARPS:STAGES ...]
[--hb BV:WARPS:STAGES:PREC_WS:PREC_KV ...] [--o BV:BK:WARPS:STAGES:HILO ...]``
(CUDA only). The first
configuration of the intra and state lists is the reference (the fused defaults when a list is empty).
"""

from __future__ import annotations

import argparse
import sys
import time

#: State-stage configurations swept by default: (V tile, warps, pipeline stages).
STATE_SWEEP = ["32:4:1", "64:8:1", "16:4:1", "64:4:1", "32:8:1", "32:4:2"]
#: Intra-stage configurations swept by default: (warps, register cap or 0, pass-2 slice width).
INTRA_SWEEP = ["4:0:16", "4:0:16:0:1", "4:0:64:0:1", "4:168:16", "4:168:16:0:1", "4:128:16:0:1", "8:0:16:0:1"]
#: The blocked state pass (64-row state tiles), then the parallel output kernel: (V tile, warps, stages, operand
#: precision of w S, of kgᵀ v_new; 1 tf32, 2 hi/lo bf16, 3 bf16 as in flashkda.fwd.state).
HB_SWEEP = ["32:4:2:3:2", "64:4:2:3:2", "32:2:2:3:2", "64:2:2:3:2", "32:4:3:3:2", "64:4:3:3:2", "64:8:2:3:2",
            "64:4:2:2:2", "64:4:2:1:1", "64:4:2:3:3"]
#: The output kernel alone: (V tile, K slice, warps, stages, bf16 hi/lo products).
O_SWEEP = ["64:64:4:2:0", "64:64:4:2:1", "128:64:4:2:1", "128:64:8:2:1", "64:128:4:2:1", "32:64:4:2:1",
           "64:64:4:3:1", "64:64:4:1:1", "128:128:8:2:1", "64:64:8:2:1"]


def defined_region(Aqk, BT: int = 64, BC: int = 16):
    """``Aqk`` ``[B, T, HV, BT]`` with the entries above the diagonal zeroed: the default kernel never writes the
    blocks above the diagonal block, the small-tile path nothing above the diagonal (the state stage reads the causal
    part only). Fixed-length rows (row ``t`` is row ``t % BT`` of its chunk)."""
    import torch

    o_t = torch.arange(Aqk.shape[1], device=Aqk.device) % BT
    o_c = torch.arange(BT, device=Aqk.device)
    written = o_c[None, :] <= o_t[:, None]  # [T, BT]
    return torch.where(written[None, :, None, :], Aqk, torch.zeros((), dtype=Aqk.dtype, device=Aqk.device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["H64-T8192"])
    parser.add_argument("--rep", type=int, default=20)
    parser.add_argument("--intra", nargs="*", default=INTRA_SWEEP)
    parser.add_argument("--state", nargs="*", default=STATE_SWEEP)
    parser.add_argument("--hb", nargs="*", default=HB_SWEEP)
    parser.add_argument("--o", nargs="*", default=O_SWEEP)
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
    from flashkda.fwd.chunk_fwd import dot_precision_for, work_dtype_for
    from flashkda.fwd.intra import CHUNK_SIZE, chunk_kda_fwd_intra
    from flashkda.fwd.state import chunk_kda_fwd_state_o
    from flashkda.index import build_chunk_index

    print(f"--- {name}", flush=True)
    x = make_inputs(CASES[name], "cuda")
    q = x["q"]
    index = build_chunk_index(q.shape[0], q.shape[1], x.get("cu_seqlens"), CHUNK_SIZE)
    prec = dot_precision_for(q.dtype)

    def intra(spec):
        num_warps, maxnreg, solve_slice, *rest = (int(p) for p in spec.split(":"))
        return chunk_kda_fwd_intra(q, x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                   q.shape[-1] ** -0.5, -5.0, True, True, True, False, True, index,
                                   work_dtype_for(q.dtype), prec, num_warps=num_warps, maxnreg=maxnreg or None,
                                   solve_slice=solve_slice, pass1_slice=rest[0] if rest and rest[0] else None,
                                   merge=bool(rest[1]) if len(rest) > 1 else False)

    def rel_defined(out, ref):
        return max(rel(defined_region(a) if i == 4 else a, defined_region(b) if i == 4 else b)
                   for i, (a, b) in enumerate(zip(out, ref)))

    with torch.inference_mode():
        ref = intra(args.intra[0] if args.intra else "4:0:16")
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
        o_ref = chunk_kda_fwd_state_o(*ref, x["initial_state"], True, False, index, q.dtype, prec, block_v=32,
                                      split=False)[0]
        for spec in args.hb:
            bv, nw, ns, pws, pkv = (int(p) for p in spec.split(":"))
            t0 = time.time()
            fn = lambda bv=bv, nw=nw, ns=ns, pws=pws, pkv=pkv: chunk_kda_fwd_state_o(  # noqa: E731
                *ref, x["initial_state"], True, False, index, q.dtype, prec, block_v=bv, num_warps=nw, num_stages=ns,
                split=True, precs=(pws, pkv))
            _report(f"state blocked h BV:warps:stages:prec_ws:prec_kv={spec} + o autotuned", fn, o_ref,
                    lambda out, r: rel(out[0], r), 5e-3, args.rep, t0)
        if args.hb or args.o:  # the output kernel alone (its inputs' values do not matter for its time)
            from flashkda.fwd.output import state_output

            qg, Aqk, u = ref[2], ref[4], ref[1]
            h = torch.randn(index.num_chunks, *qg.shape[2:], u.shape[-1], device="cuda").to(torch.bfloat16)
            vn, o = torch.randn_like(u), torch.empty(u.shape, dtype=q.dtype, device="cuda")
            for hilo in (False, True):
                t = time_fn(lambda hilo=hilo: state_output(qg, Aqk, h, vn, o, index, prec, qg.shape[-1],
                                                           o_hilo=hilo), device="cuda", rep=args.rep)
                print(f"output kernel alone (autotuned, hilo={int(hilo)}): {t.median_ms:.3f} ms", flush=True)
            o_ref = torch.empty_like(o)
            state_output(qg, Aqk, h, vn, o_ref, index, prec, qg.shape[-1], o_config=(64, 64, 4), o_hilo=False)
            for spec in args.o:
                bv, bk, nw, ns, hilo = (int(p) for p in spec.split(":"))
                fn = lambda bv=bv, bk=bk, nw=nw, ns=ns, hilo=hilo: state_output(  # noqa: E731
                    qg, Aqk, h, vn, o, index, prec, qg.shape[-1], o_config=(bv, bk, nw, ns), o_hilo=bool(hilo)) or o
                _report(f"output kernel BV:BK:warps:stages:hilo={spec}", fn, o_ref, rel, 5e-3, args.rep, time.time())
        for spec in args.state:
            bv, nw, ns = (int(p) for p in spec.split(":"))
            t0 = time.time()
            try:
                state = lambda bv=bv, nw=nw, ns=ns: chunk_kda_fwd_state_o(
                    *ref, x["initial_state"], True, False, index, q.dtype, prec, block_v=bv, num_warps=nw,
                    num_stages=ns, split=False)
                err = rel(state()[0], o_ref)
                if err > 1e-3:
                    print(f"state {spec}: DISAGREES rel {err:.1e}", flush=True)
                    continue
                t = time_fn(state, device="cuda", rep=args.rep)
                print(f"state BV:warps:stages={spec}: {t.median_ms:.3f} ms (rel {err:.1e}; "
                      f"{time.time() - t0:.0f}s)", flush=True)
            except Exception as exc:
                print(f"state {spec}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _report(label, fn, ref, compare, limit, rep, t0) -> None:
    """Checks ``fn()`` against ``ref`` (``compare(out, ref) <= limit``), then times it; failures are printed."""
    from benchmarks.harness import time_fn

    try:
        err = compare(fn(), ref)
        if err > limit:
            print(f"{label}: DISAGREES rel {err:.1e}", flush=True)
            return
        t = time_fn(fn, device="cuda", rep=rep)
        print(f"{label}: {t.median_ms:.3f} ms (p20-p80 {t.p20_ms:.3f}-{t.p80_ms:.3f}; rel {err:.1e}; "
              f"{time.time() - t0:.0f}s)", flush=True)
    except Exception as exc:  # a configuration that does not compile or launch is reported, not fatal
        print(f"{label}: FAILED {type(exc).__name__}: {exc}"[:400], flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
