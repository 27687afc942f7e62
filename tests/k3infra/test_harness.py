import json

import pytest

from benchmarks.harness import Row, Timing, markdown_table, time_fn, time_interleaved, write_results


def test_timing_quantiles_are_ordered():
    t = Timing.from_samples([5.0, 1.0, 3.0, 2.0, 4.0])
    assert t.median_ms == 3.0
    assert t.p20_ms <= t.median_ms <= t.p80_ms <= t.p99_ms
    assert t.n == 5


def test_timing_rejects_empty_samples():
    with pytest.raises(ValueError, match="samples_ms"):
        Timing.from_samples([])


def test_time_fn_counts_repetitions_after_warmup():
    calls = []
    t = time_fn(lambda: calls.append(1), warmup=2, rep=7)
    assert len(calls) == 9
    assert t.n == 7


def test_time_interleaved_alternates_the_order_and_drops_warmup_rounds():
    order = []

    def prepare(name):
        order.append(name)
        return lambda: None

    timings = time_interleaved(prepare, ("a", "b", "c"), device="cpu", rounds=3, warmup_rounds=1)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert set(timings) == {"a", "b", "c"} and all(isinstance(t, Timing) for t in timings.values())
    assert all(t.median_ms >= 0 for t in timings.values())


def test_write_results_records_machine_and_both_sides(tmp_path):
    rows = [
        Row("n=10", "loop", 2.0, 0.5, params={"n": 10}, extra={"GB/s": 1.5}),
        Row("n=20", "loop", None, 0.7, note="baseline not installed"),
    ]
    md = tmp_path / "BENCHMARKS.md"
    path = write_results("unit", rows, results_dir=tmp_path, markdown=md)
    payload = json.loads(path.read_text())
    assert payload["component"] == "unit"
    for key in ("commit", "date", "device", "torch", "python"):
        assert key in payload["machine"]
    assert payload["rows"][0]["speedup"] == 4.0
    assert payload["rows"][1]["baseline_ms"] is None
    text = md.read_text()
    assert "4.00x" in text and "| n=20 | 0.7 | baseline not installed |" in text
    write_results("unit", rows[:1], results_dir=tmp_path, markdown=md)
    assert md.read_text().count("<!-- bench:unit -->") == 1


def test_markdown_table_has_one_line_per_row():
    table = markdown_table([Row("a", "b", 1.0, 1.0), Row("c", "d", 2.0, 1.0)])
    assert len(table.splitlines()) == 4
