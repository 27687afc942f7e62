"""Refresh BENCHMARKS.md and its charts from chosen results files: ``python -m benchmarks.table FILE.json [...]``.

The files of each component (the ``component`` field a benchmark wrote) replace that component's section, their
rows in the order given; nothing else in BENCHMARKS.md changes. Then the speed-up chart of every library touched
is redrawn (``docs/img/bench-<library>.png``) from the results files all of that library's sections name, so
BENCHMARKS.md itself is the list of chosen files. Benchmarks write only their JSON; ``k3infra bench ...
--update-table`` calls this with the files its run wrote.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.charts import library_of, speedup_chart
from benchmarks.harness import BENCHMARKS_MD, RESULTS_DIR, ROOT, Row, update_markdown

CHARTS_DIR = ROOT / "docs" / "img"
TITLES = {  # for results files written before the harness stored a title
    "kda": "FlashKDA prefill (forward) vs fla",
    "kda-train": "FlashKDA training (forward + backward) vs fla",
    "kda-decode": "FlashKDA decode (fused_recurrent_kda) vs fla",
    "kda-calibrate": "FlashKDA dispatch calibration (best other backend vs ours)",
    "kda-dispatch": "fla chunk_kda with the FlashKDA hook on vs off",
    "ep": "MoonEP dispatch+combine, EP=2",
    "ep-local": "MoonEP local dispatch-path work (1 GPU, no communication)",
    "ep-placement": "MoonEP placement under drifting routing (simulated)",
    "env": "AgentEnv sandbox runtime",
    "env-server": "AgentEnv server: stock E2B SDK vs in-process SDK",
    "env-rl": "AgentEnv RL (environments, pool, server, fork rollouts)",
    "env-fuzz": "AgentEnv server under generated requests (schemathesis)",
    "env-soak": "AgentEnv soak: lifecycles with injected faults",
}
HEADLINES = {  # the extra columns a section shows first, where a component has more than fit
    "kda-v2": ("cutlass ms", "v2/cutlass speed-up", "k1 c32 ms", "k2 c32 ms", "rms(o) v2 vs fla",
               "rms(o) cutlass vs fla"),
    "kda-v2-bwd-precision": ("ours / fla worst tensor", "ours / fla worst ratio", "ours c16 dq", "fla dq",
                             "ours c16 dg", "fla dg", "ours c16 dA_log", "fla dA_log"),
    "train": ("mfu_ours", "mfu_baseline", "mfu_forward_backward_ours", "peak_memory_gib_ours"),
    "train-newton-schulz": ("baseline_err_vs_fp64", "ours_err_vs_fp64", "muon_ms", "flops"),
    "train-loss": ("baseline_peak_MiB", "ours_peak_MiB", "baseline_dh_rel_rms", "ours_dh_rel_rms",
                   "baseline_dW_rel_rms", "ours_dW_rel_rms"),
}
SECTION = re.compile(r"<!-- bench:(?P<component>[\w.-]+) -->(?P<body>.*?)<!-- /bench:(?P=component) -->", re.S)
RAW = re.compile(r"`benchmarks/results/([\w.-]+\.json)`")


def rows_of(payload: dict) -> list[Row]:
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in r.items() if k in fields}) for r in payload["rows"]]


def load(path: Path) -> tuple[str, dict, list[Row]]:
    """``(component, payload, rows)`` of a results file; SystemExit naming the file when it is not one."""
    try:
        payload = json.loads(path.read_text())
        return payload["component"], payload, rows_of(payload)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a results file written by benchmarks.harness ({e})") from e


def chosen_files(markdown: Path) -> dict[str, list[str]]:
    """Component -> the results file names its BENCHMARKS.md section was built from."""
    text = markdown.read_text() if markdown.exists() else ""
    raw_line = lambda body: next((line for line in body.splitlines() if line.startswith("raw:")), "")  # noqa: E731
    return {m["component"]: RAW.findall(raw_line(m["body"])) for m in SECTION.finditer(text)}


def redraw(library: str, markdown: Path, search: list[Path], charts_dir: Path) -> Path | None:
    """Redraw `library`'s chart from the files its sections in `markdown` name (looked up in `search`)."""
    sections = []
    for component, names in chosen_files(markdown).items():
        if library_of(component) != library:
            continue
        rows: list[Row] = []
        for name in names:
            found = next((d / name for d in search if (d / name).is_file()), None)
            if found is None:
                raise SystemExit(f"{markdown}: section {component} names {name}, which is in none of {search}")
            rows += load(found)[2]
        sections.append((component, rows))
    return speedup_chart(library, sections, charts_dir / f"bench-{library}.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="results JSON files (benchmarks/results/*.json)")
    parser.add_argument("--rebuild", action="store_true",
                        help="re-render every section from the files it already names (after a format change)")
    parser.add_argument("--markdown", type=Path, default=None, help="the table file (default BENCHMARKS.md)")
    parser.add_argument("--brief", action="store_true", help="leave out the extra columns (keeps tables narrow)")
    parser.add_argument("--charts", type=Path, default=None,
                        help="where the PNG charts go (default docs/img; with --markdown: img/ beside it)")
    parser.add_argument("--no-charts", action="store_true", help="update the tables only")
    args = parser.parse_args(argv)
    markdown = args.markdown or BENCHMARKS_MD
    if args.rebuild:
        args.files += [RESULTS_DIR / name for names in chosen_files(markdown).values() for name in names]
    if not args.files:
        parser.error("give results files, or --rebuild")
    sections: dict[str, tuple[list[Row], dict, list[str], str]] = {}
    for path in args.files:  # files of one component make one table, in the order given
        component, payload, rows = load(path)
        if args.brief:
            for row in rows:
                row.extra = {}
        title = payload.get("title") or TITLES.get(component, component)
        section = sections.setdefault(component, ([], payload["machine"], [], title))
        section[0].extend(rows)
        section[2].append(path.name)
    for component, (rows, machine, names, title) in sections.items():
        update_markdown(component, rows, machine, title=title, markdown=markdown,
                        json_name="`, `benchmarks/results/".join(names), headline=HEADLINES.get(component, ()))
        print(f"{component}: {len(rows)} rows from {', '.join(names)}")
    if not args.no_charts:
        search = list(dict.fromkeys([*(p.resolve().parent for p in args.files), RESULTS_DIR]))
        for library in sorted({library_of(c) for c in sections}):
            charts = args.charts or (CHARTS_DIR if markdown == BENCHMARKS_MD else markdown.parent / "img")
            chart = redraw(library, markdown, search, charts)
            print(f"chart {library}: {chart or 'no compared rows, none drawn'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
