"""FlashKDA training v2 on the device: ``flashkda.bwd.v2.chunk_kda_v2`` (K1 + F2 forward, K1 + B2 + B3 backward)
checked and timed against fla 0.6.0 ``chunk_kda`` and our v1 training path (``flashkda.chunk_kda`` with
``FLASHKDA_KERNELS=v1``).

Stages, each guarded so that one failure does not stop the others, inside ``--budget`` seconds (a watchdog writes
what was measured and exits when a kernel hangs past it):

1. ``pytest -m gpu tests/flashkda/test_bwd_v2_train.py tests/flashkda/test_bwd_v2_local.py`` (the entry's
   gradients against fp64 autograd through ``flashkda.reference``, B3 against the emulation, at small shapes) in a
   child process with a time limit (at most 150 s);
2. per row (H64 T8192, H64 varlen 1k x 8, B8 T4096 H32, B1 T32768 H32 at K = V = 128, and H64 T8192 at
   K = V = 64 (chunk 16 only); bf16, in-kernel L2 norm,
   ``lower_bound=-5`` with ``A_log``/``dt_bias``, beta sigmoid, fp32 initial and final state, gradients of every
   input): the gradients of ours-v2 (chunk 16 and 32) and of v1 against fla's (relative RMS per
   tensor), the median ms of fwd+bwd of the four, of the forward alone (v2, fla), of v2's kernels one by one (F1 =
   K1, F2, B2, and B3 in the forms of ``--b3-forms``, each form's gradients against the first's and the split's
   B3a and B3b apart (torch profiler); the backward is K1 + B2 + B3), and the peak extra memory of each fwd+bwd
   step.

Results: ``benchmarks/results/kda-v2-train-<date>.json`` (``benchmarks.harness.write_results``), a log on stdout.

Usage: ``python -m benchmarks.kda.v2_train_check [--budget 500] [--rows NAME ...] [--rep 10] [--skip-pytest]
[--b3-forms FORM ...] [--no-write] [--dry-run]``; ``--dry-run`` runs on a CPU: imports, rows, and one fwd+bwd of the
entry at a reduced size through `flashkda.bwd.v2.train.emulated_stages` (the emulation of K1, F2, B2 and the Triton
B3 under the interpreter) against fp64 autograd, and the results file (to a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import sys

if "--dry-run" in sys.argv:  # B3 (Triton) runs in the interpreter on a CPU: set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import Row, rms_ratio, time_fn  # noqa: E402
from benchmarks.kda.calibrate import VARLEN_EVEN, Shape, _fixed, _varlen, make_inputs  # noqa: E402
from benchmarks.kda.v2_check import (  # noqa: E402
    FLAGS,
    Impls,
    fla_style,
    gpu_tests_row,
    guarded,
    log,
    pick_rows,
    start_device_run,
    write_dry_run_results,
    write_rows,
)

COMPONENT = "kda-v2-train"
#: The training bar's rows; rows with the same head count adjacent (fla autotunes per head count).
ROWS = (_fixed(64, 8192), _varlen(64, VARLEN_EVEN, "1kx8"), _fixed(32, 4096, B=8), _fixed(32, 32768),
        Shape("H64-T8192-K64", 64, 8192, D=64))
TEST_FILES = ["tests/flashkda/test_bwd_v2_train.py", "tests/flashkda/test_bwd_v2_local.py"]
GRACE_S = 10.0
LEAVES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
GRAD_TOL = 1e-2
FLA = "fla 0.6.0 chunk_kda fwd+bwd"
#: B3's launch forms (`local_grads_bwd` options) that ``--b3-forms`` picks from, timed per row and chunk size: B3a
#: then B3b over groups of segments within the default scratch bound, and over one group (no bound).
B3_FORMS = {
    "split": {},
    "split-one-group": dict(scratch_mb=1e6),
}
#: The forms timed by default (each is compiled per chunk size and head count: keep the list short).
B3_DEFAULT = ("split",)
#: B3's gradients (`emulate.KDAGrads` fields) compared across forms.
B3_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias")
#: The split's kernels by name (the profiler's keys): B3a, and B3b in Gluon or in Triton.
SPLIT_KERNELS = {"B3a": "kda_bwd_v2_local_state_kernel", "B3b (Gluon)": "kda_bwd_v2_k1_gluon_kernel",
                 "B3b (Triton)": "kda_bwd_v2_local_chunk_kernel"}


def v2_call(x: dict, kw: dict, chunk_size: int = 16, stages=None):
    from flashkda.bwd.v2 import chunk_kda_v2

    return chunk_kda_v2(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True,
                        kw["lower_bound"], kw.get("cu_seqlens"), x["A_log"], x["dt_bias"], chunk_size=chunk_size,
                        stages=stages)


def step(call, x: dict, kw: dict, do, dht):
    """One forward and backward into every input on fresh leaves: ``(o, final_state, grads)``."""
    import torch

    leaves = {n: x[n].detach().clone().requires_grad_() for n in LEAVES}
    o, s = call(dict(x, **leaves), kw)
    grads = torch.autograd.grad((o, s), [leaves[n] for n in LEAVES], (do, dht))
    return o, s, grads


def peak_mb(fn) -> float:
    """Peak memory above what was allocated before ``fn()``, MB."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 1e6, 1)


