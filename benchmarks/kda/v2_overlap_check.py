"""FlashKDA forward v2 on the device: the K1/K2 overlap over token segments and the chunk-32 K1 register caps,
checked against fp64 and timed against fla, CUTLASS FlashKDA and the shipped default in one run.

Stages, inside ``--budget`` seconds (a watchdog writes what was measured and exits if a kernel hangs):

0. probe: every variant once on small varlen inputs in a child process (it also compiles the kernels); one that
   faults, hangs or gives NaN/inf there is dropped from the run (a device fault would end the whole process);
1. fp64: every full-forward variant below on small fixed and varlen inputs (empty, 1-token and crossing sequences)
   against ``flashkda.reference.chunk_kda_reference``; bars: output relative RMS 5e-3 (varlen 6e-3), state 1e-2,
   finite;
2. per row (``--rows``): fla and CUTLASS (the baselines), then every variant, each checked first against the
   shipped default's output and final state (relative RMS) and for NaN/inf, then timed (medians of CUDA events):

   - ``v2``: ``chunk_kda_fwd_v2`` with its defaults (the shipped arrangement: 32-token chunks fixed length, 16
     varlen, one segment);
   - ``v2 c16`` / ``v2 c32``: one segment, the chunk size forced;
   - ``v2 auto``: ``segments=None`` (``pipeline.auto_segments``);
   - ``v2 c16 P{n}`` / ``v2 c32 P{n}``: ``segments=n`` (K2 on the high-priority side stream) and ``... k1side``
     (K1 on the side stream instead);
   - ``v2 c32 P{n} wide r80`` / ``... wide r64``: the segmented chunk-32 forward with the wide K1 c32 capped at 80 /
     64 registers (room for one / two K1 CTAs beside a K2 CTA on an SM);
   - ``v2 c32 r{n}``, ``v2 c32 wide``, ``v2 c32 wide r{n}``: K1 c32 with a register cap of ``n`` / the wide
     elementwise kernel (``prepare32_fwd(wide=True)``), then K2 c32 (the ``forward_c32`` body);
   - ``k1 c16``, ``k1 c32`` (shipped), ``k1 c32 r{n}``, ``k1 c32 wide [r{n}]``, ``k1 c32 all-warps``, ``k2 c16``,
     ``k2 c32``: the kernels alone (K2 on K1's workspace).

Results: ``benchmarks/results/kda-v2-overlap-<date>.json``; a table on stdout.

Usage: ``python -m benchmarks.kda.v2_overlap_check [--budget 220] [--rows NAME ...] [--segments 2 4 8]
[--caps 96 80 64] [--rep 8] [--no-fla] [--no-write] [--dry-run]``; ``--dry-run`` runs on a CPU: rows, variants, the
auto rule per row, the segmented orchestration with the emulation standing in for the kernels against fp64, and
the results file (to a temporary folder); no kernel.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import ROOT, Row, machine_info, machine_line, rms_ratio, time_fn, write_results
from benchmarks.kda.calibrate import VARLEN_EVEN, VARLEN_MIXED, Shape, _fixed, _varlen, make_inputs
from benchmarks.kda.v2_check import (
    FLAGS,
    SMALL,
    Budget,
    child_env,
    cutlass_call,
    fla_style,
    floor_ms,
    fp64_errors,
    fp64_reference,
    guarded,
    log,
    small_inputs,
    v_first,
)

COMPONENT = "kda-v2-overlap"
ROWS = [_fixed(64, 1024), _fixed(64, 8192), _fixed(96, 8192), _fixed(96, 2048), _varlen(64, VARLEN_EVEN, "1kx8"),
        _varlen(96, VARLEN_MIXED, "mixed")]
#: SMs of the H200 (the auto rule's input in the dry run; the device run reads the device's count).
H200_SMS = 132
GRACE_S = 15.0


def v2(x: dict, kw: dict, **options):
    """``chunk_kda_fwd_v2`` on a row's inputs with ``options`` (segments, chunk_size, recurrence_on_side)."""
    from flashkda.fwd.v2 import chunk_kda_fwd_v2

    out = chunk_kda_fwd_v2(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5,
                           initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=kw["lower_bound"],
                           cu_seqlens=kw.get("cu_seqlens"), cu_seqlens_cpu=kw.get("cu_seqlens_cpu"),
                           A_log=x["A_log"], dt_bias=x["dt_bias"], **options)
    return out[0], out[1]


