"""FlashKDA forward v2 on the device, in one run: its gpu tests, correctness, then timing against fla, CUTLASS FlashKDA
and our v1 on the anchor rows.

Stages, each guarded so that one failure does not stop the others, all inside ``--budget`` seconds:

1. probe: one small v2 forward and one K2 launch in a child process with a time limit (a hung kernel cannot stall
   the run; it also fills Triton's cache);
2. ``pytest -m gpu tests/flashkda/test_fwd_v2*.py``;
3. correctness: v2, and K2 alone on the emulated workspace, vs the fp64 reference at small sizes (and CUTLASS
   FlashKDA on the same inputs when importable); a gate sweep ``lower_bound`` -5 ... -0.1 (NaN/inf, error vs fp64);
4. per anchor row: v2 and CUTLASS vs fla (output and final-state relative RMS), then medians of CUDA events of
   fla, CUTLASS, v1 (``flashkda.chunk_kda`` with ``FLASHKDA_KERNELS=v1``), v2 (its default chunk size), ``v2 c16``
   and v2's K1 and K2 alone. K2
   is timed on K1's workspace, or on the emulated one when K1 fails. The chunk-32 forward is timed next to it on the
   same inputs: ``v2 c32`` (``chunk_kda_fwd_v2(..., chunk_size=32)``), ``k1 c32`` and ``k2 c32`` (on K1 c32's
   workspace, or the emulated chunk-32 workspace when K1 c32 fails), each with its errors vs fla and (stage 3) vs
   fp64.

Results: ``benchmarks/results/kda-v2-<date>.json`` (``benchmarks.harness.write_results``), a log on stdout.

Usage: ``python -m benchmarks.kda.v2_check [--budget 380] [--rows NAME ...] [--rep 10] [--variants all|shipped]
[--skip-pytest] [--no-write] [--dry-run]``; ``--dry-run`` runs on a CPU: arguments, rows, the emulation path and
the results file (to a temporary folder), no kernel.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from benchmarks.harness import ROOT, Row, machine_info, machine_line, rms_ratio, time_fn, write_results
from benchmarks.kda.calibrate import VARLEN_EVEN, VARLEN_MIXED, Shape, _fixed, _varlen, make_inputs

COMPONENT = "kda-v2"
#: The anchor rows (`/shared/FLASHKDA_ANCHOR.md` section 1), most important first.
ROWS = (
    [_fixed(64, 8192), _varlen(64, VARLEN_MIXED, "mixed"), _varlen(64, VARLEN_EVEN, "1kx8")]
    + [_fixed(96, 8192), _varlen(96, VARLEN_MIXED, "mixed"), _varlen(96, VARLEN_EVEN, "1kx8")]
    + [_fixed(12, 8192), _varlen(12, VARLEN_MIXED, "mixed"), _varlen(12, VARLEN_EVEN, "1kx8")]
    + [_fixed(64, 32768), _fixed(32, 131072)]
)
FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
SWEEP = (-5.0, -3.0, -1.0, -0.5, -0.1)
#: The kernels the child-process probe runs (one that hangs or crashes there is dropped from the run).
PROBED = ("k1", "k2", "v2", "k2c32", "k1c32", "v2c32")
#: HBM bytes per token-head that any forward moves (q, k, v, g in, o out, beta) and the H200's nominal bandwidth.
BYTES_PER_TOKEN_HEAD = 4 * 128 * 2 + 128 * 2 + 2
HBM_BYTES_PER_S = 4.8e12
#: Seconds past ``--budget`` after which the watchdog writes the partial results and exits.
GRACE_S = 15.0


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def log(msg: str) -> None:
    print(msg, flush=True)


def guarded(name: str, fn, *args, **kwargs):
    """``(result, None)`` or ``(None, error text)``; the traceback goes to the log."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # every stage is independent: report and go on
        log(f"[{name}] FAILED: {type(exc).__name__}: {str(exc)[:600]}")
        log("".join(traceback.format_exception(exc)[-6:]))
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def floor_ms(shape: Shape) -> float:
    n = len(shape.lengths) if shape.lengths else shape.B
    total = shape.B * shape.T * shape.H * BYTES_PER_TOKEN_HEAD + 2 * n * shape.H * 128 * 128 * 4
    return total / HBM_BYTES_PER_S * 1e3


