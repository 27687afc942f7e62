"""fla integration: a program that imports only fla runs FlashKDA where the calibration says it is faster, falls
back for what we decline, and FLASHKDA_DISABLE=1 turns it off. Each case runs in a fresh interpreter, as a user's
program would."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("fla")
ROOT = Path(__file__).resolve().parents[2]
PTH = ROOT / "src" / "flashkda_hook" / "k3_flashkda.pth"

PROGRAM = r"""
import json, logging, sys
records = []
logging.basicConfig(level=logging.INFO)
logging.getLogger().addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r.getMessage())})())
{site}
import torch
from fla.ops.kda import chunk_kda
imported_early = "flashkda" in sys.modules
B, T, H, K = 1, 40, 2, 16
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
gate, beta = -torch.rand(B, T, H, K, generator=g), torch.rand(B, T, H, generator=g)
with torch.no_grad():
    try:
        o, _ = chunk_kda(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
    except RuntimeError:
        o = None  # declined: fla's own Triton path cannot run on the CPU
    try:
        chunk_kda(q, k, v, gate, beta, return_intermediate_states=True)
    except Exception:
        pass  # fla's own path decides what to do with it; we only check who was asked
import flashkda
from flashkda import reference
ref, _ = reference.chunk_kda_reference(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
err = None if o is None else ((o.double() - ref).norm() / ref.norm()).item()
print(json.dumps(dict(imported_early=imported_early, err=err, records=records)))
"""


def _site_line() -> str:
    """Installed .pth (pip install -e . / make test) is used as is; otherwise add a temporary site dir."""
    if (Path(sysconfig.get_paths()["purelib"]) / PTH.name).exists():
        return ""
    return f"import site; site.addsitedir({str(PTH.parent)!r})"


def _run(env_extra: dict) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"), **env_extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", PROGRAM.replace("{site}", _site_line())], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not PTH.exists(), reason="hook file missing")
def test_fla_call_is_served_by_flashkda_without_importing_it(tmp_path):
    from flashkda.dispatch import CalibrationTable, Measurement, ShapeClass

    shape = ShapeClass("inference", 2, 2, 16, 16, 2048, False, "fp32")
    table = CalibrationTable("interpreter", "cpu", "now", "abc", (Measurement("tiny", shape, 1.0, {"fla": 2.0}),))
    table.save(tmp_path / "interpreter.json")
    res = _run({"FLASHKDA_DISABLE": "0", "FLASHKDA_CALIBRATION": str(tmp_path / "interpreter.json")})
    assert res["imported_early"], "the hook did not register FlashKDA when fla was imported"
    assert any("-> k3_flashkda" in r for r in res["records"]), res["records"]
    assert sum("served by FlashKDA" in r for r in res["records"]) == 1  # logs once
    assert any("k3_flashkda rejected" in r and "return_intermediate_states" in r for r in res["records"])
    assert res["err"] < 1e-5


@pytest.mark.skipif(not PTH.exists(), reason="hook file missing")
def test_fla_call_without_calibration_is_left_to_fla():
    res = _run({"FLASHKDA_DISABLE": "0"})
    assert res["imported_early"]
    assert not any(r.endswith("-> k3_flashkda") for r in res["records"]), res["records"]
    assert any("k3_flashkda rejected" in r and "no calibration table for interpreter" in r for r in res["records"])


REGISTRY_PROGRAM = r"""
import sys
from inspect import unwrap
{site}
from fla.backends import _function_registries
from fla.ops.kda import chunk_kda
print("flashkda" in sys.modules, sorted(_function_registries[unwrap(chunk_kda)]._backends))
"""


def test_start_up_hook_imports_nothing_heavy():
    code = ("import sys; import flashkda_hook; flashkda_hook.install(); "
            "print(sorted(m for m in ('torch', 'triton', 'fla', 'flashkda') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(not PTH.exists(), reason="hook file missing")
def test_flashkda_disable_values():
    """Words mean what they say (``1`` and ``true`` turn the backend off, ``1`` before anything imports flashkda;
    ``off`` keeps it); an unknown value keeps fla working on its own kernels and says why. One fresh interpreter
    per value, all started at once."""
    expected = {"1": False, "true": False, "off": True, "maybe": False}
    procs = {}
    for value in expected:
        env = {**os.environ, "FLASHKDA_DISABLE": value}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        procs[value] = subprocess.Popen([sys.executable, "-c", REGISTRY_PROGRAM.replace("{site}", _site_line())],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {value: proc.communicate(timeout=300) + (proc.returncode,) for value, proc in procs.items()}
    for value, registered in expected.items():
        stdout, stderr, rc = outs[value]
        assert rc == 0, (value, stderr[-3000:])
        backends = stdout.strip().splitlines()[-1].split(" ", 1)[1]
        assert ("k3_flashkda" in backends) == registered, (value, backends)
    assert outs["1"][0].strip().splitlines()[-1].startswith("False"), "FLASHKDA_DISABLE=1 still imported flashkda"
    assert "FLASHKDA_DISABLE='maybe'" in outs["maybe"][1] and "fla's own kernels will run" in outs["maybe"][1]
