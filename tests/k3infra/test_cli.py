import subprocess
import sys

import pytest

from k3infra.cli import main
from k3infra.components import by_name
from k3infra.testing import RankFailure, run_ranks


def test_info_lists_every_component(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("flashkda", "moonep", "agentenv"):
        assert name in out


def test_unknown_component_names_the_valid_ones():
    with pytest.raises(ValueError, match="kda, ep, env"):
        by_name("nope")


def test_bench_smoke_writes_json(tmp_path):
    code = (
        "import benchmarks.harness as h, pathlib, sys;"
        f"h.RESULTS_DIR = pathlib.Path({str(tmp_path)!r}); h.BENCHMARKS_MD = h.RESULTS_DIR / 'B.md';"
        "import benchmarks.smoke.run as r; sys.exit(r.main(['--n', '1000']))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=_root(), env=_env())
    assert list(tmp_path.glob("smoke-*.json"))


def test_agentenv_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; import agentenv; "
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _sum_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t)


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    return rank


@pytest.mark.multiproc
def test_run_ranks_all_reduce_over_gloo():
    assert run_ranks(_sum_ranks, 3) == [6.0, 6.0, 6.0]


@pytest.mark.multiproc
def test_run_ranks_reports_the_failing_rank():
    with pytest.raises(RankFailure, match="rank 1 raised"):
        run_ranks(_raise_on_rank_one, 2, timeout_s=60)


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


def _env():
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = f"{_root()}:{_root() / 'src'}"
    return env


def test_demo_runs_every_component_and_passes():
    env = _env()
    env.pop("TRITON_INTERPRET", None)  # the demo must choose the interpreter itself on a CPU-only machine
    done = subprocess.run([sys.executable, "-m", "k3infra.cli", "demo"], capture_output=True, text=True, env=env,
                          cwd=_root(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for component in ("kda ", "ep ", "env ", "env-rl "):
        assert f"\n{component}" in done.stdout, done.stdout
    assert " NO " not in done.stdout