def kernel_ms(fn, names: dict, rep: int = 5) -> dict:
    """Mean device ms per call of ``fn`` spent in each kernel of ``names`` (label -> kernel name), from the torch
    profiler over ``rep`` calls after one warm call; kernels that did not run are left out."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rep):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    attr = next(a for a in ("self_device_time_total", "self_cuda_time_total") if events and hasattr(events[0], a))
    times = {label: sum(getattr(e, attr) for e in events if name in e.key) for label, name in names.items()}
    return {label: round(t / 1e3 / rep, 4) for label, t in times.items() if t > 0}


def stage_fns(x: dict, kw: dict, do, dht, chunk: int, b3_forms=B3_DEFAULT) -> dict:
    """v2's kernels one by one at ``chunk``-token chunks, on the same inputs (inference mode)."""
    from flashkda.bwd.v2.local_grad import local_grads_bwd
    from flashkda.bwd.v2.recurrence_train import DEFAULT_EVERY, recurrence_train
    from flashkda.bwd.v2.state_grad import state_grad_bwd
    from flashkda.bwd.v2.train import device_stages
    from flashkda.fwd.v2.workspace import cached_chunk_layout

    q = x["q"]
    every = DEFAULT_EVERY[chunk]
    scale = q.shape[-1] ** -0.5
    prepare_fwd = device_stages(chunk).prepare
    layout = cached_chunk_layout(q.shape[0], q.shape[1], kw.get("cu_seqlens"), q.device, chunk)
    args = (x["q"], x["k"], x["g"], x["beta"], scale, layout, kw["lower_bound"], x["A_log"], x["dt_bias"])
    ws = prepare_fwd(*args)
    _, _, ck, _ = recurrence_train(ws, x["v"], x["initial_state"], True, every)
    ds, _ = state_grad_bwd(ws, do, dht, True)

    def b3(**form):
        return local_grads_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, kw["lower_bound"], do, ws, ck, ds,
                               every, A_log=x["A_log"], dt_bias=x["dt_bias"], **form)

    fns = {"F1 (K1)": lambda: prepare_fwd(*args, ws=ws),
           "F2 (K2 + checkpoints)": lambda: recurrence_train(ws, x["v"], x["initial_state"], True, every),
           "B2 (dS chain)": lambda: state_grad_bwd(ws, do, dht, True)}
    fns.update({f"B3 {name}": lambda f=B3_FORMS[name]: b3(**f) for name in b3_forms})
    return fns


def row_inputs(shape: Shape, device: str) -> tuple[dict, dict, object, object]:
    """A row's inputs ``x``, call keywords (K3 flags, varlen offsets), output gradient ``do`` (bf16) and final-state
    gradient ``dht``, the same in every run."""
    import torch

    x, kw = make_inputs(shape, device)
    kw = dict(FLAGS, **{k: v for k, v in kw.items() if k.startswith("cu_seqlens")})
    gen = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device=device).bfloat16()
    dht = torch.randn(x["initial_state"].shape, generator=gen, device=device) * 0.1
    return x, kw, do, dht