# ---------------------------------------------------------------------------------------------- the implementations


def find_prepare():
    """K1's launcher: the public function of `flashkda.fwd.v2.prepare` that takes ``(q, k, g, beta, scale, layout,
    ...)`` like `emulate.emulate_prepare`."""
    from flashkda.fwd.v2 import prepare

    want = ["q", "k", "g", "beta", "scale", "layout"]
    for name in getattr(prepare, "__all__", dir(prepare)):
        fn = getattr(prepare, name)
        if callable(fn) and not name.startswith("_") and inspect.isfunction(fn):
            params = list(inspect.signature(fn).parameters)
            if params[: len(want)] == want:
                return fn
    raise ImportError("flashkda.fwd.v2.prepare has no function taking (q, k, g, beta, scale, layout, ...)")


def chunk_kda_v1(*args, **kwargs):
    """``flashkda.chunk_kda`` under ``FLASHKDA_KERNELS=v1`` (restored after): the v1 kernels, for inference and
    training alike (a training call's backward is chosen in its forward)."""
    import flashkda
    from flashkda.fwd.v2.chunk_fwd import KERNELS_ENV

    old = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = "v1"
    try:
        return flashkda.chunk_kda(*args, **kwargs)
    finally:
        if old is None:
            del os.environ[KERNELS_ENV]
        else:
            os.environ[KERNELS_ENV] = old


class Impls:
    """The forwards under test, each None when it cannot be imported here (the reason in `missing`)."""

    def __init__(self):
        self.missing: dict[str, str] = {}
        self.fla = self._try("fla", self._fla)
        self.cutlass = self._try("cutlass", self._cutlass)
        self.v1 = self._try("v1", lambda: chunk_kda_v1)
        self.v2 = self._try("v2", lambda: __import__("flashkda.fwd.v2", fromlist=["x"]).chunk_kda_fwd_v2)
        self.k1 = self._try("k1", find_prepare)
        self.k2 = self._try("k2", lambda: __import__("flashkda.fwd.v2.recurrence", fromlist=["x"]).recurrence_fwd)
        self.k2c32 = self._try("k2c32", lambda: __import__("flashkda.fwd.v2.recurrence32",
                                                           fromlist=["x"]).recurrence32_fwd)
        self.k1c32 = self._try("k1c32", lambda: __import__("flashkda.fwd.v2.prepare32", fromlist=["x"]).prepare32_fwd)
        self.v2c32 = self._try("v2c32", lambda: functools.partial(
            __import__("flashkda.fwd.v2", fromlist=["x"]).chunk_kda_fwd_v2, chunk_size=32))

    def _try(self, name, make):
        fn, err = guarded(f"import {name}", make)
        if err:
            self.missing[name] = err
        return fn

    @staticmethod
    def _fla():
        from inspect import unwrap

        import fla.ops.kda.chunk as fla_chunk

        return unwrap(fla_chunk.chunk_kda)

    @staticmethod
    def _cutlass():
        import flash_kda  # noqa: F401  (the compiled extension)
        from fla.ops.kda.backends.flash_kda import FlashKDABackend

        return FlashKDABackend().chunk_kda


def fla_style(fn, x: dict, kw: dict):
    """A call in fla's ``chunk_kda`` signature (fla, CUTLASS through fla's adapter, our v1)."""
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], A_log=x["A_log"],
              dt_bias=x["dt_bias"], safe_gate=True, **kw)


def cutlass_call(fn, x_vfirst: dict, kw: dict):
    """CUTLASS FlashKDA keeps the state V-first (``[N, H, V, K]``): it gets the transposed initial state (made once,
    outside the timing) and its final state is returned transposed back (a view)."""
    o, s = fla_style(fn, x_vfirst, dict(kw, state_v_first=True))
    return o, s.transpose(-1, -2)


