"""`k3infra bench`: a run writes JSON only; BENCHMARKS.md changes only with --update-table; its tables are narrow
and its charts exist."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import MAX_COLUMNS, Row, markdown_table, write_results
from benchmarks.table import main as table_main

ROOT = Path(__file__).resolve().parents[2]


def _k3infra(*argv: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "k3infra.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_bench_without_update_table_leaves_benchmarks_md_byte_identical(tmp_path):
    before = _digest(ROOT / "BENCHMARKS.md")
    run = _k3infra("bench", "smoke", "--results-dir", str(tmp_path), "--json", "--", "--n", "2000")
    assert run.returncode == 0, run.stderr
    written = json.loads(run.stdout)
    assert len(written) == 1 and written[0]["component"] == "smoke" and written[0]["rows"][0]["ours_ms"] > 0
    assert [p.name for p in tmp_path.glob("smoke-*.json")] == [Path(written[0]["file"]).name]
    assert _digest(ROOT / "BENCHMARKS.md") == before


def test_update_table_regenerates_the_section_and_chart_from_chosen_files(tmp_path):
    rows = [Row("a", "loop", 2.0, 1.0, extra={"GB/s": 3.0, "only-a": 1}),
            Row("b", "loop", 3.0, 1.0, extra={"GB/s": 4.0}), Row("c", "none", None, 5.0)]
    path = write_results("kda-unit", rows, results_dir=tmp_path)
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\nintro\n")
    assert table_main([str(path), "--markdown", str(md), "--charts", str(tmp_path / "img")]) == 0
    text = md.read_text()
    assert "intro" in text and "| a | 2 | 1 | 2.00x | 3 |" in text and "only-a" not in text
    assert "not run" not in text and "| c | 5 |" in text
    assert (tmp_path / "img" / "bench-kda.png").read_bytes()[:4] == b"\x89PNG"


def test_markdown_table_caps_columns_and_names_unmeasured_rows():
    extra = {f"x{i}": float(i) for i in range(20)}
    table = markdown_table([Row("a", "b", 2.0, 1.0, extra=extra, note="n"), Row("z", "b", 1.0, None)])
    widths = {line.count("|") - 1 for line in table.splitlines() if line.startswith("|")}
    assert widths == {MAX_COLUMNS} and table.endswith("Not run: z.")


def test_markdown_table_shows_measurements_that_are_not_times_headline_first():
    errors = {"emulation dq": 1e-3, "ours dq": 2e-3, "fla dq": 3e-3, "curve": [1.0, 2.0]}
    rows = [Row("e1", "fla vs fp64", None, None, extra=errors, note="errors"),
            Row("e2", "fla vs fp64", None, None, extra={**errors, "ours dq": 4e-3}, note="errors"),
            Row("gone", "fla vs fp64", None, None)]
    table = markdown_table(rows, headline=("fla dq", "ours dq", "absent"))
    assert "Baseline: fla vs fp64." in table and table.endswith("Not run: gone.")
    assert "| case | fla dq | ours dq | emulation dq | note |" in table
    assert "| e2 | 0.003 | 0.004 | 0.001 | errors |" in table and "curve" not in table


def _tables(text: str) -> list[list[str]]:
    return [line.strip().strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]


def test_committed_benchmarks_md_is_narrow_without_filler_and_its_charts_exist():
    text = (ROOT / "BENCHMARKS.md").read_text()
    rows = _tables(text)
    assert rows and max(len(r) for r in rows) <= MAX_COLUMNS
    assert not [r for r in rows if any(cell.strip() == "not run" for cell in r)]
    images = re.findall(r"\]\((docs/img/[\w.-]+\.png)\)", text)
    assert images and all((ROOT / p).is_file() for p in images)
    readme = (ROOT / "README.md").read_text()
    assert all(p in readme for p in images)
    for name in re.findall(r"`benchmarks/results/([\w.-]+\.json)`", text):
        assert (ROOT / "benchmarks" / "results" / name).is_file(), name


def test_progress_passes_every_item_through_and_is_off_when_quiet(monkeypatch):
    from benchmarks import progress

    monkeypatch.setenv("K3INFRA_QUIET", "1")
    assert not progress.enabled()
    assert list(progress.track(iter(range(5)), "quiet")) == [0, 1, 2, 3, 4]
