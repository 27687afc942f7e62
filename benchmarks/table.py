"""Refresh BENCHMARKS.md from chosen results files: ``python -m benchmarks.table FILE.json [...]``.

The files of each component (the ``component`` field a benchmark wrote) replace that component's section, their
rows in the order given; nothing else in BENCHMARKS.md changes. Benchmarks themselves write only their JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness import Row, update_markdown

TITLES = {
    "kda-decode": "kda decode: fused_recurrent_kda vs fla",
    "kda-calibrate": "kda dispatch calibration (best other backend vs ours)",
    "kda-dispatch": "kda: fla chunk_kda with the FlashKDA hook on vs off",
}


def rows_of(payload: dict) -> list[Row]:
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in r.items() if k in fields}) for r in payload["rows"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="results JSON files (benchmarks/results/*.json)")
    parser.add_argument("--markdown", type=Path, default=None, help="the table file (default BENCHMARKS.md)")
    parser.add_argument("--brief", action="store_true", help="leave out the extra columns (keeps tables narrow)")
    args = parser.parse_args(argv)
    sections: dict[str, tuple[list[Row], dict, list[str]]] = {}
    for path in args.files:  # files of one component make one table, in the order given
        try:
            payload = json.loads(path.read_text())
            component, rows = payload["component"], rows_of(payload)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}: not a results file written by benchmarks.harness ({e})") from e
        if args.brief:
            for row in rows:
                row.extra = {}
        section = sections.setdefault(component, ([], payload["machine"], []))
        section[0].extend(rows)
        section[2].append(path.name)
    for component, (rows, machine, names) in sections.items():
        update_markdown(component, rows, machine, title=TITLES.get(component), markdown=args.markdown,
                        json_name="`, `benchmarks/results/".join(names))
        print(f"{component}: {len(rows)} rows from {', '.join(names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
