"""Speed-up charts for BENCHMARKS.md and the README: one PNG per library, one bar per compared row.

A bar is ``baseline ms / ours ms`` of one row of the chosen results files (log scale, 1x marked), coloured by
the baseline it was measured against, so every baseline of a library reads off one picture.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import Row

LIBRARIES = {"kda": "FlashKDA", "ep": "MoonEP", "env": "AgentEnv"}
"""Result-component prefix -> the library its chart is titled by."""


def library_of(component: str) -> str:
    """``kda-train`` -> ``kda``: the library a results component belongs to."""
    return component.split("-", 1)[0]


def speedup_chart(library: str, sections: list[tuple[str, list[Row]]], path: Path) -> Path | None:
    """Draw the chart of `library` from ``(component, rows)`` pairs into `path` (PNG).

    Returns:
        `path`, or None when no row of the sections has a baseline (nothing to draw; no file written).
    """
    bars = [(f"{component}: {r.case}", r.speedup, r.baseline) for component, rows in sections for r in rows
            if r.speedup is not None]
    if not bars:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baselines = list(dict.fromkeys(b for _, _, b in bars))
    colours = {b: plt.get_cmap("tab10")(i % 10) for i, b in enumerate(baselines)}
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.24 * len(bars)))
    ys = range(len(bars))[::-1]
    drawn = ax.barh(list(ys), [s for _, s, _ in bars], color=[colours[b] for _, _, b in bars], log=True)
    ax.bar_label(drawn, labels=[f"{s:.2f}x" for _, s, _ in bars], fontsize=6, padding=2)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(ys), [label for label, _, _ in bars], fontsize=7)
    ax.set_xlabel("speed-up over the baseline (baseline ms / ours ms; log scale, > 1 = ours faster)")
    ax.set_title(f"{LIBRARIES.get(library, library)}: speed-up over each baseline (same run)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[b]) for b in baselines]
    ax.legend(handles, [b if len(b) <= 60 else b[:57] + "..." for b in baselines], fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.9 / (1.2 + 0.24 * len(bars))), ncol=1, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path
