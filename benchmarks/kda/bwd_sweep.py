"""FlashKDA backward: launch-configuration sweep of the gated-product kernels and the state passes, for NOTES.md.

Times ``flashkda.chunk_kda`` forward + backward at a training row with the fused gate chain
(``chunk_kda_gated_dots_gates_bwd``: kernel, K slice, warps), the K-sliced ``Akk``/``Aqk`` recompute
(``chunk_kda_gated_dots``: K slice, warps) and the V block of the two state passes (``flashkda.bwd.state``: the
state recompute and the reverse pass; default: the finest split that gives 256 programs, down to 16) set to each
configuration in turn, every configuration's gradients
checked against the default's first (relative RMS <= 1e-3; a configuration that disagrees is reported, not timed).
Then the two state passes alone (``--state``), flat vs blocked kernels at forced (V block, warps, stages): the
training forward (``chunk_kda_fwd_h`` writing o and the final state), the backward's recompute (h, v_new) and the
reverse pass (``chunk_kda_bwd_dh``), on chunk-local inputs of the case's shape with bf16-caller precision, each
configuration checked against the first one's outputs the same way.
Nothing is compared with fla here (``benchmarks.kda.train`` does that) and nothing is written.

Usage: ``python -m benchmarks.kda.bwd_sweep [--case B1-T8192-H64] [--rep N] [--gates [KERNEL:]BK:WARPS ...]
[--dots BK:WARPS ...] [--bv BV ...] [--state KERNEL[:BV:WARPS:STAGES] ...]`` (CUDA only). The first entry of the
first two lists is the default; an empty list (``--gates --dots --bv``) skips those, e.g. to time the state passes
only.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.harness import time_fn
from benchmarks.kda.train import GRAD_NAMES, TRAIN_CASES, make_inputs, rms_ratio, step

#: Fused gate-chain launches: [KERNEL:]BK:WARPS, KERNEL "blocks" (default) or "rows" (the kernel before 2026-12-02).
GATES_SWEEP = ["32:2", "rows:32:4", "32:4", "32:8", "16:4", "16:2"]
DOTS_SWEEP = ["32:4", "16:4", "64:4", "32:8"]
BV_SWEEP = ["32", "64"]
#: State-pass launches: KERNEL (flat or blocked) with the launcher's defaults, or KERNEL:BV:WARPS:STAGES. At
#: B1-T8192-H64 (K = V = 128) the default V block is 32; an offline sm90 compile put 3 stages at K = 128 over the
#: H200's 227 KiB of shared memory, and 4 warps spilled in the reverse pass (BV = 32) and the forward (BV = 64).
STATE_SWEEP = ["flat", "blocked", "blocked:32:4:2", "blocked:64:8:2", "blocked:64:4:2", "blocked:32:8:2",
               "blocked:16:4:2", "flat:64:8:1", "flat:16:4:1"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="B1-T8192-H64", choices=sorted(TRAIN_CASES))
    parser.add_argument("--rep", type=int, default=10)
    parser.add_argument("--gates", nargs="*", default=GATES_SWEEP)
    parser.add_argument("--dots", nargs="*", default=DOTS_SWEEP)
    parser.add_argument("--bv", nargs="*", default=BV_SWEEP)
    parser.add_argument("--state", nargs="*", default=STATE_SWEEP, type=_state_spec,
                        help="KERNEL[:BV:WARPS:STAGES], KERNEL flat|blocked")
    parser.add_argument("--device", default="cuda", help="cpu runs the kernels in Triton's interpreter (smoke test)")
    args = parser.parse_args(argv)
    import torch
    import triton

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("the backward sweep needs a CUDA device; nothing timed", file=sys.stderr)
        return 1
    import flashkda
    from flashkda.bwd import gated_dots as gated
    from flashkda.bwd import state

    c = TRAIN_CASES[args.case]
    x, extra = make_inputs(c["B"], c["T"], c["H"], c["lengths"], device)
    N = c["B"] if c["lengths"] is None else len(c["lengths"])
    do = torch.randn(c["B"], c["T"], c["H"], 128, device=device, dtype=torch.bfloat16)
    dht = torch.randn(N, c["H"], 128, 128, device=device)
    run = lambda: step(flashkda.chunk_kda, x, extra, do, dht)  # noqa: E731
    defaults = (gated.GATES_BWD_BK, gated.GATES_BWD_WARPS, gated.GATED_DOTS_BK, gated.GATED_DOTS_WARPS)
    gates_kernel = gated.GATES_BWD_KERNEL
    ref = None
    block_v = state._block_v
    configs = [("gates", s) for s in args.gates] + [("dots", s) for s in args.dots[1:]] + [("bv", s) for s in args.bv]
    try:
        for kind, spec in configs:
            kernel = gates_kernel
            if kind == "gates":
                kernel, bk, warps = _gates_spec(spec)
            elif kind == "dots":
                bk, warps = (int(v) for v in spec.split(":"))
            else:
                bk, warps = int(spec), 0
            gated.GATES_BWD_BK, gated.GATES_BWD_WARPS, gated.GATED_DOTS_BK, gated.GATED_DOTS_WARPS = defaults
            gated.GATES_BWD_KERNEL = gates_kernel
            state._block_v = block_v
            if kind == "gates":
                gated.GATES_BWD_KERNEL = kernel
                gated.GATES_BWD_BK, gated.GATES_BWD_WARPS = bk, warps
            elif kind == "dots":
                gated.GATED_DOTS_BK, gated.GATED_DOTS_WARPS = bk, warps
            else:
                state._block_v = lambda K, V, programs, bv=bk: min(bv, triton.next_power_of_2(V))
            _, _, grads = run()
            if ref is None:
                ref = grads
            worst = max(rms_ratio(grads[n], ref[n]) for n in GRAD_NAMES)
            if worst > 1e-3:
                print(f"{args.case} {kind} {spec}: gradients differ from the default's (worst {worst:.1e}); not timed")
                continue
            t = time_fn(run, device=device, warmup=2, rep=args.rep)
            print(f"{args.case} {kind} {spec}: {t.median_ms:.2f} ms (p20-p80 {t.p20_ms:.2f}-{t.p80_ms:.2f}), "
                  f"worst diff {worst:.1e}", flush=True)
    finally:
        gated.GATES_BWD_BK, gated.GATES_BWD_WARPS, gated.GATED_DOTS_BK, gated.GATED_DOTS_WARPS = defaults
        gated.GATES_BWD_KERNEL = gates_kernel
        state._block_v = block_v
    if args.state:
        _sweep_state(args.case, args.state, args.rep, device)
    return 0


def _gates_spec(spec: str) -> tuple[str, int, int]:
    """``(kernel, BK, warps)`` of a fused gate-chain spec ``[KERNEL:]BK:WARPS`` (kernel "blocks" if omitted)."""
    parts = spec.split(":")
    if len(parts) == 2:
        parts = ["blocks", *parts]
    if len(parts) != 3 or parts[0] not in ("blocks", "rows") or not all(p.isdigit() for p in parts[1:]):
        raise SystemExit(f"--gates: expected [blocks|rows:]BK:WARPS, got {spec!r}")
    return parts[0], int(parts[1]), int(parts[2])


def _state_spec(spec: str) -> str:
    _state_launch(spec)  # argparse reports the ValueError
    return spec


def _state_launch(spec: str) -> dict:
    kernel, *cfg = spec.split(":")
    if kernel not in ("flat", "blocked") or len(cfg) not in (0, 3):
        raise ValueError(f"--state: expected KERNEL or KERNEL:BV:WARPS:STAGES with KERNEL flat|blocked, got {spec!r}")
    bv, warps, stages = (int(x) for x in cfg) if cfg else (None, None, None)
    return dict(blocked=kernel == "blocked", block_v=bv, num_warps=warps, num_stages=stages)


def _sweep_state(case: str, specs: list[str], rep: int, device: str, D: int = 128) -> None:
    """Times the training state passes alone at each launch in ``specs`` (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from flashkda.bwd.layout import make_layout, to_chunks
    from flashkda.bwd.local import chunk_local_prepare
    from flashkda.bwd.state import chunk_kda_bwd_dh, chunk_kda_fwd_h

    launches = {spec: _state_launch(spec) for spec in specs}
    c = TRAIN_CASES[case]
    B, T, H = c["B"], c["T"], c["H"]
    cu = None if c["lengths"] is None else torch.tensor([0, *torch.tensor(c["lengths"]).cumsum(0).tolist()])
    layout = make_layout(B if cu is None else 1, T if cu is None else int(cu[-1]), cu, 64, torch.device(device))
    gen = torch.Generator(device=device).manual_seed(0)

    def chunks(x):
        return to_chunks(x.reshape(B if cu is None else 1, -1, H, x.shape[-1]), layout)

    def rn(*shape):
        return torch.randn(B * T, H, *shape, generator=gen, device=device)

    N = layout.chunk_offsets.numel() - 1
    # a bf16 caller's precision; exact fp32 on the interpreter (smoke test), whose bf16 products are wrong
    prec = "tf32" if device == "cuda" else "ieee"
    with torch.no_grad():
        q, k = chunks(F.normalize(rn(D), dim=-1)), chunks(F.normalize(rn(D), dim=-1))
        g = chunks(F.logsigmoid(rn(D) + 4.0))
        local = chunk_local_prepare(q, k, chunks(rn(D)), g, chunks(torch.sigmoid(rn(1)))[..., 0], D**-0.5,
                                    dot_precision=prec)
        del q, k, g
        h0 = torch.randn(N, H, D, D, generator=gen, device=device) * 0.1
        do = torch.randn(layout.num_chunks, H, 64, D, generator=gen, device=device)
        dht = torch.randn(N, H, D, D, generator=gen, device=device)
    state_in = (local.w, local.u, local.qg, local.aqk, local.kend, local.dec, h0, layout.chunk_offsets)
    dh_in = (local.qg, local.aqk, local.kend, local.dec, local.w, do, dht, layout.chunk_offsets)
    passes = {
        "fwd_h(o)": lambda kw: chunk_kda_fwd_h(*state_in, store_o=True, store_h=False, store_final_state=True,
                                               dot_precision=prec, **kw),
        "fwd_h(h)": lambda kw: chunk_kda_fwd_h(*state_in, store_o=False, store_h=True, store_final_state=False,
                                               dot_precision=prec, **kw),
        "bwd_dh": lambda kw: chunk_kda_bwd_dh(*dh_in, store_dh0=True, dot_precision=prec, **kw),
    }
    ref = {}
    for spec, kw in launches.items():
        line = []
        for name, run in passes.items():
            try:
                out = [x for x in run(kw) if x is not None]
            except Exception as e:  # e.g. out of shared memory: report and go on
                line.append(f"{name} failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                continue
            worst = max(rms_ratio(x, r) for x, r in zip(out, ref.setdefault(name, out)))
            if worst > 1e-3:
                line.append(f"{name} differs from {specs[0]}'s (worst {worst:.1e}), not timed")
                continue
            t = time_fn(lambda run=run, kw=kw: run(kw), device=device, warmup=2, rep=rep)
            line.append(f"{name} {t.median_ms:.3f} ms ({t.p20_ms:.3f}-{t.p80_ms:.3f})")
        print(f"{case} state {spec}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
