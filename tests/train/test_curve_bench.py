"""`benchmarks.train.curve` on the CPU: three trainer runs, the gap arithmetic, the results file and the plot."""

import json

import pytest

from benchmarks.train import curve


def test_ema_and_tail_gap():
    assert curve.ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # bias-corrected: no pull to zero
    assert curve.ema([1.0, 3.0], 0.0) == [1.0, 3.0]
    assert curve.tail_gap([1.0, 1.0, 5.0], [1.0, 1.0, 1.0], window=1, decay=0.0) == 4.0
    assert curve.tail_gap([1.0, 2.0], [1.0, 2.0], window=10, decay=0.5) == 0.0


def test_cpu_run_writes_three_curves_and_a_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("K3INFRA_RESULTS_DIR", str(tmp_path))
    assert curve.main(["--device", "cpu", "--config", "k3-debug", "--override", "{}", "--steps", "3", "--seq-len",
                       "32", "--batch-size", "2", "--corpus-mib", "1", "--window", "2"]) == 0
    [path] = tmp_path.glob("train-curve-*.json")
    row = json.loads(path.read_text())["rows"][0]
    curves = row["extra"]["curves"]
    assert set(curves) == {"ours", "fla", "fla-seed"} and all(len(c) == 3 for c in curves.values())
    # on the CPU ours and fla are the same torch path from the same weights: identical curves, zero gap
    assert curves["ours"] == curves["fla"] and row["extra"]["gap_ours_fla"] == 0.0
    assert curves["fla-seed"][0] != curves["fla"][0]  # another initialisation
    assert row["extra"]["within_seed_noise"] is True
    assert path.with_suffix(".png").stat().st_size > 1000
    assert "within seed noise" in capsys.readouterr().out


def test_bad_override_is_refused():
    with pytest.raises(SystemExit):
        curve.main(["--device", "cpu", "--override", "[1]"])
