"""`flashkda.dispatch`: every decision of the calibrated policy (serve, decline for each reason, environment values),
the calibration tables shipped with the package, and the fla backend's verifier going through the policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashkda.dispatch import (
    CALIBRATION_ENV,
    DISABLE_ENV,
    DISPATCH_ENV,
    CalibrationTable,
    DispatchPolicy,
    Measurement,
    ShapeClass,
    device_slug,
    dispatch_mode,
    dispatch_report,
    report_rows,
    shipped_table,
    table_stem,
    token_bucket,
)

ROOT = Path(__file__).resolve().parents[2]
H64 = ShapeClass("inference", 64, 64, 128, 128, 8192, False, "bf16")


def table(*rows: Measurement, arch: str = "sm_90") -> CalibrationTable:
    return CalibrationTable(arch, "NVIDIA H200", "2026-01-01T00:00:00", "abc", rows)


def row(ours: float, shape: ShapeClass = H64, name: str = "r", **baselines: float) -> Measurement:
    return Measurement(name, shape, ours, baselines)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (DISPATCH_ENV, DISABLE_ENV, CALIBRATION_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("tokens, bucket", [(1, 2048), (2048, 2048), (2049, 8192), (8192, 8192), (8193, 32768),
                                            (131072, 131072), (524288, 524288), (524289, -1)])
def test_token_buckets(tokens, bucket):
    assert token_bucket(tokens) == bucket


def test_shape_class_of_a_call():
    q = torch.empty(2, 3000, 16, 64, dtype=torch.float16)
    v = torch.empty(2, 3000, 64, 32)
    shape = ShapeClass.of_call(q, v, None, training=True)
    assert shape == ShapeClass("training", 16, 64, 64, 32, 8192, False, "fp16")
    assert ShapeClass.of_call(q[:1], v[:1], torch.tensor([0, 3000]), False).varlen
    assert "H16-HV64" in shape.label() and "T<=8192" in shape.label()


def test_serves_when_faster_than_every_competitor_in_every_row():
    policy = DispatchPolicy({"sm_90": table(row(1.0, name="a", fla=1.5, flash_kda=1.2), row(1.0, name="b", fla=1.1))})
    d = policy.decide(H64, "sm_90", ("fla",), mode="auto")
    assert d.serve and d.against == "fla" and d.speedup == pytest.approx(1.1) and "b" in d.reason


@pytest.mark.parametrize("rows, competitors, needle", [
    pytest.param([row(1.0, fla=0.9)], ("fla",), "0.90x fla", id="slower"),
    pytest.param([row(1.0, fla=1.01)], ("fla",), "below 1.03x", id="within-noise"),
    pytest.param([row(1.0, name="a", fla=2.0), row(1.0, name="b", fla=0.97)], ("fla",), "0.97x fla at b",
                 id="one-row-slower"),
    pytest.param([row(1.0, fla=2.0)], ("fla", "flash_kda"), "flash_kda was not timed", id="untimed-competitor"),
    pytest.param([row(1.0, fla=2.0, flash_kda=0.8)], ("fla", "flash_kda"), "0.80x flash_kda", id="cutlass-faster"),
])
def test_declines_with_the_reason(rows, competitors, needle):
    d = DispatchPolicy({"sm_90": table(*rows)}).decide(H64, "sm_90", competitors, mode="auto")
    assert not d.serve and needle in d.reason


def test_declines_an_uncalibrated_class_and_an_unknown_arch():
    policy = DispatchPolicy({"sm_90": table(row(1.0, fla=2.0))})
    other = ShapeClass("training", 64, 64, 128, 128, 8192, False, "bf16")
    d = policy.decide(other, "sm_90", ("fla",), mode="auto")
    assert not d.serve and "was not calibrated on NVIDIA H200" in d.reason
    d = policy.decide(H64, "sm_100", ("fla",), mode="auto")
    assert not d.serve and "no calibration table for sm_100" in d.reason and "--calibrate" in d.reason


def test_always_and_never_override_the_table():
    policy = DispatchPolicy({"sm_90": table(row(1.0, fla=0.5))})
    assert policy.decide(H64, "sm_90", mode="always").serve
    assert not DispatchPolicy({"sm_90": table(row(1.0, fla=5.0))}).decide(H64, "sm_90", mode="never").serve
    with pytest.raises(ValueError, match="mode must be one of"):
        policy.decide(H64, "sm_90", mode="sometimes")


@pytest.mark.parametrize("env, mode", [({}, "auto"), ({DISPATCH_ENV: "ALWAYS"}, "always"),
                                       ({DISPATCH_ENV: "never"}, "never"), ({DISABLE_ENV: "1"}, "never"),
                                       ({DISABLE_ENV: "1", DISPATCH_ENV: "auto"}, "never"),
                                       ({DISABLE_ENV: "0", DISPATCH_ENV: "always"}, "always")])
def test_dispatch_mode_from_the_environment(monkeypatch, env, mode):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert dispatch_mode() == mode


@pytest.mark.parametrize("env, needle", [({DISPATCH_ENV: "fast"}, "FLASHKDA_DISPATCH='fast'"),
                                         ({DISABLE_ENV: "maybe"}, "FLASHKDA_DISABLE='maybe'"),
                                         ({DISABLE_ENV: "1", DISPATCH_ENV: "always"}, "contradict")])
def test_bad_environment_values_name_the_variable(monkeypatch, env, needle):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=needle):
        DispatchPolicy().decide(H64, "sm_90")


def test_calibration_override_from_the_environment(monkeypatch, tmp_path):
    path = tmp_path / "cal.json"
    table(row(1.0, fla=2.0), arch="sm_100").save(path)
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    assert DispatchPolicy().decide(H64, "sm_100", ("fla",)).serve
    table(row(1.0, fla=0.5), arch="sm_100").save(path)  # rewritten: read again
    os.utime(path, ns=(1, 1))
    assert not DispatchPolicy().decide(H64, "sm_100", ("fla",)).serve
    monkeypatch.setenv(CALIBRATION_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="FLASHKDA_CALIBRATION"):
        DispatchPolicy().decide(H64, "sm_100", ("fla",))


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.pop("rows"), "'rows'"),
    (lambda d: d["rows"][0].pop("shape"), "'shape'"),
    (lambda d: d["rows"][0].update(ours_ms=0), "non-positive"),
])
def test_malformed_tables_are_refused_by_name(tmp_path, mutate, needle):
    data = table(row(1.0, fla=2.0)).to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=needle) as err:
        CalibrationTable.load(path)
    assert "bad.json" in str(err.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        CalibrationTable.load(path)


def test_table_round_trips_through_json(tmp_path):
    t = table(row(1.0, name="a", fla=2.0, flash_kda=1.5))
    t.save(tmp_path / "t.json")
    assert CalibrationTable.load(tmp_path / "t.json") == t


def test_shipped_tables_parse_and_hold_both_sides_of_each_row():
    folder = ROOT / "src" / "flashkda" / "calibration"
    for path in folder.glob("*.json"):
        t = CalibrationTable.load(path)
        assert t.rows and all(m.ours_ms > 0 and "fla" in m.baselines_ms for m in t.rows)
        device = None if path.stem == t.arch else t.device.rsplit(" x", 1)[0]  # "NVIDIA H200 x1": the GPU count
        assert path.stem == table_stem(t.arch, device) and shipped_table(t.arch, device) == t


def test_a_device_table_wins_over_its_architecture_table():
    h100 = CalibrationTable("sm_90", "NVIDIA H100 80GB HBM3 x1", "2026-01-01T00:00:00", "abc", (row(1.0, fla=0.9),))
    policy = DispatchPolicy({"sm_90": table(row(1.0, fla=2.0)), "sm_90-nvidia-h100-80gb-hbm3": h100})
    assert not policy.decide(H64, "sm_90", mode="auto", device="NVIDIA H100 80GB HBM3").serve
    assert policy.decide(H64, "sm_90", mode="auto", device="NVIDIA H200").serve
    assert policy.decide(H64, "sm_90", mode="auto").serve
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3" and device_slug(" A/B  c ") == "a-b-c"
    assert table_stem("sm_90", "NVIDIA H200") == "sm_90-nvidia-h200" and table_stem("sm_90") == "sm_90"
    assert shipped_table("sm_90", "No Such GPU") == shipped_table("sm_90")


def test_report_names_a_backend_and_a_reason_for_every_common_shape():
    policy = DispatchPolicy({"sm_90": table(row(1.0, fla=2.0))})
    rows = report_rows("sm_90", policy)
    served = [r for r in rows if r.backend == "flashkda"]
    assert [r.shape for r in served] == [H64]
    assert all(r.decision.reason for r in rows) and {r.shape.mode for r in rows} == {"inference", "training"}
    text = dispatch_report("sm_90", policy)
    assert "H64 K128 V128 T<=8192 fixed bf16" in text and "flashkda" in text
    assert "calibration measured on NVIDIA H200 at commit abc (2026-01-01), 1 rows" in text.splitlines()[0]
    assert "no calibration table" in dispatch_report("sm_100", policy).splitlines()[0]


@pytest.mark.parametrize("mode, served", [("auto", False), ("always", True), ("never", False)])
def test_fla_backend_verifier_follows_the_policy(monkeypatch, tmp_path, mode, served):
    """On the Triton interpreter (arch ``interpreter``): no table there, so auto declines; a table saying we are
    faster makes auto serve."""
    pytest.importorskip("fla")
    from flashkda.backend import chunk_kda_verifier

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(DISPATCH_ENV, mode)
    q, k, v, g = (torch.randn(1, 40, 2, 16) for _ in range(4))
    beta = torch.rand(1, 40, 2)
    ok, reason = chunk_kda_verifier(q, k, v, g, beta)
    assert ok == served and (ok or reason)
    if mode == "auto":
        assert "no calibration table for interpreter" in reason
        shape = ShapeClass.of_call(q, v, None, training=False)
        path = tmp_path / "interp.json"
        table(row(1.0, shape, fla=2.0), arch="interpreter").save(path)
        monkeypatch.setenv(CALIBRATION_ENV, str(path))
        assert chunk_kda_verifier(q, k, v, g, beta) == (True, None)
        assert not chunk_kda_verifier(q.requires_grad_(), k, v, g, beta)[0]  # training: another class


COMPETITOR_PROGRAM = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from fla.backends import BaseBackend, register
from fla.ops.kda.chunk import chunk_kda
from flashkda.backend import chunk_kda_verifier, competitors, register_with_fla

register_with_fla()

@register(chunk_kda)
class Rival(BaseBackend):
    backend_type = "rival"
    priority = 4
    def chunk_kda_verifier(self, q, *args, **kwargs):
        return q.shape[2] == 2, "only H=2"
    def chunk_kda(self, *args, **kwargs):
        raise AssertionError("not called")

q, k, v, g = (torch.randn(1, 40, 2, 16) for _ in range(4))
beta = torch.rand(1, 40, 2)
print(competitors(q, k, v, g, beta), competitors(q[:, :, :1], k[:, :, :1], v, g, beta))
print(chunk_kda_verifier(q, k, v, g, beta)[1])
"""


