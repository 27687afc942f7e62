"""Calibrate FlashKDA's dispatch: time ours and every other ``chunk_kda`` backend per shape class, in one run.

Per row (bf16, K = V = 128, fp32 initial and final state, K3 flags: in-kernel L2 norm, bounded gate
``lower_bound=-5`` with ``A_log``/``dt_bias``, beta sigmoid): fla 0.6.0's own Triton path (its undispatched
function), MoonshotAI's CUTLASS FlashKDA through fla's adapter when ``flash_kda`` is importable (inference only),
and ``flashkda.chunk_kda``; inference rows time the forward, training rows forward + backward into every input.
Ours is whatever ``flashkda.chunk_kda`` runs for the row (v2 where ``prefers_v2`` / ``prefers_v2_training`` hold,
else v1; ``FLASHKDA_KERNELS=v1`` or ``v2`` forces one); each row records which in ``ours path``.
Inference rows that both our kernel sets serve also time the set ``chunk_kda`` did not pick (``FLASHKDA_KERNELS``
forced), recorded as ``v1 ms`` and ``v2 ms``: the data behind ``chunk_fwd.MIN_SEQUENCE_HEADS``.
Each backend is timed twice, interleaved, and the mean of the two medians kept. Ours must match fla
(relative RMS of o and the final state <= 1e-2) before it is timed; a row that fails is left out of the table, so
its class is declined.

Writes ``benchmarks/results/kda-calibrate-<date>.json`` and, with ``--write-table``, this GPU's calibration table
``src/flashkda/calibration/<arch>-<device>.json`` that ``flashkda.dispatch`` ships (or ``--table-out PATH``).
``--merge`` keeps the rows of the existing table that this run does not measure, so a calibration can span several
calls; it refuses a table from another device or commit.

Usage: ``python -m benchmarks.kda.calibrate [--rows NAME ...] [--modes inference training] [--rep N]
[--write-table | --table-out PATH] [--merge]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import ROOT, Row, machine_info, machine_line, rms_ratio, time_fn, write_results
from benchmarks.progress import track

VARLEN_MIXED = (1300, 547, 2048, 963, 271, 3063)
VARLEN_EVEN = (1024,) * 8
FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True, state_v_first=True)
GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
GATE_TOL = 1e-2


@dataclass(frozen=True)
class Shape:
    """One calibration row: ``B`` sequences of ``T`` tokens (or packed ``lengths``), ``H`` q/k heads, ``HV``
    value heads."""

    name: str
    H: int
    T: int
    B: int = 1
    lengths: tuple[int, ...] | None = None
    HV: int | None = None
    D: int = 128

    @property
    def hv(self) -> int:
        return self.HV or self.H


def _fixed(H: int, T: int, B: int = 1) -> Shape:
    return Shape(f"B{B}-T{T}-H{H}" if B > 1 else f"H{H}-T{T}", H, T, B)


def _varlen(H: int, lengths: tuple[int, ...], tag: str) -> Shape:
    return Shape(f"H{H}-varlen-{tag}", H, sum(lengths), 1, lengths)


#: Inference rows: both ends of the token buckets the dispatch keys on (2048, 8192, 32768, 131072) for the K3
#: head counts, the varlen mixes of the anchor table and one GVA shape.
INFERENCE = (
    [_fixed(H, T) for H in (12, 32, 64, 96) for T in (2048, 8192, 32768)]
    + [_fixed(H, T) for H in (12, 64) for T in (1024, 4096, 16384)]
    + [_fixed(32, 131072), _fixed(32, 65536)]
    + [_varlen(H, lens, tag) for H in (12, 64, 96) for lens, tag in ((VARLEN_MIXED, "mixed"), (VARLEN_EVEN, "1kx8"))]
    + [Shape("H16-HV64-T8192", 16, 8192, HV=64)]
)
#: Training rows: the training table's rows plus the small and large head counts, GVA and K = V = 64 (the training
#: bar's six rows are among them).
TRAINING = [
    _fixed(64, 8192), _varlen(64, VARLEN_EVEN, "1kx8"), _varlen(64, VARLEN_MIXED, "mixed"), _fixed(32, 4096, B=8),
    _fixed(32, 32768), _fixed(12, 8192), _fixed(96, 8192), Shape("H16-HV64-T8192", 16, 8192, HV=64),
    Shape("H64-T8192-K64", 64, 8192, D=64),
]


def make_inputs(shape: Shape, device: str, *, grad: bool = False, seed: int = 0) -> tuple[dict, dict]:
    """Random bf16 inputs of ``shape`` (gate logits raw, fp32 ``A_log``/``dt_bias``/state) and the call keywords."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, HV, D = shape.B, shape.T, shape.H, shape.hv, shape.D
    if shape.lengths is not None:
        B, N = 1, len(shape.lengths)
    else:
        N = B

    def rn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32).to(dtype)

    x = dict(q=rn(B, T, H, D), k=rn(B, T, H, D), v=rn(B, T, HV, D), g=rn(B, T, HV, D), beta=rn(B, T, HV),
             A_log=torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen)),
             dt_bias=rn(HV * D, dtype=torch.float32), initial_state=rn(N, HV, D, D, dtype=torch.float32) * 0.1)
    if grad:
        for t in x.values():
            t.requires_grad_()
    kw = dict(FLAGS)
    if shape.lengths is not None:
        cu = torch.tensor([0, *torch.tensor(shape.lengths).cumsum(0).tolist()], dtype=torch.int64)
        kw.update(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    return x, kw


def call(fn, x: dict, kw: dict):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], A_log=x["A_log"],
              dt_bias=x["dt_bias"], **kw)


