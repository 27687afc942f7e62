"""What the residual sources' dtype under bf16 autocast costs in gradient precision: the whole model's gradients
against the same model in fp64, with the embedding entering the AttnRes sources in the autocast dtype (ours,
`K3Model._embed`) or left in fp32 (the baseline: every AttnRes output, norm and projection input then fp32).

Runs on the CPU (CPU bf16 autocast; the precision question does not need a GPU): ``k3-debug`` with ``--layers``
decoder layers, fp32 parameters, one batch of ``--rows`` x ``--seq-len`` tokens per seed. Routing is made
independent of precision (router weights zero, distinct selection biases), so both sides and the fp64 reference
route every token to the same experts and the gradients are comparable. Per seed: the relative error
``‖g - g64‖ / ‖g64‖`` of all gradients together, of the embedding's, and the median over parameter tensors.

Usage: ``python -m benchmarks.train.residual_precision [--seeds 3] [--layers 8]``; JSON goes to
``benchmarks/results/train-residual-precision-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import sys

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def fp32_embedding_source():
    """The baseline: `K3Model._embed` returning the embedding in its own dtype (fp32) under autocast."""
    from k3infra.model import modeling

    ours = modeling.K3Model._embed
    modeling.K3Model._embed = lambda self, input_ids: self.embed_tokens(input_ids)
    try:
        yield
    finally:
        modeling.K3Model._embed = ours


def _gradients(model, ids, autocast: bool):
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}


def _errors(grads: dict, ref: dict) -> dict:
    import torch

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp(min=1e-30))

    per_tensor = sorted(rel(grads[n], ref[n]) for n in ref)
    everything = rel(torch.cat([grads[n].flatten() for n in ref]), torch.cat([ref[n].flatten() for n in ref]))
    return {"all_grads_rel": everything, "embedding_rel": rel(grads["model.embed_tokens.weight"],
                                                               ref["model.embed_tokens.weight"]),
            "median_tensor_rel": per_tensor[len(per_tensor) // 2]}


def measure(seed: int, layers: int, rows: int, seq_len: int):
    """One `benchmarks.harness.Row`: both sides' gradient errors against fp64 for one seed."""
    import torch

    from benchmarks.harness import Row
    from k3infra.model import K3Config, K3ForCausalLM

    torch.manual_seed(seed)
    config = K3Config.from_preset("k3-debug", num_hidden_layers=layers)
    model = K3ForCausalLM(config)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("router.bias"):
                buf.copy_(torch.randperm(buf.numel()).float() * 0.01)
        for name, param in model.named_parameters():
            if name.endswith("router.weight"):
                param.zero_()
            elif param.dim() == 1:  # norms and AttnRes queries away from their initial values
                param.add_(0.05 * torch.randn_like(param))
    ids = torch.randint(0, config.vocab_size, (rows, seq_len))
    ref = _gradients(copy.deepcopy(model).double(), ids, autocast=False)
    ours = _errors(_gradients(model, ids, autocast=True), ref)
    with fp32_embedding_source():
        baseline = _errors(_gradients(model, ids, autocast=True), ref)
    extra = {f"baseline_{k}": v for k, v in baseline.items()} | {f"ours_{k}": v for k, v in ours.items()}
    return Row(case=f"k3-debug-L{layers}-{rows}x{seq_len}-seed{seed}", baseline="fp32 embedding source",
               baseline_ms=None, ours_ms=None,
               params={"seed": seed, "layers": layers, "rows": rows, "seq_len": seq_len, "autocast": "cpu bf16"},
               extra=extra, note="gradient error against fp64, not a timing")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="independent models and batches (default 3)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of k3-debug (default 8)")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--no-write", action="store_true", help="print only; write no results JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from benchmarks.harness import machine_info, write_results

    rows = []
    for i in range(args.seeds):
        row = measure(100 + i, args.layers, args.rows, args.seq_len)
        logger.info("%s: all grads %.4f (fp32 source %.4f), embedding %.4f (%.4f)", row.case,
                    row.extra["ours_all_grads_rel"], row.extra["baseline_all_grads_rel"],
                    row.extra["ours_embedding_rel"], row.extra["baseline_embedding_rel"])
        rows.append(row)
    if not args.no_write:
        path = write_results("train-residual-precision", rows, title="Residual sources' dtype: gradient error vs fp64",
                             info=machine_info())
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
