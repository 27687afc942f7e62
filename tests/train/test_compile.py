"""``--compile``: each k3-debug decoder layer under ``torch.compile`` trains like the eager model, new packed batches
do not recompile, and the state_dict keys stay those of the eager model.

The tests trace with ``aot_eager`` (Dynamo + AOTAutograd, no inductor code generation) through `BACKEND_ENV`."""

import json
import random

import pytest
import torch
from torch._dynamo.utils import counters

from k3infra.train import TrainConfig, Trainer
from k3infra.train.cli import add_arguments, config_from_args
from k3infra.train.compile import BACKEND_ENV

MiB = 1 << 20

LOSS_TOL = 3e-4
"""nats per step over 3 steps (fp32 on the CPU; measured gap <= 1e-5 here): AOTAutograd reorders some sums, CPU
backward kernels with 2 threads are not bitwise reproducible (two eager processes of the default k3-debug run
differed by 1.2e-4 at the third step), and Muon's bf16 Newton–Schulz turns ulp differences of the gradients into
ulp flips of its update."""


def _cfg(tmp_path, cache, name, **kw):
    base = dict(preset="k3-debug", steps=3, seq_len=64, batch_size=4, lr=5e-3, out=str(tmp_path / name),
                cache_dir=str(cache), max_corpus_bytes=MiB, progress=False, tensorboard=False, plot=False)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """A JSONL corpus of short documents (1 to 4 source lines of a few stdlib modules), so that packed batches
    differ in their segment count."""
    import argparse
    import inspect
    import typing

    rng = random.Random(0)
    lines = [line for module in (argparse, inspect, typing) for line in inspect.getsource(module).splitlines()
             if line.strip()]
    path = tmp_path_factory.mktemp("short-docs") / "docs.jsonl"
    with path.open("w") as f:
        start = 0
        while start < len(lines):
            size = rng.randint(1, 4)
            f.write(json.dumps({"text": "\n".join(lines[start : start + size])}) + "\n")
            start += size
    return [str(path)]


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(("scope", "checkpointing"), [("layer", False), ("layer", True), ("module", False)],
                         ids=["layer", "layer-activation-checkpointing", "module"])
def test_compiled_k3_debug_matches_eager_and_does_not_recompile(tmp_path, train_cache, short_docs, aot_eager, scope,
                                                                checkpointing):
    eager = Trainer(_cfg(tmp_path, train_cache, "eager", corpus=short_docs))
    try:
        eager_losses = [eager.train_step(step)["loss"] for step in range(3)]
        eager_keys = list(eager.model.state_dict())
    finally:
        eager.state.close()
    trainer = Trainer(_cfg(tmp_path, train_cache, "compiled", corpus=short_docs, compile=scope,
                           activation_checkpointing=checkpointing))
    try:
        assert list(trainer.model.state_dict()) == eager_keys  # checkpoints load either way
        # each step packs other documents: the number of segments changes, so the test can see a recompile
        segments = {len(next(iter(trainer.data.dataset.micro_batches(step, 4, 0, 1, None))).cu_seqlens)
                    for step in range(3)}
        assert len(segments) > 1, segments
        losses = [trainer.train_step(0)["loss"]]
        frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
        assert frames > 0 and graphs > 0  # the layers were traced
        losses += [trainer.train_step(step)["loss"] for step in (1, 2)]
        assert (counters["frames"]["total"], counters["stats"]["unique_graphs"]) == (frames, graphs)
    finally:
        trainer.state.close()
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) < LOSS_TOL, (losses, eager_losses)


def test_compile_needs_decoder_layers(tmp_path, train_cache):
    with pytest.raises(ValueError, match="--compile needs model.model.layers"):
        Trainer(_cfg(tmp_path, train_cache, "flat", compile=True), lambda config: torch.nn.Linear(2, 2))


def test_compile_scope_is_checked(tmp_path, train_cache):
    with pytest.raises(ValueError, match="--compile must be 'layer' or 'module'"):
        _cfg(tmp_path, train_cache, "bad", compile="graph").resolved()


def test_compile_option_reaches_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--compile"])).compile == "layer"
    assert config_from_args(parser.parse_args(["--compile", "module"])).compile == "module"
    assert config_from_args(parser.parse_args([])).compile is False


GPU_WIDTHS = {"kda_num_heads": 2, "kda_head_dim": 128, "hidden_size": 128, "moe_latent_size": 64}
"""k3-debug with FlashKDA-sized heads (its kernels take head dims of 64 or more)."""


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["layer", "module"])
def test_inductor_on_cuda_matches_eager(tmp_path, train_cache, short_docs, scope):
    # bf16 autocast: eager runs the fused Triton element-wise kernels, compiled runs inductor's fusion of the eager
    # chains, so bf16 roundings differ; FlashKDA sits behind its graph break, the grouped-GEMM experts are traced
    kw = dict(corpus=short_docs, device="cuda", overrides=GPU_WIDTHS)
    eager = Trainer(_cfg(tmp_path, train_cache, "eager", **kw))
    try:
        eager_losses = [eager.train_step(step)["loss"] for step in range(3)]
    finally:
        eager.state.close()
    torch._dynamo.reset()
    trainer = Trainer(_cfg(tmp_path, train_cache, "compiled", compile=scope, **kw))
    try:
        losses = [trainer.train_step(0)["loss"]]
        frames = counters["frames"]["total"]
        losses += [trainer.train_step(step)["loss"] for step in (1, 2)]
        assert counters["frames"]["total"] == frames
    finally:
        trainer.state.close()
    assert abs(losses[0] - eager_losses[0]) < 1e-2, (losses, eager_losses)
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) < 5e-2, (losses, eager_losses)