def layout(x: dict, kw: dict, chunk: int):
    from flashkda.fwd.v2.workspace import cached_chunk_layout

    q = x["q"]
    return cached_chunk_layout(q.shape[0], q.shape[1], kw.get("cu_seqlens"), q.device, chunk)


def k1(x: dict, kw: dict, chunk: int, **options):
    """K1 alone (``options``: ``max_registers``, ``batched`` for chunk 32); returns the workspace."""
    from flashkda.fwd.v2.prepare import prepare_fwd
    from flashkda.fwd.v2.prepare32 import prepare32_fwd

    fn = prepare_fwd if chunk == 16 else prepare32_fwd
    return fn(x["q"], x["k"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, layout(x, kw, chunk), kw["lower_bound"],
              A_log=x["A_log"], dt_bias=x["dt_bias"], **options)


def k2(ws, x: dict, chunk: int):
    from flashkda.fwd.v2.recurrence import recurrence_fwd
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    return (recurrence_fwd if chunk == 16 else recurrence32_fwd)(ws, x["v"], x["initial_state"], True)


def v2_k1c32(x: dict, kw: dict, **k1_options):
    """K1 c32 with ``k1_options`` (``max_registers``, ``wide``) then K2 c32 (the ``forward_c32`` body)."""
    return k2(k1(x, kw, 32, **k1_options), x, 32)


def v2_segmented_k1c32(x: dict, kw: dict, segments: int, **k1_options):
    """The segmented chunk-32 forward (what ``chunk_kda_fwd_v2(..., segments=P, chunk_size=32)`` runs) with K1 c32
    launched with ``k1_options``."""
    import torch

    from flashkda.fwd.v2.pipeline import cached_segment_plan, segmented_forward
    from flashkda.fwd.v2.prepare32 import prepare32_fwd

    q = x["q"]
    B, T = q.shape[:2]
    cu_cpu = kw.get("cu_seqlens_cpu")
    cu = [b * T for b in range(B + 1)] if cu_cpu is None else cu_cpu.tolist()
    plan = cached_segment_plan(B, T, None if cu_cpu is None else cu, kw.get("cu_seqlens"), segments, q.device, 32)

    def prepare(q, k, g, beta, scale, lay, lower_bound, A_log, dt_bias, ws):
        prepare32_fwd(q, k, g, beta, scale, lay, lower_bound, A_log, dt_bias, ws=ws, **k1_options)

    with torch.no_grad():
        return segmented_forward(q, x["k"], x["v"], x["g"], x["beta"], q.shape[-1] ** -0.5, kw["lower_bound"],
                                 x["A_log"], x["dt_bias"], x["initial_state"], True, cu, kw.get("cu_seqlens"), plan,
                                 prepare=prepare)


def k1c32_options(caps: list[int]) -> dict:
    """The K1 c32 configurations besides the shipped one: name suffix -> ``prepare32_fwd`` keywords."""
    out = {f" r{cap}": dict(max_registers=cap) for cap in caps}
    out[" wide"] = dict(wide=True)
    out.update({f" wide r{cap}": dict(wide=True, max_registers=cap) for cap in caps if cap < 96})
    return out


#: the K1 c32 configurations the segmented variants also run with (besides the shipped one): beside a K2 c32 CTA
#: (4 warps of 226 registers) an SM has room for one K1 CTA of 8 warps at 80 registers, two at 64
SEGMENTED_K1 = {" wide r80": dict(wide=True, max_registers=80), " wide r64": dict(wide=True, max_registers=64)}


def full_variants(segments: list[int], caps: list[int]) -> dict:
    """The full-forward variants: name -> ``fn(x, kw)`` returning ``(o, final_state)``."""
    out = {"v2": v2, "v2 c16": functools.partial(v2, chunk_size=16), "v2 c32": functools.partial(v2, chunk_size=32),
           "v2 auto": functools.partial(v2, segments=None)}
    for P in segments:
        for chunk in (32, 16):
            out[f"v2 c{chunk} P{P}"] = functools.partial(v2, chunk_size=chunk, segments=P)
        for suffix, options in SEGMENTED_K1.items():
            out[f"v2 c32 P{P}{suffix}"] = functools.partial(v2_segmented_k1c32, segments=P, **options)
    if segments:
        P = segments[len(segments) // 2]
        out[f"v2 c32 P{P} k1side"] = functools.partial(v2, chunk_size=32, segments=P, recurrence_on_side=False)
    for suffix, options in k1c32_options(caps).items():
        out[f"v2 c32{suffix}"] = functools.partial(v2_k1c32, **options)
    return out


def kernel_variants(caps: list[int]) -> dict:
    """The kernels alone: name -> ``(make(x, kw) -> state for the timed call, fn(state) -> anything)``."""
    out = {"k1 c16": (lambda x, kw: (x, kw), lambda s: k1(*s, 16)),
           "k1 c32": (lambda x, kw: (x, kw), lambda s: k1(*s, 32))}
    for suffix, options in k1c32_options(caps).items():
        out[f"k1 c32{suffix}"] = (lambda x, kw: (x, kw), lambda s, o=options: k1(*s, 32, **o))
    out["k1 c32 all-warps"] = (lambda x, kw: (x, kw), lambda s: k1(*s, 32, batched=False))
    for chunk in (16, 32):
        out[f"k2 c{chunk}"] = (lambda x, kw, chunk=chunk: (k1(x, kw, chunk), x),
                               lambda s, chunk=chunk: k2(s[0], s[1], chunk))
    return out


def all_variants(args) -> dict:
    """Every variant this run may call (the rows' and the fp64 stage's): name -> ``fn(x, kw)``."""
    out = {**full_variants([2, 3], args.caps), **full_variants(args.segments, args.caps)}
    for name, (make, fn) in kernel_variants(args.caps).items():
        out[name] = lambda x, kw, make=make, fn=fn: fn(make(x, kw))
    return out


def probe(args, names: list[str]) -> int:
    """Child process: each variant once on small varlen inputs (empty, 1-token and cut sequences); prints
    ``PROBE-OK name`` or ``PROBE-BAD name`` as it goes (a device fault ends the process: the parent sees which)."""
    import torch

    variants = all_variants(args)
    x, kw = small_inputs("cuda", (700, 0, 1, 300), 1, 1001, 2, -5.0, seed=1)
    with torch.inference_mode():
        for name in names:
            out, _ = guarded(f"probe {name}", variants[name], x, kw)
            torch.cuda.synchronize()
            if isinstance(out, tuple):
                good = all(bool(torch.isfinite(t).all()) for t in out[:2] if t is not None)
            else:  # a kernel alone: ran without an error
                good = out is not None
            print(f"PROBE-{'OK' if good else 'BAD'} {name}", flush=True)
    return 0


def run_probe(args, budget: Budget) -> set[str]:
    """The variants that ran cleanly in child processes: a variant that faults or hangs there is dropped, and the
    ones after it are probed again in a new child."""
    left = list(all_variants(args))
    alive: set[str] = set()
    for _ in range(4):
        if not left or budget.left() < 60:
            break
        cmd = [sys.executable, "-m", "benchmarks.kda.v2_overlap_check", "--probe", *left, "--caps",
               *map(str, args.caps), "--segments", *map(str, args.segments)]
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                                 timeout=min(150.0, budget.left() * 0.6))
            out, rc = res.stdout, res.returncode
        except subprocess.TimeoutExpired as exc:
            out, rc = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), "timeout"
        seen = {}
        for line in out.splitlines():
            if line.startswith("PROBE-"):
                verdict, name = line.split(" ", 1)
                seen[name] = verdict == "PROBE-OK"
        alive |= {n for n, ok in seen.items() if ok}
        bad = [n for n, ok in seen.items() if not ok]
        rest = [n for n in left if n not in seen]
        if rest:  # the child died (or hung) on rest[0]
            bad.append(rest[0])
            log(f"[probe] child ended with {rc} on {rest[0]!r}:\n{out[-2000:]}")
            rest = rest[1:]
        if bad:
            log(f"[probe] dropped: {bad}")
        left = rest
    return alive