def time_row(shape: Shape, impls: Impls, rep: int, device: str = "cuda", b3_forms=B3_DEFAULT) -> Row:
    """Gradients of v2 and v1 against fla's, then fwd+bwd, forward and v2's kernels timed, peak memory."""
    import torch

    x, kw, do, dht = row_inputs(shape, device)
    calls = {"v2c16": v2_call, "v2c32": lambda xx, k: v2_call(xx, k, 32),
             "fla": lambda xx, k: fla_style(impls.fla, xx, k), "v1": lambda xx, k: fla_style(impls.v1, xx, k)}
    params = dict(H=shape.H, T=shape.T, B=shape.B, lengths=shape.lengths, K=shape.D, every_tokens=128)
    extra: dict = {}
    if shape.D != 128:  # 32-token chunks train K = V = 128 only
        calls.pop("v2c32")
    ref, err = guarded(f"fla {shape.name}", step, calls["fla"], x, kw, do, dht)
    if ref is None:
        extra["fla"] = f"failed: {err}"
    for name in [n for n in ("v2c16", "v2c32", "v1") if n in calls]:
        got, err = guarded(f"{name} {shape.name}", step, calls[name], x, kw, do, dht)
        if got is None:
            extra[f"{name} grads"] = f"failed: {err}"
            calls.pop(name)
            continue
        if ref is not None:
            errs = {"o": rms_ratio(got[0], ref[0]), "final_state": rms_ratio(got[1], ref[1])}
            errs.update({f"d{n}": rms_ratio(a, b) for n, a, b in zip(LEAVES, got[2], ref[2])})
            extra[f"{name} rms vs fla"] = {n: float(f"{e:.3e}") for n, e in errs.items()}
            extra[f"{name} max rms vs fla"] = float(f"{max(errs.values()):.3e}")
        del got
    if ref is None:
        calls.pop("fla")
    del ref
    ms = {}
    for name, call in calls.items():
        t, err = guarded(f"time {name} {shape.name}", time_fn, lambda c=call: step(c, x, kw, do, dht), device=device,
                         rep=rep)
        ms[name] = None if t is None else round(t.median_ms, 4)
        extra[f"{name} fwd+bwd ms"] = ms[name] if t is not None else f"failed: {err}"
        mb, _ = guarded(f"memory {name} {shape.name}", peak_mb, lambda c=call: step(c, x, kw, do, dht))
        extra[f"{name} peak MB"] = mb
    for name in ("v2c16", "v2c32", "fla"):
        if name in calls:
            xg = dict(x, **{n: x[n].detach().clone().requires_grad_() for n in LEAVES})
            t, _ = guarded(f"time {name} fwd {shape.name}", time_fn, lambda c=calls[name], xg=xg: c(xg, kw),
                           device=device, rep=rep)
            extra[f"{name} fwd ms"] = None if t is None else round(t.median_ms, 4)
    for chunk in (16, 32):
        if f"v2c{chunk}" not in calls:
            continue
        with torch.inference_mode():
            fns, err = guarded(f"v2c{chunk} stages {shape.name}", stage_fns, x, kw, do, dht, chunk, b3_forms)
            for stage, fn in (fns or {}).items():
                t, _ = guarded(f"time {stage} c{chunk} {shape.name}", time_fn, fn, device=device, rep=rep)
                extra[f"v2c{chunk} {stage} ms"] = None if t is None else round(t.median_ms, 4)
            b3 = [n for n in (fns or {}) if n.startswith("B3 ")]
            if len(b3) > 1:  # every B3 form's gradients against the first's, on the same inputs
                first, err = guarded(f"{b3[0]} c{chunk} {shape.name}", fns[b3[0]])
                for stage in b3[1:]:
                    other, err = guarded(f"{stage} c{chunk} {shape.name}", fns[stage])
                    if first is None or other is None:
                        extra[f"v2c{chunk} {stage} rms vs {b3[0]}"] = f"failed: {err}"
                        continue
                    errs = {n: rms_ratio(getattr(other, n), getattr(first, n)) for n in B3_GRADS
                            if getattr(first, n) is not None}
                    extra[f"v2c{chunk} {stage} rms vs {b3[0]}"] = {n: float(f"{e:.3e}") for n, e in errs.items()}
                del first
            for stage in [n for n in b3 if n.startswith("B3 split")]:  # the split's kernels apart
                parts, err = guarded(f"profile {stage} c{chunk} {shape.name}", kernel_ms, fns[stage], SPLIT_KERNELS)
                for label, t in (parts or {}).items():
                    extra[f"v2c{chunk} {stage}: {label} ms"] = t
                if parts is None:
                    extra[f"v2c{chunk} {stage}: kernels"] = f"failed: {err}"
    for name in ("v2c16", "v2c32", "v1"):
        if ms.get(name) and ms.get("fla"):
            extra[f"fla / {name}"] = round(ms["fla"] / ms[name], 3)
    log(f"[time] {shape.name}: {extra}")
    bad = [n for n in ("v2c16", "v2c32") if extra.get(f"{n} max rms vs fla", 1.0) > GRAD_TOL]
    note = ("ours = chunk_kda_v2 at chunk 16 (the entry's default; v2c32 in the extra columns); v1 = "
            "flashkda.chunk_kda with FLASHKDA_KERNELS=v1" + (f"; gradients off fla's: {bad}" if bad else ""))
    return Row(shape.name, FLA, ms.get("fla"), ms.get("v2c16"), params=params, extra=extra, note=note)