def training_step(fn, x: dict, kw: dict, do, dht):
    """Forward, then backward into every input; returns ``(o, final_state, grads)``."""
    import torch

    o, ht = call(fn, x, kw)
    grads = torch.autograd.grad((o, ht), [x[n] for n in GRAD_NAMES], (do, dht))
    return o, ht, grads


def backends(mode: str) -> dict:
    """The ``chunk_kda`` implementations to time: fla's own path, the CUTLASS FlashKDA (when importable, for
    inference) and ours. fla's entry is unwrapped from its dispatcher, so no backend (ours included) serves it."""
    from inspect import unwrap

    import fla.ops.kda.chunk as fla_chunk

    import flashkda

    found = {"fla": unwrap(fla_chunk.chunk_kda)}
    if mode == "inference":
        try:
            import flash_kda  # noqa: F401  (its compiled extension too)
        except ImportError:
            pass
        else:
            from fla.ops.kda.backends.flash_kda import FlashKDABackend

            found["flash_kda"] = FlashKDABackend().chunk_kda
    found["flashkda"] = flashkda.chunk_kda
    return found


def ours_path(x: dict, kw: dict, training: bool) -> str:
    """Which kernels ``flashkda.chunk_kda`` runs for this row: ``"v2"``, or ``"v1"`` with the rule's reason."""
    from flashkda.fwd.v2 import chunk_fwd

    if training:
        if call(chunk_fwd.prefers_v2_training, x, kw):
            return f"v2 (chunk {chunk_fwd.TRAINING_CHUNK})"
        reason = call(chunk_fwd.v2_training_unsupported_reason, x, kw)
    else:
        if call(chunk_fwd.prefers_v2, x, kw):
            return "v2"
        reason = call(chunk_fwd.v2_unsupported_reason, x, kw)
    return f"v1 ({reason or 'the rule or ' + chunk_fwd.KERNELS_ENV + ' prefers it'})"


def other_kernels(x: dict, kw: dict, training: bool) -> str | None:
    """The kernel set (``"v1"`` or ``"v2"``) ``flashkda.chunk_kda`` did not pick for an inference row both serve."""
    from flashkda.fwd.v2 import chunk_fwd

    if training or chunk_fwd.kernels_choice() != "auto":
        return None
    if not call(chunk_fwd.supports_v2, x, kw):
        return None
    return "v1" if call(chunk_fwd.prefers_v2, x, kw) else "v2"


