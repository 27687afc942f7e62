"""``k3infra plan train|serve``: which parallel layouts fit a model on a cluster, and which is fastest.

Examples::

    k3infra plan train --model k3-mini --cluster 1xH200 --seq-len 4096 --global-batch-tokens 262144 --micro-batch 8
    k3infra plan train --model deepseek-v3 --cluster 2048xH800 --pp 16 --ep 64 --zero 1 --json
    k3infra plan serve --model k3 --cluster 16xH200 --context 1048576 --weight-dtype mxfp4 --png mem.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3infra.plan.cluster import GPUS
from k3infra.plan.workload import (
    CACHE_BYTES,
    OPTIMIZERS,
    OVERLAP,
    PRECISIONS,
    RECOMPUTE,
    WEIGHT_BYTES,
)

PRESETS = ("k3", "k3-mini", "k3-debug")
SHIPPED = tuple(sorted(p.stem for p in (Path(__file__).resolve().parent / "configs").glob("*.json")))

__all__ = ["add_plan_parser", "main"]


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 0, got {text!r}")
    return values


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="k3-mini",
                   help=f"preset {PRESETS}, shipped config {SHIPPED}, or a config.json path "
                        "(K3Config, DeepSeek-V3 / Kimi K2, Qwen3-MoE) (default: k3-mini)")
    p.add_argument("--cluster", default="8xH200",
                   help=f"'<count>x<GPU>' with GPU in {tuple(GPUS)} (8 per node; 64xH200 = 8 nodes), "
                        "'GB200 NVL72', or a cluster.yaml/json path (default: 8xH200)")
    for name, what in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline"), ("cp", "context")):
        p.add_argument(f"--{name}", type=_int_list, default=None,
                       help=f"{what}-parallel sizes to consider, comma-separated (default: every valid size)")
    p.add_argument("--redundant", type=_int_list, default=None,
                   help="MoonEP redundant expert slots per rank per MoE layer to consider (default: 0 and E/EP)")
    p.add_argument("--reserve", type=float, default=0.1,
                   help="fraction of GPU memory kept for CUDA context, fragmentation, workspaces (default 0.1)")
    p.add_argument("--efficiency", type=float, default=0.5,
                   help="fraction of the dense tensor-core peak a GEMM reaches, an assumption (default 0.5)")
    p.add_argument("--top", type=int, default=10, help="plans shown in the table and JSON (default 10)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the result as JSON to PATH, or to stdout when PATH is omitted (no table then)")
    p.add_argument("--png", default=None, metavar="PATH", help="write a memory-breakdown chart (PNG) to PATH")


def add_plan_parser(sub) -> argparse.ArgumentParser:
    """Add ``plan train|serve`` to a subparsers object (the ``k3infra`` command's)."""
    plan = sub.add_parser("plan", help="parallelism and memory planner for training and serving MoE models",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = plan.add_subparsers(dest="plan_kind", required=True)
    train = kinds.add_parser("train", help="plan a training run: layouts, per-GPU memory, traffic, step time")
    _common(train)
    train.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    train.add_argument("--global-batch-tokens", type=int, default=4096 * 64,
                       help="tokens per optimizer step, a multiple of --seq-len (default 262144)")
    train.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per DP rank (default 1)")
    train.add_argument("--precision", choices=PRECISIONS, default="bf16",
                       help="bf16, or fp8 GEMMs with 1-byte saved activations (default bf16)")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="muon", help="optimizer states (default muon)")
    train.add_argument("--recompute", choices=("auto", *RECOMPUTE), default="auto",
                       help="activation recompute policy; auto tries all three (default auto)")
    train.add_argument("--vp", type=_int_list, default=None, help="virtual pipeline stages to consider (default 1-4)")
    train.add_argument("--zero", type=_int_list, default=None,
                       help="ZeRO stages to consider: 0, 1 (optimizer), 2 (+grads), 3 (FSDP) (default all)")
    train.add_argument("--chunked-ce", action="store_true", help="cross-entropy over vocabulary chunks")
    train.add_argument("--overlap", choices=OVERLAP, default="dp",
                       help="communication hidden behind compute: none, dp (default), all (DualPipe-like)")
    train.add_argument("--ep-imbalance", type=float, default=1.0,
                       help="slowest EP rank's expert work / mean without MoonEP redundancy (default 1.0)")
    train.set_defaults(func=run_plan)
    serve = kinds.add_parser("serve", help="plan serving: weights, MLA/KDA cache, decode speed")
    _common(serve)
    serve.add_argument("--context", type=int, default=32768, help="tokens per sequence (default 32768)")
    serve.add_argument("--concurrency", type=int, default=1, help="sequences decoded together (default 1)")
    serve.add_argument("--cache-dtype", choices=tuple(CACHE_BYTES), default="bf16", help="MLA/KV cache dtype")
    serve.add_argument("--weight-dtype", choices=tuple(WEIGHT_BYTES), default="bf16",
                       help="routed-expert weight dtype (default bf16)")
    serve.add_argument("--dense-weight-dtype", choices=tuple(WEIGHT_BYTES), default="bf16",
                       help="dtype of every other weight (default bf16)")
    serve.add_argument("--prefill-chunk", type=int, default=8192, help="prefill chunk in tokens (default 8192)")
    serve.set_defaults(func=run_plan)
    return plan


def _request(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("func",) and not callable(v)}


def run_plan(args: argparse.Namespace) -> int:
    """Run the planner for parsed arguments; 0 when a layout fits, 1 when none does, 2 on bad input."""
    from k3infra.plan.chart import memory_chart
    from k3infra.plan.cluster import load_cluster
    from k3infra.plan.model import load_model
    from k3infra.plan.report import explain, table, to_json
    from k3infra.plan.search import SearchOptions, plan_serve, plan_train
    from k3infra.plan.workload import ServeWorkload, TrainWorkload

    try:
        if args.top < 1:
            raise ValueError(f"--top must be >= 1, got {args.top}")
        model, cluster = load_model(args.model), load_cluster(args.cluster)
        train = args.plan_kind == "train"
        opts = SearchOptions(
            tp=args.tp, ep=args.ep, pp=args.pp, cp=args.cp, redundant=args.redundant, reserve=args.reserve,
            efficiency=args.efficiency,
            **(dict(vp=args.vp, zero=args.zero, overlap=args.overlap, ep_imbalance=args.ep_imbalance,
                    recompute=None if args.recompute == "auto" else (args.recompute,)) if train else {}),
        )  # fmt: skip
        if train:
            work = TrainWorkload(seq_len=args.seq_len, global_batch_tokens=args.global_batch_tokens,
                                 micro_batch=args.micro_batch, precision=args.precision, optimizer=args.optimizer,
                                 chunked_ce=args.chunked_ce)  # fmt: skip
            result = plan_train(model, cluster, work, opts)
        else:
            work = ServeWorkload(context=args.context, concurrency=args.concurrency, cache_dtype=args.cache_dtype,
                                 weight_dtype=args.weight_dtype, dense_weight_dtype=args.dense_weight_dtype,
                                 prefill_chunk=args.prefill_chunk)  # fmt: skip
            result = plan_serve(model, cluster, work, opts)
        if args.png:
            memory_chart(result, args.png)
    except ValueError as error:
        print(f"k3infra plan {args.plan_kind}: error: {error}", file=sys.stderr)
        return 2
    if args.json is not None:
        text = json.dumps(to_json(result, top=args.top, request=_request(args)), indent=2)
        if args.json == "-":
            print(text)
        else:
            try:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
            except OSError as error:
                print(f"k3infra plan {args.plan_kind}: error: --json {args.json}: {error}", file=sys.stderr)
                return 2
    if args.json != "-":
        from rich.console import Console

        console = Console(width=max(Console().width, 140))
        console.print(table(result, top=args.top))
        console.print(explain(result, efficiency=args.efficiency))
    return 0 if result.best is not None else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3infra")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
