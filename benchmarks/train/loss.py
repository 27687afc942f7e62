"""The training loss through the LM head: `k3infra.model.linear_ce` against checkpointed pieces, forward + backward.

Usage (one GPU):   python -m benchmarks.train.loss
CPU dry run:       python -m benchmarks.train.loss --dry-run   (tiny shapes, Triton's interpreter, no file)

Baseline: the same pieces of ``--chunk`` tokens, each ``F.cross_entropy(F.linear(h, W).float(), t, reduction="sum")``
under ``torch.utils.checkpoint`` (the logits recomputed in backward: what the model did before `linear_ce`, and
what trainers without a fused loss do to avoid the ``[N, V]`` logits). Ours: `linear_cross_entropy_sum` (each
piece's gradient formed in the forward). Both under bf16 autocast with an fp32 head and the same inputs, in the
same run; shapes of one k3-mini micro-batch of 8 rows (32,768 tokens, hidden 1024, vocabulary 32,768). Each row
records medians, peak memory above the inputs, and the relative RMS of the loss and gradients against fp64 (on a
slice of ``--check-tokens`` tokens: fp64 over the full shape does not fit the point). JSON goes to
``benchmarks/results/train-loss-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)


def checkpointed_pieces(h_ND, weight_VD, target_N, chunk):
    """The baseline: per piece ``F.cross_entropy`` over fp32 logits under ``torch.utils.checkpoint``."""
    import torch
    import torch.nn.functional as F

    def piece(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="sum")

    total = h_ND.new_zeros((), dtype=torch.float32)
    for start in range(0, h_ND.shape[0], chunk):
        total = total + torch.utils.checkpoint.checkpoint(
            piece, h_ND[start : start + chunk], weight_VD, target_N[start : start + chunk], use_reentrant=False)
    return total


def _inputs(tokens, hidden, vocab, device, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device)
    t = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    t[::97] = -100
    return h, w, t


def _step(fn, h, w, t, chunk, device):
    """Loss and the gradients of ``h`` and ``w`` under bf16 autocast."""
    import torch

    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = fn(h, w, t, chunk)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _errors(fn, h, w, t, chunk, device):
    """Relative RMS of the loss and both gradients against fp64 autograd over the full logits."""
    import torch.nn.functional as F

    from benchmarks.harness import rms_ratio

    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.t(), t, ignore_index=-100, reduction="sum")
    ref.backward()
    got = _step(fn, h, w, t, chunk, device)
    return {name: rms_ratio(x, r) for name, x, r in (("loss", got[0], ref.detach()), ("dh", got[1], h64.grad),
                                                      ("dW", got[2], w64.grad))}


def measure(tokens, hidden, vocab, chunk, check_tokens, device, rep, warmup):
    """One row: baseline and ours medians in ms, peak memory and errors against fp64."""
    import torch

    from benchmarks.harness import Row, time_fn
    from k3infra.model.linear_ce import linear_cross_entropy_sum

    h, w, t = _inputs(tokens, hidden, vocab, device)
    small = _inputs(check_tokens, hidden, vocab, device, seed=1)
    variants = {"baseline": checkpointed_pieces, "ours": linear_cross_entropy_sum}
    timings, peaks, errors = {}, {}, {}
    for name, fn in variants.items():
        errors[name] = _errors(fn, *small, chunk, device)
        run = functools.partial(_step, fn, h, w, t, chunk, device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        timings[name] = time_fn(run, device=device, rep=rep, warmup=warmup)
        logger.info("%s: %.3f ms, peak %s MiB, errors %s", name, timings[name].median_ms, peaks.get(name), errors[name])
    extra = {"baseline_p80_ms": timings["baseline"].p80_ms, "ours_p80_ms": timings["ours"].p80_ms}
    for name in variants:
        if name in peaks:
            extra[f"{name}_peak_MiB"] = peaks[name]
        extra.update({f"{name}_{k}_rel_rms": v for k, v in errors[name].items()})
    return Row(case=f"lm-loss-N{tokens}-D{hidden}-V{vocab}-chunk{chunk}-fwd+bwd",
               baseline="checkpointed pieces (F.cross_entropy on fp32 logits, recomputed in backward)",
               baseline_ms=timings["baseline"].median_ms, ours_ms=timings["ours"].median_ms,
               params={"tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk": chunk, "dtype": "bf16 autocast",
                       "check_tokens": check_tokens},
               extra=extra, note="" if device == "cuda" else "CPU dry run: timing meaningless")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768, help="tokens (default 32768, a k3-mini micro-batch of 8)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=4096, help="tokens per piece (the model's loss_chunk_size)")
    p.add_argument("--check-tokens", type=int, default=512, help="tokens of the fp64 accuracy check")
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter; writes no file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
        from k3infra.model import fused

        fused.MODE = "on"
        row = measure(40, 16, 300, 16, 24, "cpu", rep=1, warmup=0)
        worst = max(v for k, v in row.extra.items() if k.startswith("ours_") and k.endswith("_rel_rms"))
        if worst > 2e-2:
            logger.error("ours errs %.2e against fp64", worst)
            return 1
        logger.info("dry run: ours within %.1e of fp64; nothing written", worst)
        return 0
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA device (use --dry-run on the CPU)")
    from benchmarks.harness import write_results

    row = measure(args.tokens, args.hidden, args.vocab, args.chunk, args.check_tokens, "cuda", args.rep, args.warmup)
    path = write_results("train-loss", [row], title="K3 training loss through the LM head (bf16 autocast)")
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
