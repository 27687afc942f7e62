"""`k3infra plan` end to end: table, --json, --png, cluster.yaml, bad options."""

from __future__ import annotations

import json

import pytest

from k3infra.cli import main

MINI = ["--model", "k3-mini", "--cluster", "8xH200", "--seq-len", "4096", "--global-batch-tokens", "262144"]


def test_train_json_parses(capsys):
    assert main(["plan", "train", *MINI, "--json", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] and doc["model"]["params_total"] == 1_007_011_552
    assert len(doc["plans"]) == 3 and doc["plans"][0]["memory_bytes"]["total"] <= doc["usable_bytes_per_gpu"]
    assert "Best of" in doc["explanation"]


def test_serve_table_and_png(tmp_path, capsys):
    png = tmp_path / "mem.png"
    code = main(["plan", "serve", "--model", "k3", "--cluster", "16xH200", "--context", "1048576",
                 "--weight-dtype", "mxfp4", "--tp", "8", "--png", str(png)])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "Decode step" in out and "at least" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cluster_yaml(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text("gpu: H200\nnodes: 2\nnetwork_bw: 100\n")
    assert main(["plan", "train", *MINI[:2], "--cluster", str(path), "--tp", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"]["gpus"] == 16 and doc["cluster"]["network_bw"] == 100e9


def test_infeasible_exit_code_and_reason(capsys):
    code = main(["plan", "train", "--model", "k3", "--cluster", "8xH200", "--pp", "8", "--vp", "1", "--zero", "3",
                 "--recompute", "full", "--json"])  # fmt: skip
    assert code == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["feasible"] and "over by" in doc["reason"]


@pytest.mark.parametrize(
    "args, option",
    [
        pytest.param(["train", "--model", "nope"], "--model", id="model"),
        pytest.param(["train", "--cluster", "3xQ1"], "--cluster", id="cluster"),
        pytest.param(["train", "--seq-len", "-4"], "--seq-len", id="seq-len"),
        pytest.param(["serve", "--concurrency", "0"], "--concurrency", id="concurrency"),
        pytest.param(["train", "--top", "0"], "--top", id="top"),
        pytest.param(["train", "--png", "x.jpg"], "--png", id="png"),
    ],
)
def test_bad_values_name_the_option(args, option, capsys):
    assert main(["plan", *args]) == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("args", [["train", "--tp", "a"], ["train", "--precision", "fp4"], ["serve", "--zero", "1"]])
def test_argparse_rejects(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", *args])
    assert info.value.code == 2


def test_every_option_has_help():
    from k3infra.cli import build_parser

    parser = build_parser()
    plan = parser._subparsers._group_actions[0].choices["plan"]
    for kind in plan._subparsers._group_actions[0].choices.values():
        for action in kind._actions:
            assert action.help, action.option_strings


def test_json_to_a_file_and_unwritable_path(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "serve", "--model", "k3-mini", "--cluster", "1xH200", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kind"] == "serve"
    assert main(["plan", "serve", "--model", "k3-mini", "--cluster", "1xH200", "--json", str(tmp_path / "no/x")]) == 2
    assert "--json" in capsys.readouterr().err
