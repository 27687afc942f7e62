"""Planner check on any device: bytes of tensors autograd saves in one forward of ``K3ForCausalLM`` vs the
planner's activation terms (``activations + attn_res + logits``, no recompute, one micro-batch).

Saved tensors are counted once per storage through `torch.autograd.graph.saved_tensors_hooks`, parameters
excluded. This is what the model keeps for backward, not the allocator's peak (no optimizer, no transient
workspaces); ``memory_check.py`` measures the peak on a GPU.

    python -m benchmarks.plan.saved_tensors --device cpu --seq 256 --batch 1
"""

from __future__ import annotations

import argparse
from collections import Counter

from benchmarks.harness import Row, write_results
from k3infra.model.config import K3Config
from k3infra.plan import Layout, TrainWorkload, model_from_k3, train_memory

GB = 1e9


def saved_bytes(model, input_ids, torch) -> tuple[int, Counter]:
    """Bytes of the distinct non-parameter storages saved for backward in one forward, and the largest kinds
    ``(shape, dtype) -> bytes``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    kinds: Counter = Counter()

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            kinds[(tuple(t.shape), str(t.dtype).replace("torch.", ""))] += seen[key]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=input_ids, labels=input_ids)
    del out
    return sum(seen.values()), kinds


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="k3-mini", choices=("k3-mini", "k3-debug"), help="preset to build")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results JSON")
    args = parser.parse_args(argv)
    from k3infra.model import K3ForCausalLM

    config = K3Config.from_preset(args.model, kda_backend="torch" if args.device == "cpu" else "auto")
    torch.manual_seed(0)
    model = K3ForCausalLM(config).to(args.device)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    model.train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    total, kinds = saved_bytes(model, ids, torch)
    tokens = args.seq * args.batch
    work = TrainWorkload(seq_len=args.seq, global_batch_tokens=tokens, micro_batch=args.batch)
    pred = train_memory(model_from_k3(config), Layout(zero=0), work, 1)
    predicted = pred["activations"] + pred["attn_res"] + pred["logits"]
    top = [f"{list(s)} {d}: {b / 1e6:.1f} MB" for (s, d), b in kinds.most_common(8)]
    print(f"{args.model} T={args.seq} B={args.batch} on {args.device}: saved {total / 1e6:.1f} MB "
          f"({total / tokens / 1e3:.1f} KB/token); planner {predicted / 1e6:.1f} MB "
          f"({predicted / tokens / 1e3:.1f} KB/token)")  # fmt: skip
    print("largest saved kinds:\n  " + "\n  ".join(top))
    if not args.no_write:
        row = Row(
            case=f"{args.model}-T{args.seq}-B{args.batch}-{args.device}", baseline="planner activations+logits",
            baseline_ms=None, ours_ms=0.0,
            params={"model": args.model, "seq": args.seq, "batch": args.batch, "device": args.device,
                    "kda_backend": config.kda_backend, "largest_saved": top},
            extra={"saved_mb": round(total / 1e6, 1), "predicted_mb": round(predicted / 1e6, 1),
                   "ratio": round(total / predicted, 2)},
            note="bytes saved for backward (not the allocator peak); no time measured",
        )  # fmt: skip
        print(write_results("plan-saved", [row], title="planner: saved activations vs the model's saved tensors"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
