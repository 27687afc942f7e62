"""``k3infra train``: pre-train (or LoRA fine-tune) the K3-style model on an offline corpus.

Single process::

    k3infra train --config k3-debug --steps 200 --out runs/debug

Four processes, expert parallel over all four, FSDP over all four::

    torchrun --nproc-per-node 4 -m k3infra.cli train --config k3-debug --ep 4 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import logging

PRESETS = ("k3-debug", "k3-mini", "k3")


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--override must be a JSON object, got {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--override must be a JSON object, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `TrainConfig` field as an option."""
    add = parser.add_argument
    add("--config", default="k3-debug", help=f"model preset, one of {', '.join(PRESETS)} (default: k3-debug)")
    add("--steps", type=int, default=200, help="optimizer steps in total (a resumed run continues up to this)")
    add("--seq-len", type=int, default=None, help="tokens per packed row (default: 64 for k3-debug, 4096 k3-mini)")
    add("--batch-size", type=int, default=None,
        help="rows per step over all ranks, divisible by the world size (default: 8 for k3-debug, 64 k3-mini)")
    add("--micro-batch-size", type=int, default=None,
        help="rows per forward/backward on one rank, gradients accumulated (default: all for k3-debug, 4 k3-mini)")
    add("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    add("--lr", type=float, default=3e-3, help="peak learning rate of Muon and AdamW (cosine, 1%% warmup)")
    add("--weight-decay", type=float, default=0.1, help="decoupled weight decay of weight matrices")
    add("--optimizer", choices=("muon", "adamw"), default="muon",
        help="muon: Muon for 2-D weights + AdamW for embeddings/lm_head/router/norms; adamw: AdamW for all")
    add("--ep", type=int, default=1, help="expert-parallel size (MoonEP); must divide the world size and experts")
    add("--out", default="runs/k3-train", help="run folder: checkpoints/, tensorboard/, history.json, curve.png")
    add("--resume", default=None, help="checkpoint folder (or run folder: its newest checkpoint) to continue from")
    add("--init-from", default=None,
        help="checkpoint (or run folder) whose model weights start a new run at step 0, e.g. before --lora")
    add("--save-every", type=int, default=0, help="checkpoint every N steps (0: only after the last step)")
    add("--lora", type=int, default=0, metavar="RANK", help="LoRA fine-tuning with this rank through peft (0: off)")
    add("--router-lr-scale", type=float, default=0.0,
        help="with --lora: 0 freezes the router, > 0 trains it at lr times this")
    add("--activation-checkpointing", action="store_true", help="recompute each decoder layer in backward")
    add("--compile", nargs="?", const="layer", default=False, choices=("layer", "module"),
        help="torch.compile each decoder layer (inductor; Triton KDA/attention/MoonEP stay opaque); 'module': "
             "each child of a layer instead (fewer graphs to compile)")
    add("--qk-clip-tau", type=float, default=100.0, help="MuonClip threshold on MLA max logits (0: off)")
    add("--profile", default=None, metavar="START:COUNT",
        help="record optimizer steps START..START+COUNT-1 with torch.profiler: a Chrome trace and an operator "
             "table per rank in OUT/profile/, GPU kernels (CPU: aten operators) per step in the log")
    add("--rebalance-every", type=int, default=0, metavar="N",
        help="with --ep > 1: re-place the experts by their load history every N steps, moving them with their "
             "optimizer state (0: off)")
    add("--seed", type=int, default=0, help="seed of the initialisation and of the data order")
    add("--corpus", nargs="*", default=[],
        help="text/.py/.md files, JSONL ('text' field) or Parquet ('text' column), or folders "
             "(default: the Python standard library source)")
    add("--max-corpus-mb", type=float, default=16.0, help="read at most about this many MB of text (0: all)")
    add("--cache-dir", default=None, help="tokenizer and token cache (default: $K3INFRA_CACHE or ~/.cache/k3infra)")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when available")
    add("--override", type=_json_dict, default={},
        help='K3Config fields over the preset as JSON, e.g. \'{"kda_backend": "fla"}\'')
    add("--no-progress", action="store_true", help="no progress bar (one log line per step instead)")
    add("--no-tensorboard", action="store_true", help="do not write TensorBoard logs")
    add("--no-plot", action="store_true", help="do not write curve.png")


def config_from_args(args: argparse.Namespace):
    """The `TrainConfig` the options describe."""
    from k3infra.train.profiling import parse_profile_steps
    from k3infra.train.trainer import TrainConfig

    return TrainConfig(
        preset=args.config, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
        micro_batch_size=args.micro_batch_size, max_grad_norm=args.max_grad_norm,
        weight_decay=args.weight_decay, optimizer=args.optimizer, ep=args.ep, out=args.out, resume=args.resume,
        init_from=args.init_from,
        save_every=args.save_every, lora=args.lora, router_lr_scale=args.router_lr_scale,
        activation_checkpointing=args.activation_checkpointing, compile=args.compile, qk_clip_tau=args.qk_clip_tau,
        seed=args.seed,
        rebalance_every=args.rebalance_every,
        profile=None if args.profile is None else parse_profile_steps(args.profile),
        corpus=list(args.corpus), max_corpus_bytes=int(args.max_corpus_mb * 2**20) or None,
        cache_dir=args.cache_dir, device=args.device, progress=not args.no_progress,
        tensorboard=not args.no_tensorboard, plot=not args.no_plot, overrides=args.override,
    )


def cmd_train(args: argparse.Namespace) -> int:
    """Run `k3infra train`; print the summary (rank 0)."""
    from k3infra.train.metrics import format_mfu
    from k3infra.train.trainer import train

    logging.basicConfig(level=logging.INFO if args.no_progress else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        result = train(cfg)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"k3infra train: {error}") from None
    if not result.is_main or not result.history:
        return 0
    last = result.history[-1]
    print(f"steps {last['step']}  loss {result.history[0]['loss']:.3f} -> {last['loss']:.3f}  "
          f"(ln V {result.uniform_entropy:.3f}, corpus unigram entropy {result.unigram_entropy:.3f} nats/token)")
    print(f"tokens/s {last['tokens_per_s']:,.0f}  MFU {format_mfu(last['mfu'])}  forward+backward "
          f"{last['forward_backward_ms']:,.1f} ms, update {last['update_ms']:,.1f} ms (last step)"
          + (f"  peak memory {result.peak_memory_gib:.2f} GiB" if result.peak_memory_gib is not None else ""))
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    if cfg.tensorboard:
        print(f"tensorboard: {result.out / 'tensorboard'}")
    if result.curve is not None:
        print(f"curve: {result.curve}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` sub-command to ``k3infra``'s parser."""
    parser = sub.add_parser("train", help="pre-train or LoRA fine-tune the K3-style model (torchrun for several "
                            "processes)", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=cmd_train)
