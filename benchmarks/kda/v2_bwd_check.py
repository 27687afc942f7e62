"""FlashKDA backward v2 kernels on the device, in one run: F2 (K2 with the training checkpoint stores) and B2 (the
state-gradient chain), their gpu tests, their errors against the emulation at full size, and their times.

Stages, each guarded so that one failure does not stop the others, all inside ``--budget`` seconds (a watchdog
writes what was measured and exits when a kernel hangs past it):

1. ``pytest -m gpu tests/flashkda/test_bwd_v2_gpu.py`` in a child process with a time limit;
2. per row (H64 T8192 and H32 T32768 at chunk 32, H64 varlen 1k x 8 at chunk 16, as the forward v2 serves them):
   K1's workspace (the emulated one when K1 fails), then F2's checkpoints and B2's ``ds``/``dh0`` against the
   emulation on that workspace (relative RMS), then medians of CUDA events of K2, F2 (the checkpoint stores'
   overhead is F2 - K2), B2 (ring of 2 and 3 slots), and, as context, fla 0.6.0 ``chunk_kda``'s whole backward
   and fwd+bwd on the same inputs (B2 is one stage of our backward: the numbers are not a speedup).

Results: ``benchmarks/results/kda-v2-bwd-<date>.json`` (``benchmarks.harness.write_results``), a log on stdout.

Usage: ``python -m benchmarks.kda.v2_bwd_check [--budget 150] [--rows NAME ...] [--rep 10] [--skip-pytest]
[--no-write] [--dry-run]``; ``--dry-run`` runs on a CPU: arguments, rows, inputs, the emulation of F2 and B2 at
reduced sizes and the results file (to a temporary folder), no kernel.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.harness import Row, rms_ratio, time_fn
from benchmarks.kda.calibrate import VARLEN_EVEN, Shape, _fixed, _varlen, make_inputs
from benchmarks.kda.v2_check import (
    FLAGS,
    Impls,
    fla_style,
    gpu_tests_row,
    guarded,
    k1_call,
    log,
    pick_rows,
    start_device_run,
    write_dry_run_results,
    write_rows,
)

COMPONENT = "kda-v2-bwd"
#: (row, chunk size): the forward v2's choice (32 fixed length, 16 varlen).
ROWS = ((_fixed(64, 8192), 32), (_fixed(32, 32768), 32), (_varlen(64, VARLEN_EVEN, "1kx8"), 16))
TEST_FILE = "tests/flashkda/test_bwd_v2_gpu.py"
GRACE_S = 10.0
FLA = "fla 0.6.0 chunk_kda backward (whole, context)"


def workspace_for(x: dict, kw: dict, chunk: int, use_kernel: bool):
    """``(ws, source)``: K1's workspace of ``chunk``-token chunks, or the emulated one (``use_kernel=False`` or K1
    failing)."""
    from flashkda.fwd.v2.emulate import emulate_prepare
    from flashkda.fwd.v2.emulate32 import emulate_prepare32
    from flashkda.fwd.v2.workspace import build_chunk_layout

    q = x["q"]
    layout = build_chunk_layout(q.shape[0], q.shape[1], kw.get("cu_seqlens"), q.device, chunk)
    if use_kernel:
        from flashkda.fwd.v2.prepare import prepare_fwd
        from flashkda.fwd.v2.prepare32 import prepare32_fwd

        ws, err = guarded(f"k1 c{chunk}", k1_call, prepare_fwd if chunk == 16 else prepare32_fwd, x, kw, layout)
        if ws is not None:
            return ws, "k1"
    emulate = emulate_prepare if chunk == 16 else emulate_prepare32
    return k1_call(emulate, x, kw, layout), "emulate"


def emulation_errors(ws, x: dict, do, dht, ck, ds, dh0, every: int) -> dict:
    """F2's checkpoints and B2's ``ds``/``dh0`` against the emulation on the same workspace (relative RMS)."""
    from flashkda.bwd.v2.checkpoints import emulate_recurrence_train
    from flashkda.bwd.v2.emulate import emulate_state_grads

    _, _, rck = emulate_recurrence_train(ws, x["v"], x["initial_state"], every)
    rds, rdh0 = emulate_state_grads(ws, do, dht)
    used = int(ws.layout.seq_chunks[-1])
    return {"rms(checkpoints) vs emulate": float(f"{rms_ratio(ck[:rck.shape[0]].float(), rck.float()):.3e}"),
            "rms(ds) vs emulate": float(f"{rms_ratio(ds[:used].float(), rds[:used]):.3e}"),
            "rms(dh0) vs emulate": float(f"{rms_ratio(dh0, rdh0):.3e}")}


def fla_times(x: dict, kw: dict, do, dht, rep: int, device: str) -> dict:
    """Medians of fla 0.6.0 ``chunk_kda``'s backward alone (a retained graph) and of its fwd+bwd, same inputs."""
    import torch

    fla = Impls._fla()
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    xg = dict(x, **leaves)

    def fwd_bwd():
        o, s = fla_style(fla, xg, kw)
        return torch.autograd.grad((o, s), list(leaves.values()), (do, dht))

    o, s = fla_style(fla, xg, kw)
    bwd = time_fn(lambda: torch.autograd.grad((o, s), list(leaves.values()), (do, dht), retain_graph=True),
                  device=device, rep=rep)
    both = time_fn(fwd_bwd, device=device, rep=rep)
    return {"fla bwd ms": round(bwd.median_ms, 4), "fla fwd+bwd ms": round(both.median_ms, 4)}


