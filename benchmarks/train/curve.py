"""Loss-curve parity: a small K3-style model (KDA layers + MoE, one MLA layer) trained for N steps with FlashKDA's
kernels against the same model with fla's, from the same weights on the same batches, next to fla from another
initialisation as the seed-noise yardstick.

Usage (one H200):  python -m benchmarks.train.curve [--steps 200]
CPU smoke:         python -m benchmarks.train.curve --device cpu --config k3-debug --override '{}' --steps 4 \
                       --seq-len 64 --batch-size 4 --corpus-mib 1 --no-write

The model is ``--config`` (default k3-mini) with ``--override`` (default: 4 layers, KDA at 1-3 and MLA at 4, so
the KDA layers are bf16, K = V = 128 and FlashKDA trains them through its v2 kernels on a Hopper GPU). Three runs
of the real trainer (`k3infra.train.Trainer`: Muon + AdamW, QK-Clip, Quantile Balancing): ``ours``
(``kda_backend="flashkda"``), ``fla`` (``"fla"``, same seed: same initial weights and batch order) and
``fla-seed`` (``"fla"``, the model initialised from ``--noise-seed``, same batches). Per pair: the mean absolute
difference of the EMA-smoothed losses over the last ``--window`` steps. The curves match when ours-vs-fla is no
larger than fla-vs-fla-seed. Writes ``benchmarks/results/train-curve-<date>.json`` (the three curves in the row)
and a PNG of the curves next to it. On the CPU every variant runs the torch KDA path (plumbing only).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import Row, machine_info, write_results
from k3infra.train.trainer import TrainConfig, Trainer, default_model_factory

DEFAULT_OVERRIDE = {"num_hidden_layers": 4,
                    "layer_types": ["linear_attention"] * 3 + ["full_attention"]}


def seeded_factory(seed: int):
    """A model factory that initialises the model from ``seed`` (the trainer's own seed still orders the data)."""
    def build(config):
        torch.manual_seed(seed)
        return default_model_factory(config)
    return build


def train_curve(cfg: TrainConfig, init_seed: int | None = None) -> list[float]:
    """Losses of ``cfg.steps`` trainer steps (the model from ``init_seed`` when given)."""
    trainer = Trainer(cfg, model_factory=None if init_seed is None else seeded_factory(init_seed))
    try:
        return [trainer.train_step(step)["loss"] for step in range(cfg.steps)]
    finally:
        trainer.state.close()


def ema(values: list[float], decay: float) -> list[float]:
    """Exponential moving average with bias correction (the first values are not pulled to zero)."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = decay * acc + (1 - decay) * v
        weight = decay * weight + (1 - decay)
        out.append(acc / weight)
    return out


def tail_gap(a: list[float], b: list[float], window: int, decay: float) -> float:
    """Mean |EMA(a) - EMA(b)| over the last ``window`` steps."""
    sa, sb = ema(a, decay), ema(b, decay)
    n = min(window, len(sa))
    return sum(abs(x - y) for x, y in zip(sa[-n:], sb[-n:])) / max(n, 1)


def plot(curves: dict[str, list[float]], decay: float, path: Path) -> Path:
    """The raw (faint) and smoothed losses of every run as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, losses in curves.items():
        steps = range(1, len(losses) + 1)
        line, = ax.plot(steps, ema(losses, decay), label=name)
        ax.plot(steps, losses, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-mini", help="model preset (default k3-mini)")
    p.add_argument("--override", default=json.dumps(DEFAULT_OVERRIDE), help="K3Config overrides (JSON)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the trainer's)")
    p.add_argument("--noise-seed", type=int, default=1, help="initialisation seed of the yardstick run")
    p.add_argument("--window", type=int, default=50, help="steps at the end over which the gaps are averaged")
    p.add_argument("--ema", type=float, default=0.9, help="smoothing of the curves (default 0.9)")
    p.add_argument("--corpus-mib", type=int, default=16, help="MiB of the offline corpus to tokenize (default 16)")
    p.add_argument("--no-write", action="store_true", help="print only (no results file, no PNG)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.window < 1 or not 0 <= args.ema < 1 or args.corpus_mib < 1:
        p.error("--steps must be >= 2, --window >= 1, --ema in [0, 1) and --corpus-mib >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible (use --device cpu for the smoke run)")
    override = json.loads(args.override)
    if not isinstance(override, dict):
        p.error(f"--override must be a JSON object, got {args.override!r}")
    backends = {"ours": "flashkda", "fla": "fla", "fla-seed": "fla"}
    if args.device == "cpu":
        backends = dict.fromkeys(backends, "torch")
    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as out:
        for name, backend in backends.items():
            extra = {} if args.lr is None else {"lr": args.lr}
            cfg = TrainConfig(preset=args.config, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
                              out=f"{out}/{name}", device=args.device, progress=False, tensorboard=False, plot=False,
                              max_corpus_bytes=args.corpus_mib << 20, cache_dir=f"{out}/cache",
                              overrides={**override, "kda_backend": backend}, **extra).resolved()
            curves[name] = train_curve(cfg, args.noise_seed if name == "fla-seed" else None)
            print(f"{name:9s} kda_backend={backend:9s} first {curves[name][0]:.4f}  last {curves[name][-1]:.4f}")
    gap = tail_gap(curves["ours"], curves["fla"], args.window, args.ema)
    noise = tail_gap(curves["fla-seed"], curves["fla"], args.window, args.ema)
    verdict = "within seed noise" if gap <= noise else "OUTSIDE seed noise"
    print(f"mean |EMA gap| over the last {min(args.window, args.steps)} steps: ours vs fla {gap:.4f}, "
          f"fla vs fla from seed {args.noise_seed} {noise:.4f}: {verdict}")
    if args.no_write:
        return 0
    row = Row(
        case=f"{args.config}-{override.get('num_hidden_layers', 'all')}L-T{args.seq_len}-B{args.batch_size}-"
             f"{args.steps}steps",
        baseline="fla kernels, same weights and batches", baseline_ms=None, ours_ms=None,
        params={"config": args.config, "override": override, "steps": args.steps, "seq_len": args.seq_len,
                "batch_size": args.batch_size, "lr": args.lr, "noise_seed": args.noise_seed, "window": args.window,
                "ema": args.ema, "device": args.device},
        extra={"gap_ours_fla": gap, "gap_fla_seed": noise, "within_seed_noise": gap <= noise, "curves": curves},
        note="loss curves, not a timing: ours = kda_backend flashkda; yardstick = fla from another initialisation"
             + ("; CPU: every run on the torch KDA path" if args.device == "cpu" else ""))
    path = write_results("train-curve", [row], title="K3 loss-curve parity (FlashKDA vs fla)", info=machine_info())
    png = plot(curves, args.ema, path.with_suffix(".png"))
    print(f"results: {path}\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
