"""`agentenv view RUN_DIR`: one self-contained HTML page of a post-training run (no scripts, no external files).

It shows the held-out success of the scripted solver (ceiling), SFT and GRPO, success and reward over training
as inline SVG, and per GRPO group the fork tree (parent sandbox -> children) with each child's tool calls,
observations and reward. Reads ``metrics.jsonl`` and ``groups.jsonl`` written by `agentenv.posttrain.train.run`.
"""

from __future__ import annotations

import html
import json
import os

_STYLE = """body{font:14px sans-serif;margin:1.5em;max-width:1100px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 6px}.ok{color:#070}.bad{color:#a00}.tree{margin-left:1em}
.child{border-left:3px solid #ccc;margin:4px 0 4px 1em;padding-left:6px}.child.ok{border-color:#0a0}
code{background:#f4f4f4}details{margin:6px 0}"""


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _svg(points: list[tuple[float, float]], title: str, width: int = 420, height: int = 140) -> str:
    """A line chart of ``(x, y)`` with y in [0, 1]."""
    if not points:
        return f"<p>{html.escape(title)}: no data</p>"
    x_max = max(x for x, _ in points) or 1
    coords = " ".join(f"{20 + (width - 30) * x / x_max:.1f},{height - 15 - (height - 30) * min(1, max(0, y)):.1f}"
                      for x, y in points)
    return (f'<figure><figcaption>{html.escape(title)}</figcaption><svg class="curve" data-points="{len(points)}" '
            f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fafafa" stroke="#ccc"/>'
            f'<polyline fill="none" stroke="#36c" stroke-width="2" points="{coords}"/></svg></figure>')


def _rate(value: float | None) -> str:
    return "not run" if value is None else f"{value:.3f}"


def _child(index: int, child: dict) -> str:
    ok = child["reward"] >= 1.0
    steps = "".join(f"<li><code>{html.escape(a)}</code> &rarr; <samp>{html.escape(o)}</samp></li>"
                    for a, o in zip(child["actions"], child["observations"]))
    return (f'<div class="child {"ok" if ok else "bad"}" data-reward="{child["reward"]}">child {index} '
            f'<small>{html.escape(str(child.get("trajectory_id")))}</small> reward '
            f'<b class="reward">{child["reward"]:g}</b><ol class="steps">{steps}</ol></div>')


def render(run_dir: str | os.PathLike) -> str:
    """The page's HTML for `run_dir`.

    Raises:
        FileNotFoundError: `run_dir` has no ``metrics.jsonl``.
    """
    run_dir = os.fspath(run_dir)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise FileNotFoundError(f"run_dir: {run_dir} has no metrics.jsonl (not a post-training run directory)")
    metrics, groups = _rows(metrics_path), _rows(os.path.join(run_dir, "groups.jsonl"))
    sft = next((r for r in metrics if r["phase"] == "sft"), {})
    final = next((r for r in metrics if r["phase"] == "final"), {})
    grpo = [r for r in metrics if r["phase"] == "grpo"]
    summary = "".join(f'<tr><th>{name}</th><td id="{key}">{_rate(value)}</td></tr>'
                      for name, key, value in [("scripted solver (ceiling)", "solver", sft.get("solver_success")),
                                               ("after SFT", "sft", sft.get("heldout_success")),
                                               ("after GRPO", "grpo", final.get("heldout_success"))])
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>run {html.escape(os.path.basename(run_dir))}"
             f"</title><style>{_STYLE}</style></head><body><h1>Post-training run</h1>",
             f'<section id="summary"><h2>Held-out success</h2><table>{summary}</table></section>',
             '<section id="curves"><h2>Training</h2>',
             _svg([(r["iter"], r["train_success"]) for r in grpo], "success over training (train groups)"),
             _svg([(r["iter"], r["reward"]) for r in grpo], "mean reward over training"),
             _svg([(r["iter"], r.get("env_share", 0.0)) for r in grpo], "environment share of iteration time"),
             "</section>", f'<section id="groups"><h2>GRPO groups ({len(groups)})</h2>']
    for g in groups:
        rewards = [c["reward"] for c in g["children"]]
        kids = "".join(_child(i, c) for i, c in enumerate(g["children"]))
        parts.append(f'<details class="group" data-iter="{g["iter"]}"><summary>iter {g["iter"]} group {g["group"]}: '
                     f'<code>{html.escape(g["task_id"])}</code> success {sum(r >= 1 for r in rewards)}/{len(rewards)}'
                     f'</summary><p>{html.escape(g["instruction"])}</p><div class="tree">parent '
                     f'<small>{html.escape(str(g.get("parent")))}</small> forked into {len(rewards)}:{kids}</div>'
                     f'</details>')
    parts.append("</section></body></html>")
    return "".join(parts)


def write_view(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> str:
    """Write the page (default ``RUN_DIR/view.html``); returns its path."""
    out = os.fspath(out) if out is not None else os.path.join(os.fspath(run_dir), "view.html")
    text = render(run_dir)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out
