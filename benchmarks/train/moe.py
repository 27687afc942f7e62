"""One MoE layer's forward + backward on local experts (the EP = 1 path of a training step): torch's ops
(``fused.MODE = "off"``: the combine as a gather, an fp32 cast and a sum; the routing weights multiplied after an
eager SiTU-GLU; the eager RMSNorm and ``torch.topk``) against our kernels (``"on"``: `fused_moe.slot_sum`, the
row-scaled SiTU-GLU, the fused RMSNorm and top-k), same weights, tokens and output gradient, in the same run.

Usage (one GPU):  python -m benchmarks.train.moe                  (k3-mini's layer, one micro-batch of 8 x 4,096)
                  python -m benchmarks.train.moe --config k3 --model '{...}' --tokens 8192   (a K3-width slice)
CPU dry run:      python -m benchmarks.train.moe --dry-run        (k3-debug, Triton's interpreter, no file)

The layer keeps fp32 master weights and runs under bf16 autocast, as in the trainer; the grouped GEMMs are the same
in both variants. Each timed repetition runs one forward + backward of each variant, interleaved, CUDA events
around each. The row records each variant's relative RMS error of the output and of the input gradient against the
same layer in fp64, and the peak memory of one forward + backward. JSON goes to
``benchmarks/results/train-moe-<date>.json``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from benchmarks.harness import parse_ab_args, require_cuda, write_results

logger = logging.getLogger(__name__)


def _layer(config_name: str, overrides: dict, device: str):
    import torch

    from k3infra.model import K3Config
    from k3infra.model.moe import K3MoE

    config = K3Config.from_preset(config_name, **overrides)
    if not config.n_routed_experts:
        raise ValueError(f"--config {config_name} has no routed experts")
    torch.manual_seed(0)
    layer = K3MoE(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, config.initializer_range)
    return layer.to(device).train(), config


def _forward_backward(layer, x, dy, device: str):
    import torch

    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=x.dtype != torch.float64):
        y = layer(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad


def measure(config_name: str, overrides: dict, tokens: int, device: str, rep: int):
    """One `benchmarks.harness.Row`: median ms of one forward + backward, torch's ops against our kernels."""
    import copy

    import torch

    from benchmarks.harness import Row, rms_ratio, time_interleaved
    from k3infra.model import fused

    layer, config = _layer(config_name, overrides, device)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, config.hidden_size, generator=g, device=device).bfloat16()
    dy = torch.randn(tokens, config.hidden_size, generator=g, device=device).bfloat16()
    reference = copy.deepcopy(layer).double()
    y64, dx64 = _forward_backward(reference, x.double(), dy.double(), device)
    del reference
    saved_mode = fused.MODE
    err, peak = {}, {}
    try:
        for mode in ("off", "on"):
            fused.MODE = mode
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            y, dx = _forward_backward(layer, x, dy, device)
            err[mode] = (rms_ratio(y, y64), rms_ratio(dx, dx64))
            peak[mode] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        del y64, dx64

        def prepare(mode: str):
            fused.MODE = mode
            return lambda: _forward_backward(layer, x, dy, device)

        timings = time_interleaved(prepare, ("off", "on"), device=device, rounds=rep, warmup_rounds=2)
    finally:
        fused.MODE = saved_mode
    off, on = timings["off"].median_ms, timings["on"].median_ms
    logger.info("%s MoE layer, %d tokens x top-%d of %d experts: torch %.2f ms, ours %.2f ms; errors vs fp64 "
                "(output, input gradient) torch %.2e / %.2e, ours %.2e / %.2e", config_name, tokens,
                config.num_experts_per_tok, config.n_routed_experts, off, on, *err["off"], *err["on"])
    return Row(
        case=f"moe-{config_name}{'-custom' if overrides else ''}-{tokens}", baseline="torch ops (fused.MODE off)",
        baseline_ms=off, ours_ms=on,
        params={"config": config_name, "overrides": overrides, "tokens": tokens, "hidden": config.hidden_size,
                "latent": config.moe_latent_size, "expert_width": config.moe_intermediate_size,
                "experts": config.n_routed_experts, "top_k": config.num_experts_per_tok, "rounds": rep},
        extra={"baseline_err_out": err["off"][0], "baseline_err_dx": err["off"][1], "ours_err_out": err["on"][0],
               "ours_err_dx": err["on"][1], "baseline_peak_gib": peak["off"], "ours_peak_gib": peak["on"],
               "baseline_p80_ms": timings["off"].p80_ms, "ours_p80_ms": timings["on"].p80_ms},
        note="" if device == "cuda" else "CPU dry run: Triton interpreter, timing meaningless")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-mini", help="model preset whose MoE layer is timed")
    p.add_argument("--model", default="{}", help="K3Config fields over the preset as JSON (e.g. K3's widths)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens of the micro-batch")
    args = parse_ab_args(p, argv, rep=9)
    from benchmarks.train.run import _json_object

    overrides = _json_object("--model", args.model)
    if args.tokens < 1:
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.dry_run:
        row = measure("k3-debug", {}, 64, "cpu", rep=1)
        worst = max(row.extra["ours_err_out"], row.extra["ours_err_dx"])
        if worst > 2 * max(row.extra["baseline_err_out"], row.extra["baseline_err_dx"]) + 1e-3:
            logger.error("our kernels are further from fp64 than torch's ops: %.2e", worst)
            return 1
        logger.info("dry run: our kernels as close to fp64 as torch's ops; nothing written")
        return 0
    require_cuda(p)
    row = measure(args.config, overrides, args.tokens, "cuda", args.rep)
    path = write_results("train-moe", [row], title="K3 MoE layer (local experts): torch ops vs fused kernels")
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