def forced_kernels(fn, kernels: str):
    """``fn`` with ``FLASHKDA_KERNELS=kernels`` for the duration of each call."""
    from flashkda.fwd.v2.chunk_fwd import KERNELS_ENV

    def run(*args, **kwargs):
        old = os.environ.get(KERNELS_ENV)
        os.environ[KERNELS_ENV] = kernels
        try:
            return fn(*args, **kwargs)
        finally:
            if old is None:
                del os.environ[KERNELS_ENV]
            else:
                os.environ[KERNELS_ENV] = old

    return run


def measure(shape: Shape, mode: str, device: str, rep: int) -> tuple[dict[str, float], dict, str]:
    """Median ms per backend (``{}`` for ours when its gate failed; ``flashkda v1``/``flashkda v2`` for the kernel
    set ours did not pick, see `other_kernels`), the gate errors and `ours_path`."""
    import torch

    training = mode == "training"
    x, kw = make_inputs(shape, device, grad=training)
    fns = backends(mode)
    other = other_kernels(x, kw, training)
    if other is not None:
        fns[f"flashkda {other}"] = forced_kernels(fns["flashkda"], other)
    if training:
        do = torch.randn_like(x["v"])
        dht = torch.randn_like(x["initial_state"])
        runs = {name: (lambda fn=fn: training_step(fn, x, kw, do, dht)) for name, fn in fns.items()}
        ctx = torch.enable_grad
    else:
        runs = {name: (lambda fn=fn: call(fn, x, kw)) for name, fn in fns.items()}
        ctx = torch.inference_mode
    errors = {}
    with ctx():
        ref = runs["fla"]()
        for name, run in list(runs.items()):
            if name == "fla":
                continue
            try:
                out = run()
            except (RuntimeError, ValueError) as e:  # a backend that does not take this shape is not a competitor
                if name.startswith("flashkda"):
                    raise
                print(f"  {name} does not take {shape.name}: {e}", flush=True)
                del runs[name]
                continue
            errors[name] = {"o": rms_ratio(out[0], ref[0]), "state": rms_ratio(out[1], ref[1])}
            if training:
                errors[name]["grads"] = max(rms_ratio(a, b) for a, b in zip(out[2], ref[2]))
            finite = all(bool(torch.isfinite(t).all()) for t in (out[0], out[1]))
            errors[name]["ok"] = finite and max(v for k, v in errors[name].items() if k != "ok") <= GATE_TOL
        del ref, out
        medians: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(2):
            for name, run in runs.items():
                if name in errors and not errors[name]["ok"]:
                    continue
                medians[name].append(time_fn(run, device=device, warmup=2, rep=rep).median_ms)
    return {name: sum(v) / len(v) for name, v in medians.items() if v}, errors, ours_path(x, kw, training)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=None, help="row names to run (default: all)")
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=("inference", "training"),
                        help="which shape classes to calibrate (default both)")
    parser.add_argument("--rep", type=int, default=15, help="timed calls per backend and pass")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--write-table", action="store_true",
                     help="write this GPU's shipped table src/flashkda/calibration/<arch>-<device>.json")
    out.add_argument("--table-out", type=Path, default=None, help="write the calibration table to this path")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the existing table (same device and commit) that this run does not "
                             "measure")
    parser.add_argument("--no-write", action="store_true", help="write no results JSON")
    args = parser.parse_args(argv)
    if args.merge and not (args.write_table or args.table_out):
        parser.error("--merge needs --write-table or --table-out (the table to merge into)")

    import torch

    from flashkda.dispatch import CalibrationTable, Measurement, ShapeClass, device_arch, device_name, table_stem

    if not torch.cuda.is_available():
        print("calibration needs a CUDA device; nothing timed", file=sys.stderr)
        return 1
    device = "cuda"
    info = machine_info()
    print(machine_line(info), flush=True)
    arch = device_arch(torch.device(device))
    stem = table_stem(arch, device_name(torch.device(device)))
    target = args.table_out or (ROOT / "src" / "flashkda" / "calibration" / f"{stem}.json" if args.write_table
                                else None)
    plan = [(mode, shape) for mode in args.modes
            for shape in (INFERENCE if mode == "inference" else TRAINING) if not args.rows or shape.name in args.rows]
    kept, measured_at = merged_rows(target, info, {(shape.name, mode) for mode, shape in plan}) if args.merge \
        else ([], info["date"])
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
    measurements, rows = [], []
    for mode in args.modes:
        shapes = [shape for m, shape in plan if m == mode]
        for shape in track(shapes, f"calibrate {mode}"):
            t0 = time.time()
            try:
                times, errors, path = measure(shape, mode, device, args.rep)
            except torch.OutOfMemoryError as e:
                print(f"{mode:>9} {shape.name:>18}: out of memory ({e}); left out", flush=True)
                continue
            torch.cuda.empty_cache()
            q = torch.empty(shape.B if shape.lengths is None else 1, shape.T, shape.H, shape.D, dtype=torch.bfloat16,
                            device="meta")
            v = torch.empty(*q.shape[:2], shape.hv, shape.D, device="meta")
            cls = ShapeClass.of_call(q, v, None if shape.lengths is None else shape.lengths, mode == "training")
            ours = times.pop("flashkda", None)
            kernels = {}
            for name in ("flashkda v1", "flashkda v2"):
                if name in times:
                    kernels[name[-2:]] = times.pop(name)
            if kernels and ours is not None:
                kernels[path[:2]] = ours
            best = min(times, key=times.get)
            line = "  ".join(f"{n} {t:.3f}" for n, t in times.items())
            if len(kernels) == 2:
                line += f"  (v1 {kernels['v1']:.3f}  v2 {kernels['v2']:.3f})"
            if ours is None:
                print(f"{mode:>9} {shape.name:>18}: {line}  ours failed its gate {errors['flashkda']}", flush=True)
            else:
                measurements.append(Measurement(shape.name, cls, ours, times))
                print(f"{mode:>9} {shape.name:>18}: {line}  ours {ours:.3f} ms [{path}]  "
                      f"{times[best] / ours:.2f}x {best}  ({time.time() - t0:.0f}s)", flush=True)
            rows.append(Row(f"{mode}-{shape.name}", f"best of {', '.join(times)} ({best})", times[best],
                            ours if ours is not None else float("nan"),
                            params=dict(mode=mode, shape=cls.label(), H=shape.H, HV=shape.hv, T=shape.T, B=shape.B,
                                        lengths=shape.lengths),
                            extra={**{f"{n} ms": round(t, 4) for n, t in {**times, **kernels}.items()},
                                   "ours path": path,
                                   "gate": {n: {k: (round(v, 6) if isinstance(v, float) else v)
                                                for k, v in e.items()} for n, e in errors.items()}}))
            # after every row, so a run cut short keeps what it measured
            if not args.no_write and rows:
                write_results("kda-calibrate", rows, title="kda dispatch calibration", info=info)
            if target is not None and measurements:
                CalibrationTable(arch, info["device"], measured_at, str(info["commit"]), tuple(kept + measurements),
                                 {k: str(info.get(k)) for k in ("torch", "triton", "fla")}).save(target)
    if target is not None:
        print(f"calibration table: {target} ({len(measurements)} rows measured, {len(kept)} kept)")
    return 0


def merged_rows(target: Path | None, info: dict, planned: set[tuple[str, str]]) -> tuple[list, str]:
    """The rows of the table at ``target`` that this run does not measure (``planned``: row name and mode) and the
    date its calibration began; nothing when there is no table yet.

    Raises:
        SystemExit: the table is unreadable, or from another device or commit (merging would mix runs).
    """
    from flashkda.dispatch import CalibrationTable

    if target is None or not target.exists():
        return [], info["date"]
    try:
        table = CalibrationTable.load(target)
    except ValueError as e:
        raise SystemExit(f"--merge: {e}") from e
    if (table.device, table.commit) != (info["device"], str(info["commit"])):
        raise SystemExit(f"--merge: {target} was measured on {table.device} at commit {table.commit[:12]}, this run "
                         f"is {info['device']} at {str(info['commit'])[:12]}; rerun its rows here or drop --merge to "
                         f"replace it")
    kept = [m for m in table.rows if (m.row, m.shape.mode) not in planned]
    return kept, min(table.measured, info["date"])


if __name__ == "__main__":
    raise SystemExit(main())
