"""Four gloo processes (FSDP2 over all four, experts split 4 ways) against one process, and resume under EP."""

import pytest

from k3infra.train import TrainConfig, train
from tests.train.dist_worker import spawn_run
from tests.train.tiny_lm import tiny_factory

pytestmark = pytest.mark.multiproc

MiB = 1 << 20

ADAMW_TOL = 1e-4
"""nats; the runs differ only in float summation order (gradient reduce-scatter, expert partial sums)."""
MUON_TOL = 2e-2
"""nats; Muon casts the gradient to bf16 before Newton–Schulz, so summation-order differences of 1e-7 flip bf16
roundings (1 ulp = 0.4%) and the curves drift apart slowly."""


def _kwargs(tmp_path, cache, name, **kw):
    base = dict(preset="k3-debug", steps=6, seq_len=32, batch_size=8, lr=1e-2, out=str(tmp_path / name),
                cache_dir=str(cache), max_corpus_bytes=MiB, qk_clip_tau=0.0, progress=False, tensorboard=False,
                plot=False)
    return {**base, **kw}


def _single(tmp_path, cache, **kw) -> list[float]:
    return train(TrainConfig(**_kwargs(tmp_path, cache, "one", **kw)), tiny_factory).losses


def test_four_ranks_ep4_fsdp_match_one_process_adamw(tmp_path, train_cache):
    single = _single(tmp_path, train_cache, optimizer="adamw")
    four = spawn_run(4, _kwargs(tmp_path, train_cache, "four", optimizer="adamw", ep=4), tmp_path / "four.json")
    losses = [h["loss"] for h in four]
    assert len(losses) == len(single) == 6
    assert max(abs(a - b) for a, b in zip(losses, single)) < ADAMW_TOL, (losses, single)
    assert single[-1] < single[0] - 0.1


def test_four_ranks_ep4_muon_match_and_resume(tmp_path, train_cache):
    single = _single(tmp_path, train_cache)
    full = spawn_run(4, _kwargs(tmp_path, train_cache, "full", ep=4, save_every=3), tmp_path / "full.json")
    losses = [h["loss"] for h in full]
    assert losses[0] == pytest.approx(single[0], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(losses, single)) < MUON_TOL, (losses, single)
    assert single[-1] < single[0] - 0.05
    resumed = spawn_run(4, _kwargs(tmp_path, train_cache, "resumed", ep=4,
                                   resume=str(tmp_path / "full" / "checkpoints" / "step_3")), tmp_path / "res.json")
    assert [h["loss"] for h in resumed] == losses  # EP-sharded experts, optimizer states and RNG restored exactly
