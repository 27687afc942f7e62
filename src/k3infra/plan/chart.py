"""PNG memory-breakdown chart: one stacked bar per plan, the usable memory as a line."""

from __future__ import annotations

from pathlib import Path

from k3infra.plan.search import PlanResult

__all__ = ["memory_chart"]

GB = 1e9


def memory_chart(result: PlanResult, path: str | Path, *, top: int = 8) -> Path:
    """Write a stacked-bar chart of the per-GPU memory terms of the ``top`` plans (feasible first, else the
    closest misses) to ``path`` (PNG).

    Raises:
        ValueError: no plan was evaluated (nothing to draw), or ``path`` does not end in ``.png``.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--png must name a .png file, got {str(path)!r}")
    plans = (result.feasible or sorted(result.plans, key=lambda p: p.peak))[:top]
    if not plans:
        raise ValueError(f"--png: no layout was evaluated ({result.reason()}), nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in plans[0].memory if k not in ("total", "stage") and any(p.memory[k] > 0 for p in plans)]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(plans) + 3), 5))
    labels = [f"{p.layout.label()}\n{p.layout.recompute}" for p in plans]
    bottom = [0.0] * len(plans)
    for key in keys:
        values = [p.memory[key] / GB for p in plans]
        ax.bar(range(len(plans)), values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(result.usable / GB, color="black", linestyle="--", label="usable")
    ax.set_xticks(range(len(plans)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GB per GPU (peak pipeline stage)")
    ax.set_title(f"{result.kind} {result.model.name} on {result.cluster.name}")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
