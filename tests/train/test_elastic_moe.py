"""`--rebalance-every` (`k3infra.train.elastic.ElasticMoE`) inside the trainer's loop: 4 gloo ranks train k3-debug
with EP=4; the experts are re-placed by their load history after every step and moved with their AdamW state, and
the loss curve equals a run whose experts never move."""

import argparse
import json
import os
import socket
from pathlib import Path

import pytest

from k3infra.cli import main as k3infra_main
from k3infra.train import ElasticMoE, TrainConfig, Trainer
from k3infra.train.cli import add_arguments, config_from_args
from tests.train.tiny_lm import tiny_factory

MiB = 1 << 20
STEPS = 4


def _kwargs(tmp_path, cache, name, **kw):
    # no clipping (as in test_k3_debug): one global scale would couple the runs' ulp-level norm differences; lr
    # 5e-3: at 2e-2 AdamW turns the runs' summation-order differences in near-zero gradients (embedding rows) into
    # whole-lr updates, 8.6e-5 nats apart by the third step
    base = dict(preset="k3-debug", steps=STEPS, seq_len=64, batch_size=8, lr=5e-3, optimizer="adamw", ep=4,
                max_grad_norm=1e4, out=str(tmp_path / name), cache_dir=str(cache), max_corpus_bytes=MiB,
                progress=False, tensorboard=False, plot=False)
    return {**base, **kw}


def test_the_flag_and_bad_arguments(tmp_path, train_cache):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--ep", "4", "--rebalance-every", "3"])).rebalance_every == 3
    with pytest.raises(ValueError, match="rebalance_every must be a positive int"):
        ElasticMoE(0)
    with pytest.raises(ValueError, match="history_decay"):
        ElasticMoE(2, history_decay=1.0)
    with pytest.raises(ValueError, match="--rebalance-every must be an int >= 0"):
        TrainConfig(rebalance_every=-1).resolved()
    with pytest.raises(SystemExit, match="--rebalance-every must be an int >= 0"):
        k3infra_main(["train", "--out", str(tmp_path / "cli"), "--no-progress", "--rebalance-every", "-2"])
    cfg = TrainConfig(**_kwargs(tmp_path, train_cache, "one", ep=1, rebalance_every=2))
    with pytest.raises(ValueError, match=r"--rebalance-every needs expert parallelism \(--ep > 1\)"):
        Trainer(cfg, tiny_factory)


def test_resume_refuses_a_placement_it_would_drop(tmp_path, train_cache):
    # a checkpoint whose experts were saved in moved slots must not be resumed as if they were at home
    Trainer(TrainConfig(**_kwargs(tmp_path, train_cache, "run", ep=1, steps=1, seq_len=32)), tiny_factory).fit()
    trainer_json = tmp_path / "run" / "checkpoints" / "step_1" / "trainer.json"
    state = json.loads(trainer_json.read_text())
    state["callbacks"] = {"ElasticMoE": {"rebalances": 1, "layers": [{"logical_of_X": [1, 0], "load_E": [2.0, 1.0]}]}}
    trainer_json.write_text(json.dumps(state))
    resumed = TrainConfig(**_kwargs(tmp_path, train_cache, "again", ep=1, steps=2, seq_len=32,
                                    resume=str(tmp_path / "run")))
    with pytest.raises(ValueError, match=r"holds the state of \['ElasticMoE'\]"):
        Trainer(resumed, tiny_factory)


def _two_runs(rank: int, world: int, port: int, runs: dict[str, dict], result_dir: str) -> None:
    """One rank: every run of ``runs`` in turn on one gloo group (the trainer uses a group it finds)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from k3infra.train import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name, kwargs in runs.items():
        result = train(TrainConfig(**kwargs))
        if rank == 0:
            (Path(result_dir) / f"{name}.json").write_text(json.dumps(result.history))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_rebalancing_inside_the_loop_keeps_the_loss(tmp_path, train_cache):
    import torch.multiprocessing as mp

    runs = {"static": _kwargs(tmp_path, train_cache, "static"),
            "placed": _kwargs(tmp_path, train_cache, "placed", rebalance_every=1)}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_two_runs, args=(4, port, runs, str(tmp_path)), nprocs=4, join=True)
    static, placed = (json.loads((tmp_path / f"{name}.json").read_text()) for name in runs)
    moves = [h["rebalance"] for h in placed if "rebalance" in h]
    assert len(moves) == STEPS - 1  # after every step but the last
    assert all(move["rows_moved"] > 0 for move in moves), moves
    assert all(move["predicted_after"] <= move["predicted_before"] + 1e-9 for move in moves), moves
    # each expert is applied to the same tokens wherever it lives: the same curve up to summation order
    curves = ([h["loss"] for h in static], [h["loss"] for h in placed])
    for a, b in zip(*curves, strict=True):
        assert b == pytest.approx(a, abs=1e-5), curves
    assert placed[-1]["loss"] < placed[0]["loss"]
