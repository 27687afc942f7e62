"""The K3 model under torchtitan's own trainer (``torchtitan.train`` with ``--module k3infra.titan``), on the CPU.

The spec pieces are checked in-process; the trainer runs as torchtitan's entry point under torchrun (gloo): one
process against two processes with expert parallel 2 + FSDP, both starting from one seed checkpoint (torchtitan's
way to get the same initial weights under any parallelism).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402

from k3infra.titan import K3CorpusTokenizer, K3PackedDataLoader, K3TitanModel, model_registry  # noqa: E402
from k3infra.train.packing import IGNORE_INDEX  # noqa: E402

MAX_BYTES = 1_000_000


class _TrainerSettings:
    def __init__(self, **parallelism):
        self.training = TrainingConfig(seq_len=64, local_batch_size=2)
        self.parallelism = ParallelismConfig(spmd_backend="partial_dtensor", **parallelism)


def test_spec_builds_initialises_and_rejects_bad_settings():
    spec = model_registry("k3-debug")
    assert spec.name == "k3" and spec.pipelining_fn is None
    with torch.device("meta"):
        model = spec.model.build()
    assert isinstance(model, K3TitanModel)
    model.verify_module_protocol()
    n_params, flops = spec.model.get_nparams_and_flops(model, 64)
    assert n_params == 459_974 and flops > 6 * 255_174
    # torchtitan materialises with to_empty and then calls init_weights: nothing may keep the empty memory
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan"))
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all((b == 0).all() for b in model.buffers())
    logits = model(torch.randint(0, 512, (1, 16)), cu_seqlens=torch.tensor([0, 9, 16], dtype=torch.int32))
    assert logits.shape == (1, 16, 512)

    spec.model.update_from_config(config=_TrainerSettings(expert_parallel_degree=4))
    with pytest.raises(ValueError, match="expert_parallel_degree 3 must divide"):
        spec.model.update_from_config(config=_TrainerSettings(expert_parallel_degree=3))
    with pytest.raises(ValueError, match="tensor_parallel_degree must be 1"):
        spec.model.update_from_config(config=_TrainerSettings(tensor_parallel_degree=2))
    with pytest.raises(ValueError, match="preset must be one of"):
        model_registry("k4")
    with pytest.raises(ValueError, match="unknown K3Config field"):
        model_registry("k3-debug", hidden=3)


def test_dataloader_shifts_labels_and_splits_ranks(tmp_path):
    tok = K3CorpusTokenizer.Config(vocab_size=512, max_bytes=MAX_BYTES, cache_dir=str(tmp_path)).build()
    loaders = [K3PackedDataLoader.Config().build(dp_world_size=2, dp_rank=r, tokenizer=tok, seq_len=32,
                                                 local_batch_size=3) for r in range(2)]
    (in0, lab0), (in1, lab1) = (next(iter(loader)) for loader in loaders)
    whole = loaders[0].dataset.batch(0, 6)  # the global batch of step 0: rank 0 holds its first 3 rows
    assert torch.equal(torch.cat([in0["input"], in1["input"]], 1), whole.input_ids)
    ids, cu = in0["input"][0], in0["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == ids.numel() == 96
    starts = set(cu[:-1])
    for t in range(95):  # position t predicts token t + 1 unless t + 1 starts a document or a row
        assert lab0[0, t] == (IGNORE_INDEX if t + 1 in starts else ids[t + 1])
    assert lab0[0, -1] == IGNORE_INDEX
    with pytest.raises(TypeError, match="K3CorpusTokenizer"):
        K3PackedDataLoader.Config().build(dp_world_size=1, dp_rank=0, tokenizer=object(), seq_len=32,
                                          local_batch_size=1)


def test_expert_parallel_on_a_torch_without_fsdp_per_parameter_meshes_is_a_clear_error(monkeypatch):
    """torch 2.11's FSDP has no per-parameter mesh hook (``ShardPlacementResult``), which torchtitan EP needs: the
    K3 parallelize function stops with an error naming the setting, not an ImportError from torch internals."""
    from types import SimpleNamespace

    import torch.distributed.fsdp._fully_shard._fsdp_common as fsdp_common

    from k3infra.titan.parallelize import _apply_fsdp

    monkeypatch.delattr(fsdp_common, "ShardPlacementResult")
    dims = SimpleNamespace(dp_replicate_enabled=False, ep_enabled=True, get_mesh=lambda names: None)
    training = SimpleNamespace(mixed_precision_param="bfloat16", mixed_precision_reduce="float32")
    with pytest.raises(RuntimeError, match="expert_parallel_degree > 1 under torchtitan needs FSDP's per-parameter"):
        _apply_fsdp(torch.nn.Module(), dims, training, SimpleNamespace(fsdp_reshard_after_forward="default"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_torchtitan(nproc: int, out: Path, cache: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(_free_port()), "-m", "k3infra.titan.train_cpu", "--module", "k3infra.titan", "--config", "k3_debug",
           "--tokenizer.max_bytes", str(MAX_BYTES), "--tokenizer.cache_dir", str(cache), "--debug.seed", "0",
           "--dump_folder", str(out), "--metrics.enable_tensorboard", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    return stdout + stderr


def _torchtitan(nproc: int, out: Path, cache: Path, *args: str) -> str:
    return _finish(_start_torchtitan(nproc, out, cache, *args))


def _losses(out: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = [p.parent for p in out.rglob("events.out.tfevents.*")]
    acc = EventAccumulator(str(events))
    acc.Reload()
    tag = next(t for t in acc.Tags()["scalars"] if t.endswith("global_avg_loss"))
    return [e.value for e in acc.Scalars(tag)]


@pytest.mark.multiproc
def test_torchtitan_trainer_ep2_fsdp_matches_one_process(tmp_path):
    seed = tmp_path / "seed"
    _torchtitan(1, seed, tmp_path, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    common = ("--training.steps", "3", "--optimizer.name", "adamw", "--optimizer.lr", "1e-2", "--checkpoint.enable",
              "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"), "--checkpoint.interval", "1000")
    # the three runs at once: each spends most of its time importing and starting up on one core
    procs = [_start_torchtitan(1, tmp_path / "one", tmp_path, *common, "--training.local_batch_size", "8"),
             _start_torchtitan(2, tmp_path / "ep2", tmp_path, *common, "--training.local_batch_size", "4",
                               "--parallelism.expert_parallel_degree", "2"),
             _start_torchtitan(1, tmp_path / "compiled", tmp_path, *common, "--training.local_batch_size", "8",
                               "--compile.enable", "--compile.components", "model", "--compile.backend", "aot_eager")]
    try:
        log = [_finish(proc) for proc in procs][-1]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert "compiled 5 decoder layers" in log, log[-3000:]
    one, ep2, compiled = _losses(tmp_path / "one"), _losses(tmp_path / "ep2"), _losses(tmp_path / "compiled")
    assert len(one) == len(ep2) == len(compiled) == 3
    assert abs(one[0] - math.log(512)) < 0.05
    assert one[-1] < one[0] - 0.1  # it learns
    # same global batch, same weights: only the summation order differs (FSDP reduce-scatter, MoonEP combine)
    np.testing.assert_allclose(ep2, one, atol=1e-4)
    # the decoder layers under torch.compile (traced, autograd through AOT): the same steps
    np.testing.assert_allclose(compiled, one, atol=3e-4)


@pytest.mark.gpu
def test_torchtitan_trainer_k3_mini_on_gpu(tmp_path):
    """k3-mini (FlashKDA, bf16 FSDP mixed precision, full activation checkpointing) under torchtitan's own
    ``torchtitan.train`` on one GPU: 6 steps of 2 × 2048 tokens; the loss starts near ln V and falls."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA device")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(_free_port()),
           "-m", "k3infra.titan.train", "--module", "k3infra.titan", "--config", "k3_mini", "--training.steps", "6",
           "--training.local_batch_size", "2", "--training.seq_len", "2048", "--optimizer.lr", "3e-3",
           "--tokenizer.max_bytes", str(16 << 20), "--tokenizer.cache_dir", str(tmp_path),
           "--dump_folder", str(tmp_path / "mini"), "--metrics.enable_tensorboard"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = _losses(tmp_path / "mini")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(32768)) < 0.3
    assert min(losses[-2:]) < losses[0] - 0.5
