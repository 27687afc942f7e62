"""One Muon step over a model's matrices: torch's element-wise ops (``fused.MODE = "off"``) against the fused
kernels of `k3infra.train.muon_kernels` (``"on"``; it also takes Newton–Schulz's symmetric products from
`k3infra.train.newton_schulz` for batches that `optim.takes_symmetric_products`), same parameters, gradients and
momentum, in the same run.

Usage (one GPU):  python -m benchmarks.train.muon                 (k3-mini: 293 matrices, ~0.9 B Muon weights)
CPU dry run:      python -m benchmarks.train.muon --dry-run       (k3-debug, Triton's interpreter, no file)

The optimizer is the trainer's (`build_optimizers`: per-head groups, ``match_rms_adamw`` scale, weight decay 0.1);
gradients are random with the momentum buffers already filled by one step. Each timed repetition runs one
``step()`` of each variant on its own copy of the state, interleaved, CUDA events around each. The row also
records the relative RMS difference of the parameters after one step from the same state, and the bytes the
element-wise passes move by count (the Newton–Schulz GEMMs aside), so the time can be read against the floor.
JSON goes to ``benchmarks/results/train-muon-<date>.json``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from benchmarks.harness import parse_ab_args, require_cuda, write_results

logger = logging.getLogger(__name__)

#: Bytes moved per fp32 Muon weight outside the Newton–Schulz GEMMs, by count: torch's ops (momentum ``lerp_``
#: 12, Nesterov ``lerp`` 12, the bf16 stack copy 6, the norm and division 6, weight decay 8, the subtraction 10)
#: and the fused kernels' (momentum and update 14, the bf16 stack copy 4, norm and division 6, decay and
#: subtraction 10).
BYTES_PER_WEIGHT = {"off": 54, "on": 34}


def _optimizer(config_name: str, device: str):
    import torch

    from k3infra.model import K3Config, K3ForCausalLM
    from k3infra.train.optim import build_optimizers

    with torch.device(device):
        model = K3ForCausalLM(K3Config.from_preset(config_name))
    muon = build_optimizers(model, lr=1e-3)[0]
    params = [p for group in muon.param_groups for p in group["params"]]
    g = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-3
    return muon, params


def _state(muon, params):
    return [(p.detach().clone(), muon.state[p]["momentum_buffer"].clone()) for p in params]


def _load(muon, params, state) -> None:
    for p, (value, buf) in zip(params, state):
        p.data.copy_(value)
        muon.state[p]["momentum_buffer"].copy_(buf)


def measure(config_name: str, device: str, rep: int):
    """One `benchmarks.harness.Row`: median ms of a Muon step, torch's element-wise ops against the fused ones."""
    from benchmarks.harness import Row, rms_ratio, time_interleaved
    from k3infra.model import fused

    muon, params = _optimizer(config_name, device)
    weights = sum(p.numel() for p in params)
    saved_mode = fused.MODE
    try:
        fused.MODE = "off"
        muon.step()  # momentum buffers exist and hold one step
        start = _state(muon, params)
        after = {}
        for mode in ("off", "on"):
            fused.MODE = mode
            _load(muon, params, start)
            muon.step()
            after[mode] = [p.detach().clone() for p in params]
        err = max(rms_ratio(a, b) for a, b in zip(after["on"], after["off"]))
        del after

        def prepare(mode: str):
            fused.MODE = mode
            _load(muon, params, start)
            return muon.step

        timings = time_interleaved(prepare, ("off", "on"), device=device, rounds=rep, warmup_rounds=2)
    finally:
        fused.MODE = saved_mode
    off, on = timings["off"].median_ms, timings["on"].median_ms
    logger.info("%s Muon step over %d matrices (%.3f B weights): torch %.2f ms, fused %.2f ms, param rel err %.2e",
                config_name, len(params), weights / 1e9, off, on, err)
    return Row(
        case=f"muon-step-{config_name}", baseline="torch element-wise ops (fused.MODE off)",
        baseline_ms=off, ours_ms=on,
        params={"config": config_name, "matrices": len(params), "muon_weights": weights, "rounds": rep},
        extra={"param_rel_rms": err,
               "baseline_bytes_per_weight": BYTES_PER_WEIGHT["off"], "ours_bytes_per_weight": BYTES_PER_WEIGHT["on"],
               "baseline_p80_ms": timings["off"].p80_ms, "ours_p80_ms": timings["on"].p80_ms},
        note="" if device == "cuda" else "CPU dry run: Triton interpreter, timing meaningless")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-mini", help="model preset whose Muon matrices are stepped")
    args = parse_ab_args(p, argv, rep=9)
    if args.dry_run:
        row = measure("k3-debug", "cpu", rep=1)
        if row.extra["param_rel_rms"] > 1e-2:
            logger.error("fused and torch Muon steps disagree: %.2e", row.extra["param_rel_rms"])
            return 1
        logger.info("dry run: fused matches torch; nothing written")
        return 0
    require_cuda(p)
    row = measure(args.config, "cuda", args.rep)
    path = write_results("train-muon", [row], title="Muon step: torch element-wise ops vs fused kernels")
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