# ------------------------------------------------------------------------------------------------------------- stages


def check_fp64(variants: dict, device: str, budget: Budget) -> list[Row]:
    """Every full-forward variant against the fp64 oracle on the small cases of `v2_check`."""
    import torch

    rows = []
    for i, (name, lengths, B, T, H) in enumerate(SMALL):
        if budget.left() < 60:
            log(f"[fp64] budget: skipping {name} and later cases")
            break
        x, kw = small_inputs(device, lengths, B, T, H, -5.0, seed=200 + i)
        limit = 6e-3 if lengths else 5e-3
        extra, bad = {}, []
        with torch.inference_mode():
            ref = fp64_reference(x, kw)
            for vname, fn in variants.items():
                out, err = guarded(f"{vname} {name}", fn, x, kw)
                if out is None:
                    extra[f"{vname} error"] = err
                    bad.append(vname)
                    continue
                e = fp64_errors(vname, out, ref)
                extra.update({k: (float(f"{v:.3e}") if isinstance(v, float) else v) for k, v in e.items()})
                if not (e[f"{vname} finite"] and e[f"{vname} o"] <= limit and e[f"{vname} state"] <= 1e-2):
                    bad.append(vname)
        extra["failed"] = bad
        log(f"[fp64] {name}: {'PASS' if not bad else 'FAIL ' + str(bad)} (o<={limit:.0e}, state<=1e-2); "
            + ", ".join(f"{k}={v}" for k, v in extra.items() if k.endswith(" o")))
        rows.append(Row(f"fp64 {name}", "fp64 reference", None, None, extra=extra, note="correctness only",
                        params=dict(lengths=list(lengths) if lengths else None, B=B, T=T, H=H)))
    return rows