def _write(results: list[Row], info: dict, no_write: bool) -> None:
    write_rows(COMPONENT, "FlashKDA training v2 fwd+bwd", results, info, no_write)


def dry_run(rows) -> int:
    """The CPU-possible parts: imports, rows, one fwd+bwd of the entry through the emulated stages at a reduced size
    against fp64 autograd, the results file."""
    import torch

    import flashkda.bwd.v2.local_grad  # noqa: F401  (B3's launcher; its kernel loads on the first call)
    from benchmarks.kda.v2_bwd_precision import autograd_grads
    from flashkda.bwd.v2.train import emulated_stages

    out = []
    for shape in rows:
        log(f"[dry-run] row {shape.name}: B={shape.B} T={shape.T} H={shape.H} lengths={shape.lengths}")
        out.append(Row(shape.name, FLA, None, None, note="dry run: not timed"))
    small = Shape("dry", 2, 60, 1, (27, 1, 0, 32))
    x, kw = make_inputs(small, "cpu")
    kw = dict(FLAGS, **{k: v for k, v in kw.items() if k.startswith("cu_seqlens")})
    do = torch.randn(x["v"].shape).bfloat16()
    dht = torch.randn(x["initial_state"].shape) * 0.1
    case = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                h0=x["initial_state"], do=do, dht=dht, cu=kw["cu_seqlens"])
    ref = autograd_grads(case, kw["lower_bound"])
    names = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", A_log="dA_log", dt_bias="ddt_bias",
                 initial_state="dh0")
    for chunk in (16, 32):
        o, s, grads = step(lambda xx, k, c=chunk: v2_call(xx, k, c, emulated_stages(c)), x, kw, do, dht)
        errs = {names[n]: rms_ratio(gr, ref[names[n]]) for n, gr in zip(LEAVES, grads)}
        ok = tuple(o.shape) == tuple(x["v"].shape) and all(e < 3e-2 for e in errs.values())
        log(f"[dry-run] chunk_kda_v2 c{chunk} (emulated K1/F2/B2, Triton B3) at H2 T60 varlen vs fp64: "
            f"{ {n: f'{e:.1e}' for n, e in errs.items()} } ok={ok}")
        if not ok:
            return 1
    write_dry_run_results(COMPONENT, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=500.0, help="seconds for the whole run (default 500)")
    parser.add_argument("--rows", nargs="*", default=None, help="row names (default all): "
                        + " ".join(s.name for s in ROWS))
    parser.add_argument("--rep", type=int, default=10, help="timed calls per implementation and row")
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--b3-forms", nargs="*", default=list(B3_DEFAULT), choices=list(B3_FORMS),
                        metavar="FORM", help="B3 forms to time per row and chunk size (default: "
                        + " ".join(B3_DEFAULT) + "; all: " + " ".join(B3_FORMS) + ")")
    parser.add_argument("--no-write", action="store_true", help="write no results JSON")
    parser.add_argument("--dry-run", action="store_true", help="CPU: imports, rows, emulated entry; no kernels")
    args = parser.parse_args(argv)
    if args.budget <= 0 or args.rep < 1:
        parser.error("--budget must be > 0 and --rep >= 1")
    rows = pick_rows(parser, ROWS, args.rows)
    if args.dry_run:
        return dry_run(rows)

    results: list[Row] = []
    started = start_device_run(args.budget, GRACE_S, lambda info: _write(results, info, args.no_write))
    if started is None:
        return 2
    budget, info = started
    import torch

    if not args.skip_pytest:
        results.append(gpu_tests_row(max(10.0, min(150.0, budget.left() - 300)), TEST_FILES))
    impls = Impls()
    if impls.missing:
        log(f"[import] missing: {impls.missing}")
    for shape in rows:
        if budget.left() < 30:
            log(f"[time] budget: {shape.name} not run ({budget.left():.0f} s left)")
            results.append(Row(shape.name, FLA, None, None, note="not run (budget)"))
            continue
        got, err = guarded(f"row {shape.name}", time_row, shape, impls, args.rep, b3_forms=args.b3_forms)
        results.append(got or Row(shape.name, FLA, None, None, note=f"failed: {err}"))
        torch.cuda.empty_cache()
    _write(results, info, args.no_write)
    log(f"done, {budget.left():.0f} s of the budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
