"""`benchmarks.train.run` stopped by a SIGTERM (a ``timeout`` around it): the variants measured before it are
still written, without a baseline time where their reference was not measured."""

import json
import os
import signal

import pytest

from benchmarks.harness import Timing
from benchmarks.train import run


def _measured(first_loss: float) -> dict:
    return {"first_loss": first_loss, "timing": Timing.from_samples([10.0, 11.0, 12.0]), "tokens_per_s": 1000.0,
            "mfu": 0.1, "forward_backward_ms": 8.0, "update_ms": 2.0, "mfu_forward_backward": 0.13,
            "flops_per_token": 6.0e6, "newton_schulz_flops_per_step": 1.0e9, "peak_memory_gib": None,
            "device": "cpu"}


def test_sigterm_during_the_compiled_variant_writes_ours_eager(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("K3INFRA_RESULTS_DIR", str(tmp_path))
    calls = []

    def measure(cfg, steps, warmup):
        calls.append(cfg.compile)
        if cfg.compile:
            os.kill(os.getpid(), signal.SIGTERM)  # what `timeout` sends while the compiled variant compiles
            raise AssertionError("the SIGTERM handler should have stopped the measurement")
        return _measured(5.0)

    monkeypatch.setattr(run, "measure", measure)
    before = signal.getsignal(signal.SIGTERM)
    code = run.main(["--device", "cpu", "--config", "k3-debug", "--compile", "--skip-baseline", "--steps", "1"])
    assert code == 1 and calls == [False, "layer"]
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    [path] = tmp_path.glob("train-*.json")
    [row] = json.loads(path.read_text())["rows"]
    assert row["ours_ms"] == 11.0 and row["baseline_ms"] is None
    assert "stopped by SIGTERM while measuring ours+compile" in row["note"]
    assert "writing the variants measured before it" in capsys.readouterr().out


def test_sigterm_during_the_baseline_keeps_ours_without_a_baseline_time(tmp_path, monkeypatch):
    monkeypatch.setenv("K3INFRA_RESULTS_DIR", str(tmp_path))

    def measure(cfg, steps, warmup):
        if cfg.overrides.get("kda_backend") == "torch" and "baseline" in str(cfg.out):
            os.kill(os.getpid(), signal.SIGTERM)
        return _measured(5.0)

    monkeypatch.setattr(run, "measure", measure)
    assert run.main(["--device", "cpu", "--config", "k3-debug", "--steps", "1"]) == 1
    [path] = tmp_path.glob("train-*.json")
    [row] = json.loads(path.read_text())["rows"]
    assert row["baseline_ms"] is None and row["ours_ms"] == 11.0
    assert "while measuring baseline" in row["note"]


def test_model_overrides_reach_every_variant_and_the_row(tmp_path, monkeypatch):
    monkeypatch.setenv("K3INFRA_RESULTS_DIR", str(tmp_path))
    seen = {}

    def measure(cfg, steps, warmup):
        seen[cfg.out.rsplit("/", 1)[-1]] = dict(cfg.overrides)
        return _measured(5.0)

    monkeypatch.setattr(run, "measure", measure)
    code = run.main(["--device", "cpu", "--config", "k3-debug", "--steps", "1",
                     "--model", '{"num_hidden_layers": 2, "n_routed_experts": 16}',
                     "--baseline", '{"n_routed_experts": 8}'])
    assert code == 0
    assert seen["ours"] == {"num_hidden_layers": 2, "n_routed_experts": 16, "kda_backend": "torch"}
    assert seen["baseline"] == {"num_hidden_layers": 2, "n_routed_experts": 8, "kda_backend": "torch"}
    [path] = tmp_path.glob("train-*.json")
    [row] = json.loads(path.read_text())["rows"]
    assert row["case"].startswith("k3-debug-custom-T") and row["params"]["ours"]["num_hidden_layers"] == 2


@pytest.mark.parametrize("bad", ["[1, 2]", "{num_hidden_layers: 2}"])
def test_model_overrides_must_be_a_json_object(bad):
    with pytest.raises(SystemExit, match="--model: expected a JSON object of K3Config fields"):
        run.main(["--device", "cpu", "--config", "k3-debug", "--model", bad])


def test_each_variant_is_on_disk_before_the_next_starts(tmp_path, monkeypatch):
    """A SIGKILL (what `timeout -k` sends after its grace) can stop a later variant: the earlier ones' rows are
    already written, marked partial, and the finished run replaces them in the same file."""
    monkeypatch.setenv("K3INFRA_RESULTS_DIR", str(tmp_path))
    on_disk = []

    def measure(cfg, steps, warmup):
        on_disk.append([json.loads(p.read_text())["rows"] for p in tmp_path.glob("train-*.json")])
        return _measured(5.0)

    monkeypatch.setattr(run, "measure", measure)
    assert run.main(["--device", "cpu", "--config", "k3-debug", "--steps", "1", "--compile"]) == 0
    assert on_disk[0] == []
    [[row]] = on_disk[1]  # while the baseline runs: ours without a baseline time
    assert row["baseline_ms"] is None and "the run did not finish baseline, ours+compile" in row["note"]
    [[ours]] = on_disk[2]  # while the compiled variant runs: ours against the baseline
    assert ours["baseline_ms"] == 11.0 and "did not finish ours+compile" in ours["note"]
    [path] = tmp_path.glob("train-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 2 and not any("partial" in r["note"] for r in rows)


def test_a_failed_gate_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("K3INFRA_RESULTS_DIR", str(tmp_path))
    losses = iter([5.0, 6.0])
    monkeypatch.setattr(run, "measure", lambda cfg, steps, warmup: _measured(next(losses)))
    assert run.main(["--device", "cpu", "--config", "k3-debug", "--steps", "1"]) == 1
    assert list(tmp_path.glob("train-*.json")) == []