def time_row(shape: Shape, args, impls: dict, budget: Budget) -> Row:
    """Errors vs the default and fla, then medians of every baseline and variant on one row."""
    import torch

    x, _ = make_inputs(shape, "cuda")
    kw = dict(FLAGS)
    if shape.lengths is not None:
        cu = torch.tensor([0, *torch.tensor(shape.lengths).cumsum(0).tolist()], dtype=torch.int64)
        kw.update(cu_seqlens=cu.to("cuda"), cu_seqlens_cpu=cu)
    extra: dict = {"HBM floor ms": round(floor_ms(shape), 4)}
    runs = {}
    if impls.get("fla"):
        runs["fla"] = lambda: fla_style(impls["fla"], x, kw)
    if impls.get("cutlass"):
        x_vfirst = v_first(x)
        runs["cutlass"] = lambda: cutlass_call(impls["cutlass"], x_vfirst, kw)
    full = {k: v for k, v in full_variants(args.segments, args.caps).items() if k in args.alive}
    with torch.inference_mode():
        ref = guarded(f"v2 {shape.name}", full["v2"], x, kw)[0] if "v2" in full else None
        fla_out = guarded(f"fla {shape.name}", runs["fla"])[0] if "fla" in runs else None
        for name, fn in full.items():
            if budget.left() < 20:
                break
            out, err = guarded(f"{name} {shape.name}", fn, x, kw)
            if out is None:
                extra[f"{name} error"] = err
                continue
            extra[f"{name} finite"] = bool(torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all())
            if ref is not None and name != "v2":
                extra[f"rms(o, state) {name} vs v2"] = [float(f"{rms_ratio(out[0], ref[0]):.2e}"),
                                                         float(f"{rms_ratio(out[1], ref[1]):.2e}")]
            if fla_out is not None:
                extra[f"rms(o, state) {name} vs fla"] = [float(f"{rms_ratio(out[0], fla_out[0]):.2e}"),
                                                          float(f"{rms_ratio(out[1], fla_out[1]):.2e}")]
            runs[name] = functools.partial(fn, x, kw)
            del out
        del ref, fla_out
        for name, (make, fn) in kernel_variants(args.caps).items():
            if name not in args.alive:
                continue
            state, err = guarded(f"{name} {shape.name}", make, x, kw)
            if state is not None and guarded(f"{name} {shape.name}", fn, state)[1] is None:
                runs[name] = functools.partial(fn, state)
            else:
                extra[f"{name} error"] = err or "failed (see log)"
        torch.cuda.synchronize()
        medians = {}
        for name, run in runs.items():
            if budget.left() < 15:
                extra[f"{name} ms"] = "not run (budget)"
                continue
            t, err = guarded(f"time {name} {shape.name}", time_fn, run, device="cuda", warmup=2, rep=args.rep)
            extra[f"{name} ms"] = round(t.median_ms, 4) if t is not None else f"failed: {err}"
            if t is not None:
                medians[name] = t.median_ms
    for base in ("cutlass", "fla"):
        if base in medians:
            for name in medians:
                if name.startswith("v2"):
                    extra[f"{name}/{base} speed-up"] = round(medians[base] / medians[name], 3)
    full_times = {k: v for k, v in medians.items() if k.startswith("v2")}
    if full_times:
        extra["best v2 variant"] = min(full_times, key=full_times.get)
    log(f"[time] {shape.name}: " + ", ".join(f"{k}={v}" for k, v in extra.items() if k.endswith(" ms")))
    runs.clear()
    torch.cuda.empty_cache()
    best = extra.get("best v2 variant")
    return Row(shape.name, "CUTLASS FlashKDA", medians.get("cutlass"), medians.get(best) if best else None,
               params=dict(H=shape.H, T=shape.T, lengths=list(shape.lengths) if shape.lengths else None,
                           segments=args.segments, caps=args.caps),
               extra=extra, note=f"ours = the fastest v2 variant ({best})")