def v_first(x: dict) -> dict:
    return dict(x, initial_state=x["initial_state"].transpose(-1, -2).contiguous())


def v2_call(fn, x: dict, kw: dict):
    scale = x["q"].shape[-1] ** -0.5
    out = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, initial_state=x["initial_state"],
             output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=kw["lower_bound"], cu_seqlens=kw.get("cu_seqlens"),
             A_log=x["A_log"], dt_bias=x["dt_bias"])
    return out[0], out[1]


def layout_for(x: dict, kw: dict):
    from flashkda.fwd.v2.workspace import build_chunk_layout

    q = x["q"]
    return build_chunk_layout(q.shape[0], q.shape[1], kw.get("cu_seqlens"), q.device)


def emulated_workspace(x: dict, kw: dict, layout):
    from flashkda.fwd.v2.emulate import emulate_prepare

    return emulate_prepare(x["q"], x["k"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, layout, kw["lower_bound"],
                           x["A_log"], x["dt_bias"])


def layout32_for(x: dict, kw: dict):
    from flashkda.fwd.v2.workspace32 import build_chunk_layout32

    q = x["q"]
    return build_chunk_layout32(q.shape[0], q.shape[1], kw.get("cu_seqlens"), q.device)


def emulated_workspace32(x: dict, kw: dict, layout):
    from flashkda.fwd.v2.emulate32 import emulate_prepare32

    return emulate_prepare32(x["q"], x["k"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, layout,
                             kw["lower_bound"], x["A_log"], x["dt_bias"])


def k1_call(fn, x: dict, kw: dict, layout):
    return fn(x["q"], x["k"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, layout, kw["lower_bound"],
              A_log=x["A_log"], dt_bias=x["dt_bias"])


# ------------------------------------------------------------------------------------------------------------- stages


def small_inputs(device: str, lengths, B: int, T: int, H: int, lower_bound: float, seed: int):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    N = len(lengths) if lengths else B

    def rn(*s):
        return torch.randn(*s, generator=gen, device=device)

    x = dict(q=rn(B, T, H, 128).bfloat16(), k=rn(B, T, H, 128).bfloat16(), v=rn(B, T, H, 128).bfloat16(),
             g=rn(B, T, H, 128).bfloat16(), beta=rn(B, T, H).bfloat16(),
             A_log=torch.log(torch.empty(H, device=device).uniform_(1, 16, generator=gen)),
             dt_bias=rn(H * 128), initial_state=rn(N, H, 128, 128) * 0.1)
    kw = dict(FLAGS, lower_bound=lower_bound)
    if lengths:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        kw.update(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    return x, kw


def fp64_reference(x: dict, kw: dict):
    from flashkda import reference

    return reference.chunk_kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5,
                                         x["initial_state"], A_log=x["A_log"], dt_bias=x["dt_bias"], **kw)


def fp64_errors(name: str, out, ref) -> dict:
    import torch

    finite = bool(torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all())
    return {f"{name} o": rms_ratio(out[0], ref[0]), f"{name} state": rms_ratio(out[1], ref[1]),
            f"{name} finite": finite}


SMALL = (
    ("fixed B2 T257 H2", None, 2, 257, 2),
    ("varlen (300,1,0,200,63) H2", (300, 1, 0, 200, 63), 1, 564, 2),
    ("varlen (1000,37) H4", (1000, 37), 1, 1037, 4),
)


def k2_on_emulated(k2, x: dict, kw: dict):
    ws = emulated_workspace(x, kw, layout_for(x, kw))
    return k2(ws, x["v"], x["initial_state"], True)


def k2c32_on_emulated(k2c32, x: dict, kw: dict):
    ws = emulated_workspace32(x, kw, layout32_for(x, kw))
    return k2c32(ws, x["v"], x["initial_state"], True)


def check_fp64(impls: Impls, device: str, budget: Budget) -> list[Row]:
    """v2, K2 on the emulated workspace, and CUTLASS vs the fp64 oracle; then the gate sweep."""
    import torch

    rows = []
    cases = [(name, lengths, B, T, H, -5.0) for name, lengths, B, T, H in SMALL]
    cases += [(f"gate sweep lower_bound={lb} H4 T2048", None, 1, 2048, 4, lb) for lb in SWEEP]
    for i, (name, lengths, B, T, H, lb) in enumerate(cases):
        if budget.left() < 30:
            log(f"[fp64] budget: skipping {name} and later cases")
            break
        x, kw = small_inputs(device, lengths, B, T, H, lb, seed=100 + i)
        with torch.inference_mode():
            ref = fp64_reference(x, kw)
            extra = {}
            if impls.v2:
                out, err = guarded(f"v2 {name}", v2_call, impls.v2, x, kw)
                extra.update(fp64_errors("v2", out, ref) if out else {"v2 error": err})
            if impls.k2:
                out, err = guarded(f"k2 {name}", k2_on_emulated, impls.k2, x, kw)
                extra.update(fp64_errors("k2(emulated ws)", out, ref) if out else {"k2 error": err})
            if impls.v2c32:
                out, err = guarded(f"v2 c32 {name}", v2_call, impls.v2c32, x, kw)
                extra.update(fp64_errors("v2 c32", out, ref) if out else {"v2 c32 error": err})
            if impls.k2c32:
                out, err = guarded(f"k2 c32 {name}", k2c32_on_emulated, impls.k2c32, x, kw)
                extra.update(fp64_errors("k2 c32(emulated ws)", out, ref) if out else {"k2 c32 error": err})
            if impls.cutlass and (lengths is None or 0 not in lengths):  # CUTLASS takes no empty sequence
                out, err = guarded(f"cutlass {name}", cutlass_call, impls.cutlass, v_first(x), kw)
                extra.update(fp64_errors("cutlass", out, ref) if out else {"cutlass error": err})
        limit_o = 6e-3 if lengths else 5e-3
        ok = all(extra.get(f"{p} finite", False) and extra[f"{p} o"] <= limit_o and extra[f"{p} state"] <= 1e-2
                 for p in ("v2", "k2(emulated ws)", "v2 c32", "k2 c32(emulated ws)") if f"{p} o" in extra)
        extra[f"pass (o<={limit_o:.0e}, state<=1e-2, finite)"] = ok
        log(f"[fp64] {name}: " + ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in extra.items()))
        rows.append(Row(f"fp64 {name}", "fp64 reference", None, None,
                        params=dict(lengths=list(lengths) if lengths else None, B=B, T=T, H=H, lower_bound=lb),
                        extra=extra, note="correctness only"))
    return rows


def time_row(shape: Shape, impls: Impls, device: str, rep: int, budget: Budget, variants: str = "all") -> Row:
    """Errors vs fla and medians of every implementation on one anchor row; ``variants="shipped"`` times only fla,
    CUTLASS, v1, v2 at its default and the default's K1 and K2 (fewer kernels to compile: every row fits a call)."""
    import torch

    t_row = time.monotonic()
    every = variants == "all"

    x, _ = make_inputs(shape, device)
    kw = dict(FLAGS)
    if shape.lengths is not None:
        cu = torch.tensor([0, *torch.tensor(shape.lengths).cumsum(0).tolist()], dtype=torch.int64)
        kw.update(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    extra: dict = {"HBM floor ms": round(floor_ms(shape), 4)}
    runs = {}
    if impls.fla:
        runs["fla"] = lambda: fla_style(impls.fla, x, kw)
    if impls.cutlass:
        x_vfirst = v_first(x)
        runs["cutlass"] = lambda: cutlass_call(impls.cutlass, x_vfirst, kw)
    if impls.v1:
        runs["v1"] = lambda: fla_style(impls.v1, x, kw)
    if impls.v2:
        runs["v2"] = lambda: v2_call(impls.v2, x, kw)
    # the chunk-16 layout feeds only the chunk-16 K1/K2 variants
    layout = guarded(f"layout {shape.name}", layout_for, x, kw)[0] if every else None
    ws = None
    if impls.k1 and layout is not None:
        ws, err = guarded(f"k1 {shape.name}", k1_call, impls.k1, x, kw, layout)
        if ws is not None:
            runs["k1"] = lambda: k1_call(impls.k1, x, kw, layout)
            extra["k2 workspace"] = "k1"
    if ws is None and layout is not None:
        ws, _ = guarded(f"emulated workspace {shape.name}", emulated_workspace, x, kw, layout)
        extra["k2 workspace"] = "emulate"
    if impls.k2 and ws is not None:
        runs["k2"] = lambda: impls.k2(ws, x["v"], x["initial_state"], True)
        # K2's other configurations: one CTA per head (8 warps), a 2-slot ring
        runs["k2 bv128"] = lambda: impls.k2(ws, x["v"], x["initial_state"], True, block_v=128)
        runs["k2 stages2"] = lambda: impls.k2(ws, x["v"], x["initial_state"], True, stages=2)
    if every and impls.v2:
        runs["v2 c16"] = lambda: v2_call(functools.partial(impls.v2, chunk_size=16), x, kw)
    if every and impls.v2c32:
        runs["v2 c32"] = lambda: v2_call(impls.v2c32, x, kw)
    layout32, _ = guarded(f"layout32 {shape.name}", layout32_for, x, kw)
    ws32 = None
    if impls.k1c32 and layout32 is not None:
        ws32, _ = guarded(f"k1 c32 {shape.name}", k1_call, impls.k1c32, x, kw, layout32)
        if ws32 is not None:
            runs["k1 c32"] = lambda: k1_call(impls.k1c32, x, kw, layout32)
            extra["k2 c32 workspace"] = "k1 c32"
    if ws32 is None and impls.k2c32 and layout32 is not None:
        ws32, _ = guarded(f"emulated workspace32 {shape.name}", emulated_workspace32, x, kw, layout32)
        extra["k2 c32 workspace"] = "emulate"
    if impls.k2c32 and ws32 is not None:
        runs["k2 c32"] = lambda: impls.k2c32(ws32, x["v"], x["initial_state"], True)
        if every:
            runs["k2 c32 stages3"] = lambda: impls.k2c32(ws32, x["v"], x["initial_state"], True, stages=3)
    with torch.inference_mode():
        ref, err = guarded(f"fla {shape.name}", runs["fla"]) if "fla" in runs else (None, "fla missing")
        for name in ("cutlass", "v1", "v2", "v2 c16", "k2", "k2 bv128", "k2 stages2", "v2 c32", "k2 c32",
                     "k2 c32 stages3"):
            if name not in runs:
                continue
            out, err = guarded(f"{name} {shape.name}", runs[name])
            if out is None:
                extra[f"{name} error"] = err
                del runs[name]
                continue
            finite = bool(torch.isfinite(out[0]).all() and (out[1] is None or torch.isfinite(out[1]).all()))
            extra[f"{name} finite"] = finite
            if ref is not None:
                extra[f"rms(o) {name} vs fla"] = float(f"{rms_ratio(out[0], ref[0]):.3e}")
                extra[f"rms(state) {name} vs fla"] = float(f"{rms_ratio(out[1], ref[1]):.3e}")
            del out
        del ref
        if device == "cuda":
            torch.cuda.synchronize()
        medians = {}
        for name, run in runs.items():
            if budget.left() < 15:
                extra[f"{name} ms"] = "not run (budget)"
                continue
            t, err = guarded(f"time {name} {shape.name}", time_fn, run, device=device, warmup=2, rep=rep)
            if t is not None:
                medians[name] = t.median_ms
                extra[f"{name} ms"] = round(t.median_ms, 4)
            else:
                extra[f"{name} ms"] = f"failed: {err}"
    for name in ("cutlass", "v1", "v2"):
        if name in medians and "fla" in medians:
            extra[f"{name}/fla speed-up"] = round(medians["fla"] / medians[name], 3)
    if "v2" in medians and "cutlass" in medians:
        extra["v2/cutlass speed-up"] = round(medians["cutlass"] / medians["v2"], 3)
    for a, b in (("k2", "k2 c32"), ("k1", "k1 c32"), ("v2", "v2 c32")):
        if a in medians and b in medians:
            extra[f"{b}/{a} speed-up"] = round(medians[a] / medians[b], 3)
    if "v2 c32" in medians:
        for base in ("fla", "cutlass"):
            if base in medians:
                extra[f"v2 c32/{base} speed-up"] = round(medians[base] / medians["v2 c32"], 3)
    extra["row seconds"] = round(time.monotonic() - t_row, 1)
    timing = {k: v for k, v in extra.items() if k.endswith(" ms") or "speed-up" in k}
    log(f"[time] {shape.name}: " + ", ".join(f"{k}={v}" for k, v in timing.items()))
    log(f"[check] {shape.name}: " + ", ".join(f"{k}={v}" for k, v in extra.items() if k not in timing))
    runs.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    return Row(shape.name, "fla 0.6.0 chunk_kda (Triton)", medians.get("fla"), medians.get("v2"),
               params=dict(H=shape.H, T=shape.T, B=shape.B, lengths=list(shape.lengths) if shape.lengths else None,
                           dtype="bf16", gate="bounded lower_bound=-5", state="fp32 K-first"),
               extra=extra, note="" if "v2" in medians else "v2 not timed")


def probe() -> int:
    """Child-process smoke run: one K2 launch on an emulated workspace and one v2 forward, small sizes."""
    import torch

    impls = Impls()
    x, kw = small_inputs("cuda", (40, 0, 17), 1, 57, 2, -5.0, seed=1)
    status = {}
    if impls.k2:
        def k2():
            ws = emulated_workspace(x, kw, layout_for(x, kw))
            o, s = impls.k2(ws, x["v"], x["initial_state"], True)
            torch.cuda.synchronize()
            return bool(torch.isfinite(o).all() and torch.isfinite(s).all())

        status["k2"] = guarded("probe k2", k2)[0]
    if impls.k2c32:
        def k2c32():
            o, s = k2c32_on_emulated(impls.k2c32, x, kw)
            torch.cuda.synchronize()
            return bool(torch.isfinite(o).all() and torch.isfinite(s).all())

        status["k2c32"] = guarded("probe k2c32", k2c32)[0]
    if impls.k1c32:
        def k1c32():
            ws = k1_call(impls.k1c32, x, kw, layout32_for(x, kw))
            torch.cuda.synchronize()
            return bool(torch.isfinite(ws.kd.float()).all())

        status["k1c32"] = guarded("probe k1c32", k1c32)[0]
    if impls.v2c32:
        def v2c32():
            o, s = v2_call(impls.v2c32, x, kw)
            torch.cuda.synchronize()
            return bool(torch.isfinite(o).all() and torch.isfinite(s).all())

        status["v2c32"] = guarded("probe v2c32", v2c32)[0]
    if impls.k1:
        def k1():
            ws = k1_call(impls.k1, x, kw, layout_for(x, kw))
            torch.cuda.synchronize()
            return bool(torch.isfinite(ws.kd.float()).all())

        status["k1"] = guarded("probe k1", k1)[0]
    if impls.v2:
        def v2():
            o, s = v2_call(impls.v2, x, kw)
            torch.cuda.synchronize()
            return bool(torch.isfinite(o).all() and torch.isfinite(s).all())

        status["v2"] = guarded("probe v2", v2)[0]
    log("PROBE " + " ".join(f"{k}={'ok' if v else 'bad'}" for k, v in status.items()))
    return 0


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_probe(timeout: float) -> dict[str, bool]:
    """Which of k1/k2/v2 ran in the child (a kernel that hangs or crashes is dropped from the run)."""
    cmd = [sys.executable, "-m", "benchmarks.kda.v2_check", "--probe"]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        log(f"[probe] timed out after {timeout:.0f} s (a kernel hangs?); every probed kernel is dropped")
        log((exc.stdout or b"")[-3000:].decode() if isinstance(exc.stdout, bytes) else str(exc.stdout)[-3000:])
        return dict.fromkeys(PROBED, False)
    log(res.stdout[-6000:] + res.stderr[-3000:])
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("PROBE")), "PROBE")
    found = dict(item.split("=") for item in line.split()[1:])
    return {k: found.get(k) == "ok" for k in PROBED}


def run_pytest(timeout: float, files: list[str] | None = None) -> tuple[int | str, str]:
    """``pytest -m gpu`` on ``files`` (default: the forward v2 test files) in a child process with a time limit:
    ``(return code or "timeout", the output's tail)``."""
    if files is None:
        files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "flashkda").glob("test_fwd_v2*.py"))
    cmd = [sys.executable, "-m", "pytest", *files, "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"pytest did not finish in {timeout:.0f} s"
    return res.returncode, (res.stdout + res.stderr)[-4000:]


def gpu_tests_row(timeout: float, files: list[str] | None = None, case: str | None = None) -> Row:
    """`run_pytest`, its outcome logged, as a correctness-only results row named ``case`` (default: the command)."""
    rc, tail = run_pytest(timeout, files)
    log(f"[pytest] rc={rc}\n{tail}")
    return Row(case or f"pytest -m gpu {' '.join(files or [])}", "pytest", None, None, extra={"rc": str(rc)},
               note="correctness only")


def write_dry_run_results(component: str, rows: list[Row]) -> None:
    """A dry run's results file, written to a temporary folder and logged (its format checked, nothing kept)."""
    with tempfile.TemporaryDirectory() as d:
        path = write_results(component, rows, results_dir=Path(d), info={**machine_info(), "device": "cpu"})
        log(f"[dry-run] results file written: {path.name} ({path.stat().st_size} B)")

# --------------------------------------------------------------------------------------------------------------- main


def write_rows(component: str, title: str, results: list[Row], info: dict, no_write: bool) -> None:
    """The results file of a device check (nothing when ``no_write`` or no rows)."""
    if no_write or not results:
        return
    path = write_results(component, list(results), title=title, info=info)
    log(f"results: {path}")


def start_watchdog(budget: Budget, grace_s: float, info: dict, write) -> None:
    """Past the budget plus ``grace_s`` a kernel is taken to hang: ``write()`` what was measured and exit."""

    def watch() -> None:
        while budget.left() > -grace_s:
            time.sleep(1.0)
        log(f"[watchdog] the run is {grace_s:.0f} s past its budget (a hung kernel?): writing what was measured, "
            "exiting")
        info["watchdog"] = "exited past the budget"
        write()
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def pick_rows(parser: argparse.ArgumentParser, rows, asked: list[str] | None, name=lambda row: row.name) -> list:
    """The rows named in ``asked`` (all of them when it is empty); ``parser.error`` on an unknown name."""
    names = {name(r) for r in rows}
    unknown = sorted(set(asked or ()) - names)
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {sorted(names)}")
    return [r for r in rows if not asked or name(r) in asked]


def start_device_run(budget_s: float, grace_s: float, write) -> tuple[Budget, dict] | None:
    """The budget, the machine line and the watchdog (``write(info)`` on expiry) of a device check; None, after
    saying so, without a CUDA device."""
    import torch

    budget = Budget(budget_s)
    if not torch.cuda.is_available():
        log("no CUDA device: use --dry-run on a CPU")
        return None
    info = machine_info()
    log(machine_line(info))
    start_watchdog(budget, grace_s, info, lambda: write(info))
    return budget, info


def _write(results: list[Row], info: dict, no_write: bool) -> None:
    write_rows(COMPONENT, "FlashKDA forward v2 vs CUTLASS FlashKDA and fla", results, info, no_write)


def dry_run(rows: list[Shape]) -> int:
    """The CPU-possible parts: rows, floors, the emulation against fp64, and the results file (to a temp folder)."""
    import torch

    from flashkda.fwd.v2.emulate import emulate_recurrence

    for s in rows:
        log(f"[dry-run] row {s.name}: B={s.B} T={s.T} H={s.H} lengths={s.lengths} floor={floor_ms(s):.4f} ms")
    x, kw = small_inputs("cpu", (20, 0, 33), 1, 53, 2, -5.0, seed=0)
    layout = layout_for(x, kw)
    ws = emulated_workspace(x, kw, layout)
    out = emulate_recurrence(ws, x["v"], x["initial_state"], True)
    ref = fp64_reference(x, kw)
    err = fp64_errors("emulate", out, ref)
    err.update(fp64_errors("emulate c32", emulate_recurrence(emulated_workspace32(x, kw, layout32_for(x, kw)),
                                                             x["v"], x["initial_state"], True), ref))
    log(f"[dry-run] emulation vs fp64: {err}")
    if not all(err[f"{p} finite"] and err[f"{p} o"] < 6e-3 and err[f"{p} state"] < 1e-2
               for p in ("emulate", "emulate c32")):
        log("[dry-run] emulation fails the fp64 bar")
        return 1
    write_dry_run_results(COMPONENT, [Row("dry-run", "fp64 reference", None, None, extra=err, note="correctness only")])
    assert torch.isfinite(out[0].float()).all()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=380.0, help="seconds for the whole run (default 380)")
    parser.add_argument("--rows", nargs="*", default=None, help="anchor row names (default all): "
                        + " ".join(s.name for s in ROWS))
    parser.add_argument("--rep", type=int, default=10, help="timed calls per implementation and row")
    parser.add_argument("--variants", choices=("all", "shipped"), default="all",
                        help="all: every K1/K2 configuration too; shipped: fla, CUTLASS, v1, v2 and v2's K1 and K2 "
                             "(enough to time all 11 rows in one call)")
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--skip-fp64", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="write no results JSON")
    parser.add_argument("--dry-run", action="store_true", help="CPU: rows, emulation, results file; no kernels")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget <= 0 or args.rep < 1:
        parser.error("--budget must be > 0 and --rep >= 1")
    rows = pick_rows(parser, ROWS, args.rows)
    if args.probe:
        return probe()
    if args.dry_run:
        return dry_run(rows)

    results: list[Row] = []
    started = start_device_run(args.budget, GRACE_S, lambda info: _write(results, info, args.no_write))
    if started is None:
        return 2
    budget, info = started
    device = "cuda"

    alive = run_probe(min(150.0, budget.left() * 0.4))
    log(f"[probe] {alive}")
    impls = Impls()
    for name in PROBED:
        if not alive[name] and getattr(impls, name) is not None:
            setattr(impls, name, None)
            impls.missing[name] = "dropped by the probe"
    log(f"[impls] missing: {impls.missing or 'none'}")

    if not args.skip_pytest and budget.left() > 120:
        results.append(gpu_tests_row(min(150.0, budget.left() - 90), case="pytest -m gpu test_fwd_v2*"))
    if not args.skip_fp64:
        fp64_rows, _ = guarded("fp64", check_fp64, impls, device, budget)
        results += fp64_rows or []
    for shape in rows:
        need = 20 + 0.5 * shape.T * shape.H / 8192 / 64
        if budget.left() < need:
            log(f"[time] budget: {shape.name} not run ({budget.left():.0f} s left)")
            results.append(Row(shape.name, "fla 0.6.0 chunk_kda (Triton)", None, None, note="not run (budget)"))
            continue
        row, err = guarded(f"row {shape.name}", time_row, shape, impls, device, args.rep, budget,
                              args.variants)
        results.append(row or Row(shape.name, "fla 0.6.0 chunk_kda (Triton)", None, None, note=f"failed: {err}"))
    info["missing"] = impls.missing
    _write(results, info, args.no_write)
    log(f"done, {budget.left():.0f} s of the budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