def test_an_accepting_registered_backend_is_a_competitor(tmp_path):
    """A backend registered with fla that accepts the call must be beaten too: an uncalibrated one declines us."""
    pytest.importorskip("fla")
    from flashkda.backend import ShapeClass as SC

    shape = SC("inference", 2, 2, 16, 16, 2048, False, "fp32")
    path = tmp_path / "interp.json"
    table(row(1.0, shape, fla=2.0), arch="interpreter").save(path)
    env = {**os.environ, CALIBRATION_ENV: str(path), DISPATCH_ENV: "auto"}
    env.pop(DISABLE_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", COMPETITOR_PROGRAM], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, reason = out.stdout.strip().splitlines()[-2:]
    assert first == "('fla', 'rival') ('fla',)"
    assert "rival was not timed" in reason


def test_a_call_slower_than_fla_is_declined_without_asking_other_backends(monkeypatch, tmp_path):
    """The verifier runs on every fla call: a decline against fla alone must not call the other verifiers, and the
    decision is memoised per call shape (the table is read once)."""
    pytest.importorskip("fla")
    from flashkda import backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(DISPATCH_ENV, "auto")
    q, k, v, g = (torch.randn(1, 40, 2, 16) for _ in range(4))
    beta = torch.rand(1, 40, 2)
    path = tmp_path / "slow.json"
    table(row(1.0, ShapeClass.of_call(q, v, None, training=False), fla=0.5), arch="interpreter").save(path)
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    asked, decided = [], []
    monkeypatch.setattr(backend, "competitors", lambda *a, **kw: asked.append(1) or ("fla",))
    real_decide = backend._POLICY.decide
    monkeypatch.setattr(backend._POLICY, "decide", lambda *a, **kw: decided.append(1) or real_decide(*a, **kw))
    for _ in range(3):
        ok, reason = backend.chunk_kda_verifier(q, k, v, g, beta)
        assert not ok and "0.50x fla" in reason
    assert asked == [] and len(decided) == 1
