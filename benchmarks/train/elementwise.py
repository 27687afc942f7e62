"""Eager against fused element-wise ops of the K3 model: RMSNorm, SiTU-GLU, the AttnRes mix and the KDA
short convolution (`fused_conv`), forward and forward + backward; MLA's QK-Clip max-logit record (`max_logit`,
forward only: it runs under ``no_grad``) and the router's top-(k+1) selection (`fused_topk`, fp32 scores over 256
experts, forward only: no gradient flows through the selection).

Usage (one H200):  python -m benchmarks.train.elementwise
CPU dry run:       python -m benchmarks.train.elementwise --dry-run   (tiny shapes, Triton's interpreter, no file)

The baseline is the eager autograd Function of `k3infra.model.layers` (``fused.MODE = "off"``), ours the Triton
kernels of `k3infra.model.fused` (``"on"``), same inputs in the same run; shapes are those of one k3-mini
micro-batch (16,384 tokens, hidden 1024, dense MLP width 4864, 8 AttnRes sources; the max logit over 8 heads of
width 192 in packed sequences of 4096, 2048, 1024 x 4, 3072, 1024 and 1 tokens, then one of the rest), bf16.
Each row also records the relative RMS difference of the two outputs and input gradients. JSON goes to
``benchmarks/results/elementwise-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)


def _cases(tokens: int, hidden: int, width: int, sources: int):
    """(name, builder) per op; a builder gives (fn(inputs) -> output, inputs)."""
    import torch

    from k3infra.model import fused_topk, kda, layers, max_logit

    def norm(device, dtype, g):
        x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device)
        return (lambda x, w: layers.rms_norm(x, w, 1e-5)), [x, w]

    def situ(device, dtype, g):
        a = (torch.randn(tokens, width, generator=g) * 4).to(device, dtype)
        c = (torch.randn(tokens, width, generator=g) * 4).to(device, dtype)
        return (lambda a, c: layers.situ_glu(a, c, 4.0, 25.0)), [a, c]

    def attn_res(device, dtype, g):
        vs = [torch.randn(tokens, hidden, generator=g).to(device, dtype) for _ in range(sources)]
        q = (0.1 * torch.randn(hidden, generator=g)).to(device)
        nw = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device)
        return (lambda *vs: layers.attn_res_mix(list(vs), q, nw, 1e-5)), vs

    def short_conv(device, dtype, g):
        u = torch.randn(1, tokens, hidden, generator=g).to(device, dtype)
        w = (0.5 * torch.randn(hidden, 4, generator=g)).to(device)
        cu = torch.tensor([0, tokens // 3, tokens // 3 + 1, tokens], device=device)
        pos = kda.positions_in_sequence(tokens, cu, torch.device(device))
        return (lambda u, w: kda._conv_act(u, w, None, pos, 1, False).view(1, tokens, hidden)), [u, w]

    def mla_max_logit(device, dtype, g):
        heads, width = 8, 192
        lengths = [4096, 2048, 1024, 1024, 1024, 1024, 3072, 1024, 1]
        bounds = [0]
        for n in lengths:
            bounds.append(min(tokens, bounds[-1] + n))
        bounds.append(tokens)
        q = torch.randn(1, tokens, heads, width, generator=g).to(device, dtype).transpose(1, 2)
        k = torch.randn(1, tokens, heads, width, generator=g).to(device, dtype).transpose(1, 2)
        return (lambda q, k: max_logit.causal_max_logit(q, k, bounds, width**-0.5)), [q, k]

    def router_topk(device, dtype, g):
        experts, k = 256, 9  # k3-mini: top-8 and the cutoff of Quantile Balancing, whose margins are counted
        scores = torch.rand(tokens, experts, generator=g).to(device)
        bias = (0.1 * torch.randn(experts, generator=g)).to(device)
        hist = torch.zeros(experts, 2048, device=device)
        return (lambda s: fused_topk.biased_topk(s, bias, k, hist_EX=hist, margin_range=2.0)[0]), [scores]

    return [(f"rms_norm-{tokens}x{hidden}", norm, True), (f"situ_glu-{tokens}x{width}", situ, True),
            (f"attn_res-{sources}x{tokens}x{hidden}", attn_res, True),
            (f"conv_silu-{tokens}x{hidden}", short_conv, True), (f"mla_max_logit-8x{tokens}x192", mla_max_logit, False),
            (f"router_topk_qb-{tokens}x256-k9-bins2048", router_topk, False)]


def _run_once(fn, inputs, dy, backward: bool):
    if not backward:
        return fn(*inputs), None
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dy)
    return out, [t.grad for t in leaves]


def measure(tokens: int, hidden: int, width: int, sources: int, device: str, rep: int, warmup: int):
    """Rows of `benchmarks.harness.Row`: per op and direction, eager (baseline) and fused medians in ms."""
    import torch

    from benchmarks.harness import Row, rms_ratio, time_fn
    from k3infra.model import fused

    rows = []
    saved_mode = fused.MODE
    try:
        for name, build, has_backward in _cases(tokens, hidden, width, sources):
            fn, inputs = build(device, torch.bfloat16, torch.Generator().manual_seed(0))
            dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
            for backward in (False, True) if has_backward else (False,):
                timings, results = {}, {}
                for mode in ("off", "on"):
                    fused.MODE = mode
                    results[mode] = _run_once(fn, inputs, dy, backward)
                    timings[mode] = time_fn(functools.partial(_run_once, fn, inputs, dy, backward), device=device,
                                            rep=rep, warmup=warmup)
                out_err = rms_ratio(results["on"][0], results["off"][0])
                grad_err = (max(rms_ratio(a, b) for a, b in zip(results["on"][1], results["off"][1]))
                            if backward else None)
                direction = "fwd+bwd" if backward else "fwd"
                rows.append(Row(
                    case=f"{name}-{direction}", baseline="eager torch path (layers, max_logit; fp32 math)",
                    baseline_ms=timings["off"].median_ms, ours_ms=timings["on"].median_ms,
                    params={"tokens": tokens, "hidden": hidden, "width": width, "sources": sources, "dtype": "bf16",
                            "direction": direction},
                    extra={"out_rel_rms": out_err, "grad_rel_rms": grad_err,
                           "baseline_p80_ms": timings["off"].p80_ms, "ours_p80_ms": timings["on"].p80_ms},
                    note="" if device == "cuda" else "CPU dry run: Triton interpreter, timing meaningless"))
                logger.info("%s %s: eager %.3f ms, fused %.3f ms, out err %.2e, grad err %s", name, direction,
                            timings["off"].median_ms, timings["on"].median_ms, out_err, grad_err)
    finally:
        fused.MODE = saved_mode
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="rows (default 16384, one k3-mini micro-batch)")
    p.add_argument("--hidden", type=int, default=1024, help="RMSNorm width (default 1024)")
    p.add_argument("--width", type=int, default=4864, help="SiTU-GLU width (default 4864)")
    p.add_argument("--sources", type=int, default=8, help="AttnRes sources (default 8, a deep k3-mini site)")
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes (37 x 96, 37 x 160, 3 sources), Triton's interpreter; writes no file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
        rows = measure(37, 96, 160, 3, "cpu", rep=min(args.rep, 2), warmup=1)
        bad = [r.case for r in rows if r.extra["out_rel_rms"] > 1e-2 or (r.extra["grad_rel_rms"] or 0) > 1e-2]
        if bad:
            logger.error("fused and eager disagree on %s", bad)
            return 1
        logger.info("dry run: %d rows, fused matches eager; nothing written", len(rows))
        return 0
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA device (use --dry-run on the CPU)")
    from benchmarks.harness import write_results

    rows = measure(args.tokens, args.hidden, args.width, args.sources, "cuda", args.rep, args.warmup)
    path = write_results("elementwise", rows, title="K3 element-wise ops: eager vs fused Triton (bf16)")
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
