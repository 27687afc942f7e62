"""Planner check on any device: bytes of tensors autograd saves in one forward of ``K3ForCausalLM`` vs the
planner's activation terms (``activations + attn_res + logits``, no recompute, one micro-batch), per module kind.

Saved tensors are counted once per storage through `torch.autograd.graph.saved_tensors_hooks`, parameters
excluded, and charged to the innermost module running when they were saved (KDA, MLA, MoE, dense FFN, AttnRes
site, the decoder's pre-norms, the LM head and loss). This is what the model keeps for backward, not the
allocator's peak (no optimizer, no transient workspaces); ``memory_check.py`` measures the peak on a GPU.

    python -m benchmarks.plan.saved_tensors --device cpu --seq 256 --batch 1
"""

from __future__ import annotations

import argparse
from collections import Counter

from benchmarks.harness import Row, write_results
from k3infra.model.config import K3Config
from k3infra.plan import Layout, TrainWorkload, model_from_k3, train_memory

GB = 1e9
KINDS = {"K3KDA": "kda", "K3MLA": "mla", "K3MoE": "moe", "SiTUGLU": "dense", "AttnResSite": "attn_res",
         "RMSNorm": "norm", "Linear": "linear", "Embedding": "embedding"}  # fmt: skip


def saved_bytes(model, input_ids, torch, **kwargs) -> tuple[int, Counter, Counter]:
    """Bytes of the distinct non-parameter storages saved for backward in one forward, by ``(shape, dtype)`` and
    by module kind (the innermost `KINDS` module that was running; ``head`` outside every module)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    kinds: Counter = Counter()
    by_module: Counter = Counter()
    stack: list[str] = []
    outer = {"dense", "moe", "kda", "mla", "attn_res"}

    def push(kind):
        return lambda *_: stack.append(kind)

    def pop(*_):
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        kind = KINDS.get(type(module).__name__)
        if kind is None:
            continue
        if kind == "linear" and name.endswith("lm_head"):
            kind = "head"
        handles += [module.register_forward_pre_hook(push(kind)), module.register_forward_hook(pop)]

    def owner() -> str:
        for kind in reversed(stack):  # a norm or linear inside a mixer / FFN belongs to it
            if kind in outer:
                return kind
        return stack[-1] if stack else "head"

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            kinds[(tuple(t.shape), str(t.dtype).replace("torch.", ""))] += seen[key]
            by_module[owner()] += seen[key]
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=input_ids, labels=input_ids, **kwargs)
    finally:
        for h in handles:
            h.remove()
    del out
    return sum(seen.values()), kinds, by_module


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="k3-mini", choices=("k3-mini", "k3-debug"), help="preset to build")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--kda-backend", default=None,
                        help="default: torch on cpu, auto on cuda (flashkda on cpu needs TRITON_INTERPRET=1)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results JSON")
    args = parser.parse_args(argv)
    from k3infra.model import K3ForCausalLM

    backend = args.kda_backend or ("torch" if args.device == "cpu" else "auto")
    config = K3Config.from_preset(args.model, kda_backend=backend)
    torch.manual_seed(0)
    model = K3ForCausalLM(config).to(args.device)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    model.train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    total, kinds, by_module = saved_bytes(model, ids, torch)
    tokens = args.seq * args.batch
    work = TrainWorkload(seq_len=args.seq, global_batch_tokens=tokens, micro_batch=args.batch)
    pred = train_memory(model_from_k3(config), Layout(zero=0), work, 1)
    predicted = pred["activations"] + pred["attn_res"] + pred["logits"]
    top = [f"{list(s)} {d}: {b / 1e6:.1f} MB" for (s, d), b in kinds.most_common(8)]
    per_kind = {k: round(v / tokens, 1) for k, v in by_module.most_common()}
    print(f"{args.model} T={args.seq} B={args.batch} on {args.device}: saved {total / 1e6:.1f} MB "
          f"({total / tokens / 1e3:.1f} KB/token); planner {predicted / 1e6:.1f} MB "
          f"({predicted / tokens / 1e3:.1f} KB/token)")  # fmt: skip
    print("saved bytes per token by module kind (all layers):", per_kind)
    print("largest saved kinds:\n  " + "\n  ".join(top))
    if not args.no_write:
        row = Row(
            case=f"{args.model}-T{args.seq}-B{args.batch}-{args.device}-{backend}",
            baseline="planner activations+logits",
            baseline_ms=None, ours_ms=0.0,
            params={"model": args.model, "seq": args.seq, "batch": args.batch, "device": args.device,
                    "kda_backend": config.kda_backend, "largest_saved": top},
            extra={"saved_mb": round(total / 1e6, 1), "predicted_mb": round(predicted / 1e6, 1),
                   "ratio": round(total / predicted, 2), "saved_bytes_per_token_by_kind": per_kind},
            note="bytes saved for backward (not the allocator peak); no time measured",
        )  # fmt: skip
        print(write_results("plan-saved", [row], title="planner: saved activations vs the model's saved tensors"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