def time_row(shape: Shape, chunk: int, rep: int, check: bool, device: str = "cuda") -> list[Row]:
    """Errors vs the emulation, then K2, F2, B2 and fla's backward on one row."""
    import torch

    from flashkda.bwd.v2.recurrence_train import DEFAULT_EVERY, recurrence_train
    from flashkda.bwd.v2.state_grad import state_grad_bwd
    from flashkda.fwd.v2.recurrence import recurrence_fwd
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    x, kw = make_inputs(shape, device)
    kw = dict(FLAGS, **{k: v for k, v in kw.items() if k.startswith("cu_seqlens")})
    gen = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device=device).bfloat16()
    dht = torch.randn(x["initial_state"].shape, generator=gen, device=device) * 0.1
    every = DEFAULT_EVERY[chunk]
    params = dict(H=shape.H, T=shape.T, B=shape.B, lengths=shape.lengths, chunk=chunk, every=every)
    with torch.inference_mode():
        ws, source = workspace_for(x, kw, chunk, use_kernel=True)
        k2 = recurrence_fwd if chunk == 16 else recurrence32_fwd
        runs = {"k2": lambda: k2(ws, x["v"], x["initial_state"], True),
                "f2": lambda: recurrence_train(ws, x["v"], x["initial_state"], True, every),
                "b2": lambda: state_grad_bwd(ws, do, dht, True),
                "b2 stages3": lambda: state_grad_bwd(ws, do, dht, True, stages=3)}
        extra: dict = {"workspace": source}
        if check:
            _, _, ck, _ = runs["f2"]()
            ds, dh0 = runs["b2"]()
            errs, err = guarded(f"errors {shape.name}", emulation_errors, ws, x, do, dht, ck, ds, dh0, every)
            extra.update(errs or {"errors": f"failed: {err}"})
            extra["checkpoints MB"] = round(ck.numel() * ck.element_size() / 1e6, 1)
            del ck, ds, dh0
        ms = {}
        for name, fn in runs.items():
            t, err = guarded(f"time {name} {shape.name}", time_fn, fn, device=device, rep=rep)
            ms[name] = None if t is None else round(t.median_ms, 4)
            extra[f"{name} ms"] = ms[name] if t is not None else f"failed: {err}"
    got, err = guarded(f"fla {shape.name}", fla_times, x, kw, do, dht, rep, device)
    extra.update(got or {"fla bwd ms": None, "fla fwd+bwd ms": None, "fla": f"failed: {err}"})
    if ms["k2"] and ms["f2"]:
        extra["checkpoint overhead ms"] = round(ms["f2"] - ms["k2"], 4)
    log(f"[time] {shape.name} c{chunk}: {extra}")
    f2_row = Row(f"{shape.name} c{chunk} F2", "K2 without checkpoints (same run)", ms["k2"], ms["f2"],
                 params=params, extra=extra, note="F2 = K2 + checkpoint stores: baseline/ours below 1 by their cost")
    b2_row = Row(f"{shape.name} c{chunk} B2", FLA, extra["fla bwd ms"], None, params=params,
                 extra={"b2 ms": ms["b2"], "b2 stages3 ms": ms["b2 stages3"], "k2 ms": ms["k2"],
                        "fla fwd+bwd ms": extra["fla fwd+bwd ms"]},
                 note="B2 is one stage of the v2 backward (the state-gradient chain); fla's whole backward is context")
    return [f2_row, b2_row]


