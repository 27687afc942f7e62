"""`benchmarks.table`: BENCHMARKS.md sections come from chosen results files and nothing else changes."""

import json

import pytest

from benchmarks.harness import Row, write_results
from benchmarks.table import main


def test_table_replaces_only_the_sections_of_the_given_files(tmp_path):
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\nhand-written intro\n")
    path = write_results("unit", [Row("a", "base", 2.0, 1.0, extra={"x": 1})], results_dir=tmp_path)
    assert md.read_text() == "# Benchmarks\n\nhand-written intro\n"  # writing results alone touches no table
    assert main([str(path), "--markdown", str(md), "--brief", "--no-charts"]) == 0
    text = md.read_text()
    assert "hand-written intro" in text and "| a | 2 | 1 | 2.00x |" in text and "Baseline: base." in text
    assert path.name in text
    assert main([str(path), "--markdown", str(md), "--charts", str(tmp_path)]) == 0
    assert md.read_text().count("<!-- bench:unit -->") == 1


def test_table_refuses_a_file_that_is_not_a_result(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a results file"):
        main([str(bad), "--markdown", str(tmp_path / "B.md"), "--no-charts"])
