"""The real k3-debug model under the trainer: the loss falls from ln V, and 4 gloo ranks (EP=4 through MoonEP,
FSDP2 over all four) follow the one-process curve."""

import pytest

from k3infra.train import TrainConfig, train
from tests.train.dist_worker import spawn_run

MiB = 1 << 20

EP_TOL = 5e-4
"""nats per step over 3 steps at lr 5e-3 (measured gap <= 5e-5): summation order differs (FSDP reduce-scatter,
MoonEP combine, and CPU backward kernels are not bitwise reproducible across runs with 2 threads) and Muon's bf16
Newton–Schulz turns 1e-7 gradient differences into ulp flips of its update. At lr 2e-2 those flips grow ~50x per
step, and the third-step loss of one process alone varies by 1e-3 from run to run."""


def _kwargs(tmp_path, cache, name, **kw):
    base = dict(preset="k3-debug", seq_len=64, batch_size=8, lr=2e-2, out=str(tmp_path / name), cache_dir=str(cache),
                max_corpus_bytes=MiB, progress=False, tensorboard=False, plot=False)
    return {**base, **kw}


def test_k3_debug_loss_goes_well_below_unigram_entropy(tmp_path, train_cache):
    result = train(TrainConfig(**_kwargs(tmp_path, train_cache, "run", steps=50)))
    assert result.losses[0] == pytest.approx(result.uniform_entropy, abs=0.15)
    assert min(result.losses[-10:]) < result.unigram_entropy - 0.5, (result.unigram_entropy, result.losses)


@pytest.mark.multiproc
@pytest.mark.parametrize("ep", [4, 2])  # 2: each expert shard has two replicas, which split its Newton–Schulz
def test_k3_debug_four_ranks_ep_match_one_process(tmp_path, train_cache, ep):
    # The norm is computed (FSDP2 shards over all ranks, experts over the EP group) but never reached, so the curve
    # compares the parallel step itself: with clipping active, one global scale couples every parameter and the
    # ulp-level differences above grow past EP_TOL within three steps although the first norms agree to 1e-7.
    kw = dict(steps=3, max_grad_norm=1e4, lr=5e-3)
    result = train(TrainConfig(**_kwargs(tmp_path, train_cache, "one", **kw)))
    history = spawn_run(4, _kwargs(tmp_path, train_cache, "four", ep=ep, **kw), tmp_path / "4.json", factory_name="k3")
    four = [h["loss"] for h in history]
    assert len(four) == 3
    assert max(abs(a - b) for a, b in zip(four, result.losses)) < EP_TOL, (four, result.losses)
    assert history[0]["grad_norm"] == pytest.approx(result.history[0]["grad_norm"], rel=1e-5)