def _write(results: list[Row], info: dict, no_write: bool) -> None:
    write_rows(COMPONENT, "FlashKDA backward v2 kernels (H200)", results, info, no_write)


def dry_run(rows) -> int:
    """The CPU-possible parts: rows, inputs, the emulation of F2 and B2 at reduced sizes, the results file."""
    import torch

    from flashkda.bwd.v2.checkpoints import checkpoint_bound, checkpoint_offsets, emulate_recurrence_train
    from flashkda.bwd.v2.emulate import emulate_state_grads
    from flashkda.bwd.v2.recurrence_train import DEFAULT_EVERY

    out = []
    for shape, chunk in rows:
        small = (Shape(shape.name, 2, 256, shape.B) if shape.lengths is None
                 else Shape(shape.name, 2, 256, 1, (100, 0, 37, 119)))
        x, kw = make_inputs(small, "cpu")
        kw = dict(FLAGS, **{k: v for k, v in kw.items() if k.startswith("cu_seqlens")})
        ws, source = workspace_for(x, kw, chunk, use_kernel=False)
        every = DEFAULT_EVERY[chunk]
        o, s, ck = emulate_recurrence_train(ws, x["v"], x["initial_state"], every)
        do = torch.randn(x["v"].shape).bfloat16()
        ds, dh0 = emulate_state_grads(ws, do, x["initial_state"] * 0.5)
        n = int(checkpoint_offsets(ws.layout, every)[-1])
        # the device run's comparison, here of the emulation with itself (every error must be 0)
        errs = emulation_errors(ws, x, do, x["initial_state"] * 0.5, ck, ds.bfloat16(), dh0, every)
        ok = (ck.shape[0] == n <= checkpoint_bound(ws.layout, every) and not any(errs.values())
              and all(bool(torch.isfinite(t.float()).all()) for t in (o, s, ck, ds, dh0)))
        log(f"[dry-run] {shape.name} c{chunk} (run at H2 T256{' varlen' if shape.lengths else ''}): "
            f"checkpoints {tuple(ck.shape)} ds {tuple(ds.shape)} {errs} ok={ok}")
        if not ok:
            return 1
        out.append(Row(f"{shape.name} c{chunk}", FLA, None, None, params=dict(chunk=chunk, every=every),
                       note="dry run: emulation only"))
    write_dry_run_results(COMPONENT, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the whole run (default 150)")
    parser.add_argument("--rows", nargs="*", default=None,
                        help="row names (default all): " + " ".join(s.name for s, _ in ROWS))
    parser.add_argument("--rep", type=int, default=10, help="timed calls per kernel and row")
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--no-check", action="store_true", help="no emulation comparison at full size")
    parser.add_argument("--no-write", action="store_true", help="write no results JSON")
    parser.add_argument("--dry-run", action="store_true", help="CPU: rows, emulation, results file; no kernels")
    args = parser.parse_args(argv)
    if args.budget <= 0 or args.rep < 1:
        parser.error("--budget must be > 0 and --rep >= 1")
    rows = pick_rows(parser, ROWS, args.rows, name=lambda row: row[0].name)
    if args.dry_run:
        return dry_run(rows)

    results: list[Row] = []
    started = start_device_run(args.budget, GRACE_S, lambda info: _write(results, info, args.no_write))
    if started is None:
        return 2
    budget, info = started
    import torch

    if not args.skip_pytest:
        results.append(gpu_tests_row(max(10.0, min(80.0, budget.left() - 50)), [TEST_FILE]))
    for shape, chunk in rows:
        if budget.left() < 12:
            log(f"[time] budget: {shape.name} not run ({budget.left():.0f} s left)")
            results.append(Row(f"{shape.name} c{chunk}", FLA, None, None, note="not run (budget)"))
            continue
        got, err = guarded(f"row {shape.name}", time_row, shape, chunk, args.rep, not args.no_check)
        results += got or [Row(f"{shape.name} c{chunk}", FLA, None, None, note=f"failed: {err}")]
        torch.cuda.empty_cache()
    _write(results, info, args.no_write)
    log(f"done, {budget.left():.0f} s of the budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
