"""`k3infra bench train`: one K3 training step, FlashKDA + MoonEP against fla kernels + a plain all_to_all EP.

Usage (one H200):  python -m benchmarks.train.run --config k3-mini
CPU smoke:         python -m benchmarks.train.run --device cpu --config k3-debug --steps 2 --warmup 1
With compile:      python -m benchmarks.train.run --config k3-mini --compile [module] [--skip-baseline]

Both variants build the same model from the same seed, read the same packed batches and run the real trainer step
(forward, backward, Muon + AdamW, QK-Clip, Quantile Balancing). They differ only in the `K3Config` fields given
by ``--ours`` and ``--baseline`` (JSON; ``--model`` gives fields of every variant, and the case is then named
``<preset>-custom``); ``--compile`` adds a third variant, ours with each decoder layer under
``torch.compile`` (`TrainConfig.compile`; ``--compile module``: each child of a layer), timed in the same run and
reported as a second row against the same baseline (compilation happens in the warm-up steps); ``--skip-baseline``
leaves the baseline out and compares ours compiled with ours eager. At EP = 1 on one GPU no tokens leave the
device, so the MoE dispatcher is the local one in both and the measured difference is the KDA kernel; that is
recorded in each row's note. On the CPU both variants use the torch KDA path (the Triton kernels need a GPU), so
the timing is a smoke test only.

Gate: every variant's first-step loss (same weights, same batch) agrees with the baseline's (``--skip-baseline``:
ours eager's) within ``--gate-tol`` nats. The results file is written after each variant (a row without its
reference has no baseline time, and its note says which variants the run did not finish), so a run killed in a
later variant keeps the earlier ones; a SIGTERM (a ``timeout`` around the run) stops it and writes them with a
note that says so, exit 1.
Reported per variant: median step time (ms, 20/80 quantiles), tokens/s, MFU (``flops_per_token`` of
``K3_MODEL.md`` §5 × tokens/s ÷ H200 dense bf16 peak), the step's two phases on the device's timeline (forward +
backward of all micro-batches, and the update: clipping, Muon + AdamW, QK-Clip, balancing) with the MFU of the
first alone, peak memory; with the model's FLOPs per step, Muon's Newton–Schulz FLOPs per step (not part of
MFU's count, but of the update's time). JSON goes to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile

import torch

from benchmarks.harness import Row, Timing, machine_info, write_results
from k3infra.train.compile import compile_backend
from k3infra.train.metrics import format_mfu, mfu
from k3infra.train.optim import ShardedMuon
from k3infra.train.trainer import TrainConfig, Trainer


def measure(cfg: TrainConfig, steps: int, warmup: int) -> dict:
    """Build a trainer, run ``warmup`` untimed and ``steps`` timed steps; close its process group."""
    trainer = Trainer(cfg)
    try:
        if trainer.state.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        entries = [trainer.train_step(step) for step in range(warmup + steps)]
        timed = entries[warmup:]
        samples_ms = [cfg.batch_size * cfg.seq_len / e["tokens_per_s"] * 1e3 for e in timed]
        tokens_per_s = statistics.median(e["tokens_per_s"] for e in timed)
        forward_backward_ms = statistics.median(e["forward_backward_ms"] for e in timed)
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if trainer.state.device.type == "cuda" else None
        return {
            "first_loss": entries[0]["loss"],
            "timing": Timing.from_samples(samples_ms),
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(trainer.flops_per_token, tokens_per_s, trainer.peak, trainer.state.world_size),
            "forward_backward_ms": forward_backward_ms,
            "update_ms": statistics.median(e["update_ms"] for e in timed),
            "mfu_forward_backward": mfu(trainer.flops_per_token, cfg.batch_size * cfg.seq_len / forward_backward_ms
                                        * 1e3, trainer.peak, trainer.state.world_size),
            "flops_per_token": trainer.flops_per_token,
            "newton_schulz_flops_per_step": sum(o.newton_schulz_flops() for o in trainer.optimizers
                                                if isinstance(o, ShardedMuon)),
            "peak_memory_gib": peak_mem,
            "device": str(trainer.state.device),
        }
    finally:
        trainer.state.close()


class _Stopped(BaseException):
    """A SIGTERM arrived while a variant was measured (a BaseException, so that the ``except Exception`` wrappers of
    torch.compile let it through; `_SIGNALLED` catches a wrapper that does not)."""


_SIGNALLED: list[str] = []


def _raise_stopped(signum, frame):
    _SIGNALLED.append(signal.Signals(signum).name)
    raise _Stopped(_SIGNALLED[-1])


def _row(name: str, ref: str, results: dict, variants: dict, gap: float | None, args, cfg: TrainConfig,
         note: str) -> Row:
    """Variant ``name`` (``ours`` or ``ours+compile``) against variant ``ref`` (``baseline``, or ``ours`` eager
    with ``--skip-baseline``; no baseline time when ``ref`` was not measured), every variant's numbers in
    ``extra``."""
    ours, base = results[name], results.get(ref) if name != ref else None
    compiled = name == "ours+compile"
    return Row(
        case=f"{args.config}{'-custom' if args.model else ''}-T{cfg.seq_len}-B{cfg.batch_size}"
             f"-mb{cfg.micro_batch_size}" + ("-compile" if compiled else ""),
        baseline=f"K3 with {variants[ref]}" + (" (eager)" if ref == "ours" else ""),
        baseline_ms=None if base is None else base["timing"].median_ms,
        ours_ms=ours["timing"].median_ms,
        params={"config": args.config, "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
                "micro_batch_size": cfg.micro_batch_size,
                "ours": variants[name], "baseline_overrides": variants[ref],
                "compile": f"{args.compile}/{compile_backend()}" if compiled else False,
                "activation_checkpointing": args.activation_checkpointing, "steps": args.steps},
        extra={
            "flops_per_token": ours["flops_per_token"],
            "model_flops_per_step": ours["flops_per_token"] * cfg.batch_size * cfg.seq_len,
            "newton_schulz_flops_per_step": ours["newton_schulz_flops_per_step"],
            **{f"{k}_{n}": v[k] for n, v in results.items()
               for k in ("tokens_per_s", "mfu", "forward_backward_ms", "update_ms", "mfu_forward_backward",
                         "peak_memory_gib", "first_loss")},
            **{f"{n}_{q}_ms": getattr(v["timing"], f"{q}_ms") for n, v in results.items() for q in ("median", "p20",
                                                                                                       "p80")},
            "first_loss_gap": gap,
        },
        note=note + (f"; ours under torch.compile per {args.compile} ({compile_backend()}), {ref} eager"
                     if compiled else ""),
    )


def _measure_variant(name: str, overrides: dict, out: str, args, results: dict) -> TrainConfig:
    """Measure one variant into ``results[name]`` and print its line; returns its resolved config."""
    cfg = TrainConfig(preset=args.config, steps=args.warmup + args.steps, seq_len=args.seq_len,
                      batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, out=f"{out}/{name}",
                      device=args.device, progress=False, tensorboard=False, plot=False, overrides=overrides,
                      activation_checkpointing=args.activation_checkpointing,
                      compile=args.compile if name == "ours+compile" else False).resolved()
    r = results[name] = measure(cfg, args.steps, args.warmup)
    print(f"{name:12s} {overrides}  step {r['timing'].median_ms:9.1f} ms  {r['tokens_per_s']:12,.0f} tok/s  "
          f"MFU {format_mfu(r['mfu'])}  fwd+bwd {r['forward_backward_ms']:.1f} ms (MFU "
          f"{format_mfu(r['mfu_forward_backward'])})  update {r['update_ms']:.1f} ms (Newton-Schulz "
          f"{r['newton_schulz_flops_per_step'] / 1e12:.2f} TFLOP)  peak "
          f"{'n/a' if r['peak_memory_gib'] is None else format(r['peak_memory_gib'], '.1f') + ' GiB'}  "
          f"first loss {r['first_loss']:.4f}", flush=True)
    return cfg


def _write_partial(results: dict, ref: str, variants: dict, args, cfg: TrainConfig, note: str, info: dict):
    """Write the rows of the variants measured so far (those that pass the loss gate against ``ref``, or have no
    ``ref`` to compare with yet); returns the path, None when no row qualifies."""
    gaps = {n: abs(r["first_loss"] - results[ref]["first_loss"]) if ref in results and n != ref else None
            for n, r in results.items() if n != ref or len(results) == 1}
    rows = [_row(n, ref, results, variants, gap, args, cfg, note) for n, gap in gaps.items()
            if gap is None or gap <= args.gate_tol]
    return write_results("train", rows, title="K3 training step", info=info) if rows else None


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: expected a JSON object of K3Config fields, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"{flag}: expected a JSON object of K3Config fields, got {type(value).__name__}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-mini", help="model preset (default k3-mini)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (the bar) or cpu (smoke)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: the preset's)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per step (default: the preset's)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="rows per forward/backward (default: the preset's; the step accumulates the rest)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (compilation, autotuning)")
    p.add_argument("--model", default="{}",
                   help="K3Config overrides of every variant (JSON), e.g. K3's widths at fewer layers and experts")
    p.add_argument("--ours", default='{"kda_backend": "flashkda"}', help="K3Config overrides of ours (JSON)")
    p.add_argument("--baseline", default='{"kda_backend": "fla"}', help="K3Config overrides of the baseline (JSON)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute decoder layers in backward")
    p.add_argument("--compile", nargs="?", const="layer", default=None, choices=("layer", "module"),
                   help="also time ours under torch.compile (a third variant, second row): per decoder layer, or "
                        "'module': per child of a layer")
    p.add_argument("--skip-baseline", action="store_true",
                   help="with --compile: time only ours eager and ours compiled (the row's baseline is ours eager)")
    p.add_argument("--gate-tol", type=float, default=0.05, help="max first-step loss difference (nats)")
    p.add_argument("--update-table", action="store_true", help="refresh the train section of BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible (use --device cpu for the smoke run)")
    if args.skip_baseline and not args.compile:
        raise SystemExit("--skip-baseline needs --compile (it compares ours compiled with ours eager)")
    args.model = _json_object("--model", args.model)
    variants = {name: {**args.model, **_json_object(f"--{name}", getattr(args, name))}
                for name in ("ours", "baseline")}
    note = "EP=1 on one device: both use local experts, only the KDA kernel differs"
    if args.device == "cpu":
        variants = {name: {**o, "kda_backend": "torch"} for name, o in variants.items()}
        note = "CPU smoke: both variants run the torch KDA path and local experts (no kernel difference)"
    if args.compile:
        variants["ours+compile"] = variants["ours"]
    if args.skip_baseline:
        del variants["baseline"]
        note = "ours compiled against ours eager, same run"
    ref = "ours" if args.skip_baseline else "baseline"
    results = {}
    stopped = partial = None
    info = machine_info()  # one date, so every write below goes to the same file
    _SIGNALLED.clear()
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        with tempfile.TemporaryDirectory() as out:
            for name, overrides in variants.items():
                cfg = _measure_variant(name, overrides, out, args, results)
                if len(results) < len(variants):  # a SIGKILL in the next variant keeps this one's numbers
                    left = ", ".join(n for n in variants if n not in results)
                    partial = _write_partial(results, ref, variants, args, cfg,
                                             f"{note}; partial: the run did not finish {left}", info) or partial
    except (_Stopped, Exception):
        if not _SIGNALLED:
            raise
        stopped = f"stopped by {_SIGNALLED[-1]} while measuring {name}"
        print(f"{stopped}: writing the variants measured before it")
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped:
        path = _write_partial(results, ref, variants, args, cfg, f"{note}; {stopped}", info) if results else None
        if path:
            print(f"results: {path}")
        return 1
    gaps = {name: abs(r["first_loss"] - results[ref]["first_loss"]) for name, r in results.items() if name != ref}
    failed = {name: gap for name, gap in gaps.items() if gap > args.gate_tol}
    if failed:
        print(f"gate FAILED: first-step losses differ from {ref}'s by {failed} nats (> {args.gate_tol}); "
              "no timing reported")
        if partial:
            partial.unlink()  # its rows were written before the gate could be checked
        return 1
    rows = [_row(name, ref, results, variants, gaps[name], args, cfg, note) for name in gaps]
    path = write_results("train", rows, title="K3 training step", info=info)
    if args.update_table:  # BENCHMARKS.md is refreshed from chosen results files only through benchmarks.table
        from benchmarks import table

        table.main([str(path)])
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