# --------------------------------------------------------------------------------------------------------------- main


def _write(results: list[Row], info: dict, no_write: bool, results_dir: Path | None = None) -> Path | None:
    if no_write or not results:
        return None
    path = write_results(COMPONENT, list(results), title="FlashKDA v2: K1/K2 overlap and K1 c32 caps",
                         info=info, results_dir=results_dir)
    log(f"results: {path}")
    return path


def _watchdog(budget: Budget, results: list[Row], info: dict, no_write: bool) -> None:
    while budget.left() > -GRACE_S:
        time.sleep(1.0)
    log(f"[watchdog] {GRACE_S:.0f} s past the budget (a hung kernel?): writing what was measured, exiting")
    info["watchdog"] = "exited past the budget"
    _write(results, info, no_write)
    os._exit(3)


def table(results: list[Row]) -> None:
    log("\n| row | fla | CUTLASS | v2 (default) | v2 auto | best v2 variant | best ms | best / CUTLASS | k1 c32 | "
        "best k1 c32 variant | k2 c32 |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        e = row.extra
        if "best v2 variant" not in e:
            continue
        caps = {k[:-3]: v for k, v in e.items() if k.startswith("k1 c32 ") and k.endswith(" ms")
                and isinstance(v, float)}
        cap = min(caps, key=caps.get) if caps else "-"
        best = e["best v2 variant"]
        log(f"| {row.case} | {e.get('fla ms', '-')} | {e.get('cutlass ms', '-')} | {e.get('v2 ms', '-')} | "
            f"{e.get('v2 auto ms', '-')} | {best} | {e.get(f'{best} ms')} | {e.get(f'{best}/cutlass speed-up', '-')} | "
            f"{e.get('k1 c32 ms', '-')} | {cap} {caps.get(cap, '')} | {e.get('k2 c32 ms', '-')} |")


def dry_run(rows: list[Shape], args) -> int:
    """CPU: rows, variants, the auto rule, the segmented orchestration on the emulation vs fp64, a results file."""
    import torch

    from flashkda.fwd.v2.emulate import emulate_prepare, emulate_recurrence
    from flashkda.fwd.v2.emulate32 import emulate_prepare32
    from flashkda.fwd.v2.pipeline import auto_segments, cached_segment_plan, segmented_forward

    for s in rows:
        N = len(s.lengths) if s.lengths else s.B
        auto = auto_segments(s.B * s.T, N, s.hv, H200_SMS)
        names = [*full_variants(args.segments, args.caps), *kernel_variants(args.caps)]
        log(f"[dry-run] row {s.name}: floor={floor_ms(s):.4f} ms, auto segments on {H200_SMS} SMs={auto}, "
            f"variants: {', '.join(names)}")

    def stand_in(emulate):
        def prepare(q, k, g, beta, scale, lay, lower_bound, A_log, dt_bias, ws):
            out = emulate(q, k, g, beta, scale, lay, lower_bound, A_log, dt_bias)
            for name in ("kd", "qd", "kr", "inv", "mqk", "glast", "beta"):
                getattr(ws, name).copy_(getattr(out, name))
        return prepare

    def recurrence(ws, v, o, h0, ht, order):
        out, state = emulate_recurrence(ws, v, h0, True)
        o.copy_(out)
        ht.copy_(state)

    extra, ok = {}, True
    for i, (name, lengths, B, T, H) in enumerate(SMALL):
        x, kw = small_inputs("cpu", lengths, B, T, H, -5.0, seed=200 + i)
        ref = fp64_reference(x, kw)
        cu = kw.get("cu_seqlens_cpu")
        host = [b * T for b in range(B + 1)] if cu is None else cu.tolist()
        for chunk, emulate in ((16, emulate_prepare), (32, emulate_prepare32)):
            plan = cached_segment_plan(B, T, None if cu is None else host, cu, 3, torch.device("cpu"), chunk)
            out = segmented_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, -5.0,
                                    x["A_log"], x["dt_bias"], x["initial_state"], True, host, cu, plan,
                                    prepare=stand_in(emulate), recurrence=recurrence)
            e = fp64_errors(f"{name} c{chunk} P{len(plan)}", out, ref)
            limit = 6e-3 if lengths else 5e-3
            ok &= all(v <= (limit if k.endswith(" o") else 1e-2) for k, v in e.items() if isinstance(v, float))
            ok &= all(v for k, v in e.items() if k.endswith("finite"))
            extra.update({k: float(f"{v:.3e}") if isinstance(v, float) else v for k, v in e.items()})
    # the segmented variant with K1 options, as timed on the device, with the emulation behind the kernel entries
    from unittest import mock

    def prepare32_stand_in(q, k, g, beta, scale, lay, lower_bound, A_log, dt_bias, ws, **options):
        assert set(options) <= {"wide", "max_registers", "batched"}, options
        stand_in(emulate_prepare32)(q, k, g, beta, scale, lay, lower_bound, A_log, dt_bias, ws)

    name, lengths, B, T, H = SMALL[1]
    x, kw = small_inputs("cpu", lengths, B, T, H, -5.0, seed=300)
    with mock.patch("flashkda.fwd.v2.prepare32.prepare32_fwd", prepare32_stand_in), \
            mock.patch("flashkda.fwd.v2.pipeline._recurrence_kernel", recurrence):
        out = v2_segmented_k1c32(x, kw, 3, **SEGMENTED_K1[" wide r80"])
    e = fp64_errors(f"{name} v2_segmented_k1c32 P3", out, fp64_reference(x, kw))
    ok &= e[f"{name} v2_segmented_k1c32 P3 o"] <= 6e-3 and e[f"{name} v2_segmented_k1c32 P3 state"] <= 1e-2
    extra.update({k: float(f"{v:.3e}") if isinstance(v, float) else v for k, v in e.items()})
    log(f"[dry-run] segmented emulation vs fp64: {'PASS' if ok else 'FAIL'} {extra}")
    with tempfile.TemporaryDirectory() as d:
        row = Row("dry-run", "fp64 reference", None, None, extra=extra, note="correctness only")
        path = _write([row], {**machine_info(), "device": "cpu"}, False, Path(d))
        log(f"[dry-run] results file written: {path.name} ({path.stat().st_size} B)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=220.0, help="seconds for the whole run (default 220)")
    parser.add_argument("--rows", nargs="*", default=None, help="row names (default all): "
                        + " ".join(s.name for s in ROWS))
    parser.add_argument("--segments", nargs="*", type=int, default=[2, 4, 8], help="segment counts to time")
    parser.add_argument("--caps", nargs="*", type=int, default=[96, 80, 64], help="K1 c32 register caps to time")
    parser.add_argument("--rep", type=int, default=8, help="timed calls per variant and row")
    parser.add_argument("--no-fla", action="store_true", help="skip fla (its first calls autotune)")
    parser.add_argument("--skip-fp64", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="CPU: rows, variants, emulation, results file")
    parser.add_argument("--probe", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget <= 0 or args.rep < 1 or any(p < 2 for p in args.segments) or any(c < 32 for c in args.caps):
        parser.error("--budget must be > 0, --rep >= 1, --segments >= 2, --caps >= 32")
    names = {s.name for s in ROWS}
    if args.rows and sorted(set(args.rows) - names):
        parser.error(f"unknown rows {sorted(set(args.rows) - names)}; choose from {sorted(names)}")
    rows = [s for s in ROWS if not args.rows or s.name in args.rows]
    if args.probe:
        return probe(args, args.probe)
    if args.dry_run:
        return dry_run(rows, args)

    import torch

    if not torch.cuda.is_available():
        log("no CUDA device: use --dry-run on a CPU")
        return 2
    budget = Budget(args.budget)
    info = machine_info()
    log(machine_line(info))
    results: list[Row] = []
    threading.Thread(target=_watchdog, args=(budget, results, info, args.no_write), daemon=True).start()
    from benchmarks.kda.v2_check import Impls

    base = Impls()
    impls = {"fla": None if args.no_fla else base.fla, "cutlass": base.cutlass}
    args.alive = run_probe(args, budget)
    info["dropped by the probe"] = sorted(set(all_variants(args)) - args.alive)
    log(f"[probe] {len(args.alive)} variants ran cleanly; dropped: {info['dropped by the probe'] or 'none'}")
    log(f"[impls] fla={'yes' if impls['fla'] else 'no'} cutlass={'yes' if impls['cutlass'] else 'no'} "
        f"missing: {base.missing or 'none'}")
    if not args.skip_fp64:
        fp64_variants = {k: v for k, v in full_variants([2, 3], args.caps).items() if k in args.alive}
        fp64_rows, _ = guarded("fp64", check_fp64, fp64_variants, "cuda", budget)
        results += fp64_rows or []
    for shape in rows:
        if budget.left() < 25:
            log(f"[time] budget: {shape.name} not run ({budget.left():.0f} s left)")
            results.append(Row(shape.name, "CUTLASS FlashKDA", None, None, note="not run (budget)"))
            continue
        row, err = guarded(f"row {shape.name}", time_row, shape, args, impls, budget)
        results.append(row or Row(shape.name, "CUTLASS FlashKDA", None, None, note=f"failed: {err}"))
    table(results)
    _write(results, info, args.no_write)
    log(f"done, {budget.left():.0f} s of the budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
