"""Pre-training demo: k3-debug on the Python standard library for a few dozen steps (about a minute on 2 cores).

Checks that the loss falls from about ln V and reports where it ends against the corpus unigram entropy, plus
tokens/s, MFU (n/a on the CPU) and the path of the loss/MFU figure.
"""

from __future__ import annotations

from k3infra.demos import DemoRow

STEPS = 40


def run(device: str) -> list[DemoRow]:
    import k3infra.model

    if not hasattr(k3infra.model, "K3ForCausalLM"):
        return [DemoRow("train", "-", "skipped: k3infra.model has no K3ForCausalLM in this checkout", True)]
    from k3infra.train import TrainConfig, train
    from k3infra.train.metrics import format_mfu

    cfg = TrainConfig(preset="k3-debug", steps=STEPS, seq_len=64, batch_size=8, lr=2e-2, out="runs/k3-debug-demo",
                      device="cuda" if device == "cuda" else "cpu", progress=False, tensorboard=True)
    result = train(cfg)
    first, last = result.history[0], result.history[-1]
    dropped = last["loss"] < first["loss"] - 0.5
    return [
        DemoRow("train", f"k3-debug {STEPS} steps, seq 64 x 8 rows",
                f"loss {first['loss']:.2f} -> {last['loss']:.2f} (ln V {result.uniform_entropy:.2f}, unigram "
                f"{result.unigram_entropy:.2f})", dropped),
        DemoRow("train", "throughput", f"{last['tokens_per_s']:,.0f} tok/s, MFU {format_mfu(last['mfu'])}", True),
        DemoRow("train", "loss/MFU curve", str(result.curve), result.curve is not None and result.curve.is_file()),
    ]
