"""Throughput, MFU, TensorBoard and the loss/MFU figure."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
}
"""Dense bf16 tensor-core peak per GPU (vendor data sheets, no sparsity), matched as a substring of the name."""


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of one ``device``; ``None`` for the CPU or an unknown GPU (MFU is then "n/a")."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    logger.warning("no peak FLOP/s known for %r: MFU is reported as n/a", name)
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None, num_devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1]: ``flops_per_token · tokens_per_s / (num_devices · peak)``."""
    if peak is None or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (num_devices * peak)


class PhaseClock:
    """Times consecutive phases of a step on ``device``'s timeline: CUDA events on a GPU (no synchronisation
    until `spans_ms`), ``time.perf_counter`` on the CPU. ``mark()`` ends one phase and starts the next."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (waits for the GPU to reach the last one)."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def format_mfu(value: float | None) -> str:
    """``"41.3%"`` or ``"n/a"``."""
    return "n/a" if value is None else f"{100 * value:.1f}%"


class TensorBoardLogger:
    """Scalars to ``<out>/tensorboard`` (only constructed on rank 0)."""

    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float | None]) -> None:
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def plot_curves(history: list[dict], path: Path, *, unigram_entropy: float, uniform_entropy: float) -> Path:
    """Write the loss (with the ln V and unigram-entropy lines) and MFU/tokens-per-second curves as a PNG.

    Args:
        history: one dict per step with ``step``, ``loss``, ``tokens_per_s`` and ``mfu`` (float or None).
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [h["loss"] for h in history], label="train loss")
    ax_loss.axhline(uniform_entropy, color="grey", linestyle=":", label=f"ln V = {uniform_entropy:.2f}")
    ax_loss.axhline(unigram_entropy, color="red", linestyle="--", label=f"unigram entropy = {unigram_entropy:.2f}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    mfus = [h["mfu"] for h in history]
    if any(m is not None for m in mfus):
        ax_speed.plot(steps, [100 * (m or 0.0) for m in mfus], color="green")
        ax_speed.set_ylabel("MFU (%)")
    else:
        ax_speed.plot(steps, [h["tokens_per_s"] for h in history], color="green")
        ax_speed.set_ylabel("tokens/s (MFU n/a on this device)")
    ax_speed.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
