"""``benchmarks.kda.calibrate`` and ``benchmarks.kda.host`` on the CPU: merging a calibration that spans several
calls, forcing a kernel set for one call, the host-time benchmark's rows and argument errors."""

from __future__ import annotations

import os

import pytest

from benchmarks.kda.calibrate import forced_kernels, main, merged_rows
from flashkda.dispatch import CalibrationTable, Measurement, ShapeClass
from flashkda.fwd.v2.chunk_fwd import KERNELS_ENV

INFO = {"device": "NVIDIA H100 80GB HBM3 x1", "commit": "c0ffee", "date": "2026-01-02T00:00:00+00:00"}


def _row(name: str, mode: str) -> Measurement:
    return Measurement(name, ShapeClass(mode, 64, 64, 128, 128, 8192, False, "bf16"), 1.0, {"fla": 2.0})


def _table(path, device="NVIDIA H100 80GB HBM3 x1", commit="c0ffee"):
    rows = (_row("H64-T8192", "inference"), _row("H64-T8192", "training"), _row("H12-T8192", "inference"))
    CalibrationTable("sm_90", device, "2026-01-01T00:00:00+00:00", commit, rows).save(path)


def test_merge_keeps_the_rows_this_run_does_not_measure(tmp_path):
    path = tmp_path / "t.json"
    _table(path)
    kept, began = merged_rows(path, INFO, {("H64-T8192", "inference")})
    assert [(m.row, m.shape.mode) for m in kept] == [("H64-T8192", "training"), ("H12-T8192", "inference")]
    assert began == "2026-01-01T00:00:00+00:00"
    assert merged_rows(tmp_path / "absent.json", INFO, set()) == ([], INFO["date"])


@pytest.mark.parametrize("device, commit", [("NVIDIA H200 x1", "c0ffee"), ("NVIDIA H100 80GB HBM3 x1", "beef")])
def test_merge_refuses_a_table_from_another_device_or_commit(tmp_path, device, commit):
    path = tmp_path / "t.json"
    _table(path, device, commit)
    with pytest.raises(SystemExit, match="drop --merge"):
        merged_rows(path, INFO, set())


def test_merge_refuses_an_unreadable_table(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read it as JSON"):
        merged_rows(path, INFO, set())


def test_merge_needs_a_table(capsys):
    with pytest.raises(SystemExit):
        main(["--merge"])
    assert "--merge needs --write-table or --table-out" in capsys.readouterr().err


@pytest.mark.parametrize("before", [None, "v1"])
def test_forced_kernels_sets_the_variable_for_the_call_only(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(KERNELS_ENV, before)
    seen = forced_kernels(lambda: os.environ[KERNELS_ENV], "v2")()
    assert seen == "v2" and os.environ.get(KERNELS_ENV) == before
    with pytest.raises(ZeroDivisionError):
        forced_kernels(lambda: 1 / 0, "v2")()
    assert os.environ.get(KERNELS_ENV) == before


def test_host_benchmark_lists_its_rows(capsys):
    from benchmarks.kda import host

    assert host.main(["--dry-run", "--rows", "H64-T1024"]) == 0
    assert capsys.readouterr().out.startswith("H64-T1024: fla")


@pytest.mark.parametrize("bad, needle", [(["--rows", "H7-T1"], "unknown rows ['H7-T1']"),
                                         (["--calls", "0"], "--calls, --rounds and --rep must be >= 1"),
                                         (["--rounds", "0"], "--calls, --rounds and --rep must be >= 1")])
def test_host_benchmark_rejects_bad_arguments(capsys, bad, needle):
    from benchmarks.kda import host

    with pytest.raises(SystemExit):
        host.main(["--dry-run", *bad])
    assert needle in capsys.readouterr().err


def test_host_times_alternate_the_backends_per_round(monkeypatch):
    """Every backend runs its loop once per round, in alternating order (the host drifts between rounds)."""
    import torch

    from benchmarks.kda import host

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    order = []
    runs = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    measured = host.host_times(runs, calls=2, rounds=3, device="cpu")
    assert order == ["a"] * 3 + ["b"] * 3 + ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    for m in measured.values():
        assert set(m) == {"host us", "host us min", "back-to-back us"}
        assert 0 <= m["host us min"] <= m["host us"] <= m["back-to-back us"] + 0.1
