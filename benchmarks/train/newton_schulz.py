"""Muon's Newton–Schulz over a model's matrices: cuBLAS batched products against the symmetric-product kernel of
`k3infra.train.newton_schulz`, same slices, in the same run.

Usage (one GPU):  python -m benchmarks.train.newton_schulz                    (k3-mini's slices)
                  python -m benchmarks.train.newton_schulz --config k3 --model '{"num_hidden_layers": 2, ...}'
CPU dry run:      python -m benchmarks.train.newton_schulz --dry-run   (three of k3-debug's groups, interpreter)

The slices are the ones a Muon step orthogonalises (`optim._blocks` of every Muon parameter: per-head blocks,
expert slices, whole matrices), grouped by shape as the step batches them; each group is filled with random
values. Per group, rounds interleave the two variants (CUDA events). Each row records both variants' relative RMS
error against an fp64 Newton–Schulz of the group's first slice, and the plain products' FLOPs (the symmetric
kernel skips the tiles above the diagonal of two of the three products) and which of the two Muon takes
(`optim.takes_symmetric_products`). A last row sums the groups, and the variants Muon takes.
JSON goes to ``benchmarks/results/train-newton-schulz-<date>.json``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

from benchmarks.harness import parse_ab_args, require_cuda, write_results

logger = logging.getLogger(__name__)


def slice_groups(config_name: str, overrides: dict) -> dict[tuple[int, int], int]:
    """``{(n, m): slices}``: the Newton–Schulz slices of one Muon step of the model, by shape (meta device)."""
    import torch

    from k3infra.model import K3Config, K3ForCausalLM
    from k3infra.train.optim import _blocks, build_optimizers

    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.from_preset(config_name, **overrides))
    muon = build_optimizers(model, lr=1e-3)[0]
    groups: dict[tuple[int, int], int] = {}
    for group in muon.param_groups:
        for p in group["params"]:
            for block in _blocks(p, group["head_rows"]):
                shape = tuple(block.shape[1:])
                groups[shape] = groups.get(shape, 0) + block.shape[0]
    return groups


def fp64_newton_schulz(g, coefficients, steps, eps):
    """Muon's quintic Newton–Schulz of every slice of ``g`` (``[..., N, M]``) in fp64: the accuracy reference."""
    a, b, c = coefficients
    x = g.double()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def measure(groups: dict[tuple[int, int], int], device: str, rep: int, label: str):
    """`benchmarks.harness.Row` per slice shape and one for the whole step: median ms of the group's
    Newton–Schulz, cuBLAS products against the symmetric kernel."""
    import torch

    from benchmarks.harness import Row, rms_ratio, time_interleaved
    from k3infra.train.newton_schulz import newton_schulz
    from k3infra.train.optim import _newton_schulz_flops, takes_symmetric_products

    coefficients, steps, eps = (3.4445, -4.775, 2.0315), 5, 1e-7
    rows, totals = [], {"off": 0.0, "on": 0.0, "muon": 0.0}
    for (n, m), count in sorted(groups.items(), key=lambda item: -item[1] * item[0][0] * item[0][1]):
        g = torch.randn(count, n, m, device=device, dtype=torch.bfloat16,
                        generator=torch.Generator(device=device).manual_seed(n * 7919 + m))
        variants = {mode: partial(newton_schulz, g, coefficients, steps, eps, symmetric=mode == "on")
                    for mode in ("off", "on")}
        reference = fp64_newton_schulz(g[:1], coefficients, steps, eps)
        err = {mode: rms_ratio(fn()[:1], reference) for mode, fn in variants.items()}
        # the first round: Triton compilation and autotuning, the allocator
        timings = time_interleaved(variants.__getitem__, ("off", "on"), device=device, rounds=rep, warmup_rounds=1)
        muon_takes = "on" if takes_symmetric_products(g.shape) else "off"
        for mode in ("off", "on"):
            totals[mode] += timings[mode].median_ms
        totals["muon"] += timings[muon_takes].median_ms
        flops = _newton_schulz_flops(torch.Size([count, n, m]), None, steps)
        off, on = timings["off"].median_ms, timings["on"].median_ms
        logger.info("%d x %d x %d: cuBLAS %.3f ms (%.0f TFLOP/s), symmetric %.3f ms, err %.2e / %.2e", count, n,
                    m, off, flops / off / 1e9, on, err["off"], err["on"])
        rows.append(Row(
            case=f"ns-{count}x{n}x{m}", baseline="cuBLAS batched products",
            baseline_ms=off, ours_ms=on,
            params={"slices": count, "n": n, "m": m, "steps": steps, "rounds": rep},
            extra={"flops": flops, "baseline_tflops": flops / off / 1e9, "baseline_err_vs_fp64": err["off"],
                   "ours_err_vs_fp64": err["on"], "muon_takes": muon_takes,
                   "baseline_p80_ms": timings["off"].p80_ms, "ours_p80_ms": timings["on"].p80_ms},
            note="" if device == "cuda" else "CPU dry run: Triton interpreter, timing meaningless"))
    flops = sum(row.extra["flops"] for row in rows)
    rows.append(Row(case=f"ns-step-{label}", baseline="cuBLAS batched products",
                    baseline_ms=totals["off"], ours_ms=totals["on"],
                    params={"groups": len(rows), "steps": steps},
                    extra={"flops": flops, "muon_ms": totals["muon"],
                           **{key: max(row.extra[key] for row in rows)
                              for key in ("baseline_err_vs_fp64", "ours_err_vs_fp64")}},
                    note="sum of the groups' medians, the worst errors; muon_ms: each group by the variant Muon "
                         "takes"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-mini", help="model preset whose Muon slices are orthogonalised")
    p.add_argument("--model", default="{}", help="K3Config overrides (JSON), e.g. K3's widths at fewer layers")
    args = parse_ab_args(p, argv, rep=5)
    from benchmarks.train.run import _json_object

    overrides = _json_object("--model", args.model)
    if args.dry_run:
        groups = dict(sorted(slice_groups("k3-debug", overrides).items(), key=lambda item: item[1] * item[0][0])[:3])
        rows = measure(groups, "cpu", rep=1, label="k3-debug")
        worst = max(row.extra["ours_err_vs_fp64"] / max(row.extra["baseline_err_vs_fp64"], 1e-12)
                    for row in rows[:-1])
        if worst > 1.5:
            logger.error("the symmetric kernel's error is %.2fx the cuBLAS path's", worst)
            return 1
        logger.info("dry run: symmetric error within %.2fx of the plain path's; nothing written", worst)
        return 0
    require_cuda(p)
    label = args.config + ("-custom" if overrides else "")
    rows = measure(slice_groups(args.config, overrides), "cuda", args.rep, label)
    path = write_results("train-newton-schulz", rows, title="Muon Newton-Schulz: cuBLAS vs symmetric products")
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
