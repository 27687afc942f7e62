import gzip
import json

import pytest
import torch

from k3infra.cli import main as k3infra_main
from k3infra.train import TrainConfig, Trainer
from tests.train.tiny_lm import tiny_factory

MiB = 1 << 20


def _cfg(tmp_path, cache, **kw):
    base = dict(preset="k3-debug", steps=6, seq_len=32, batch_size=4, out=str(tmp_path / "run"), cache_dir=str(cache),
                max_corpus_bytes=MiB, qk_clip_tau=0.0, progress=False, tensorboard=False, plot=False)
    return TrainConfig(**{**base, **kw})


def test_tiny_model_learns_and_writes_outputs(tmp_path, train_cache):
    trainer = Trainer(_cfg(tmp_path, train_cache, steps=25, lr=1e-2, tensorboard=True, plot=True), tiny_factory)
    result = trainer.fit()
    assert len(result.history) == 25 and [h["step"] for h in result.history] == list(range(1, 26))
    assert result.losses[0] == pytest.approx(result.uniform_entropy, abs=0.5)
    assert min(result.losses[-5:]) < result.losses[0] - 0.5
    assert result.curve is not None and result.curve.stat().st_size > 1000
    assert list((result.out / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((result.out / "history.json").read_text())[-1]["loss"] == result.final_loss
    assert result.history[0]["mfu"] is None  # CPU: no peak FLOP/s, MFU is n/a
    for h in result.history:  # the two phases lie inside the step's wall time
        step_ms = 4 * 32 / h["tokens_per_s"] * 1e3
        assert 0 < h["forward_backward_ms"] and 0 < h["update_ms"]
        assert h["forward_backward_ms"] + h["update_ms"] <= step_ms
    assert all(layer.updates == 25 for layer in trainer.model.moe_layers())  # balancing after every step


def test_resume_continues_the_identical_curve(tmp_path, train_cache):
    full = Trainer(_cfg(tmp_path, train_cache, save_every=3), tiny_factory).fit()
    resumed = Trainer(_cfg(tmp_path, train_cache, out=str(tmp_path / "again"),
                           resume=str(tmp_path / "run" / "checkpoints" / "step_3")), tiny_factory).fit()
    assert resumed.history[:3] == full.history[:3]  # the history travels in the checkpoint
    assert [h["loss"] for h in resumed.history[3:]] == full.losses[3:]  # bit-identical on one process
    # a run folder resolves to its newest checkpoint
    latest = Trainer(_cfg(tmp_path, train_cache, out=str(tmp_path / "third"), resume=str(tmp_path / "run")),
                     tiny_factory)
    assert latest.start_step == 6
    latest.state.close()


def test_lora_freezes_base_and_router(tmp_path, train_cache):
    trainer = Trainer(_cfg(tmp_path, train_cache, steps=3, lora=4), tiny_factory)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if "router" in n)


def test_lora_router_low_lr(tmp_path, train_cache):
    trainer = Trainer(_cfg(tmp_path, train_cache, steps=2, lora=4, router_lr_scale=0.1), tiny_factory)
    trainer.state.close()
    router = {id(p) for n, p in trainer.model.named_parameters() if "router" in n}
    assert router and all(p.requires_grad for n, p in trainer.model.named_parameters() if "router" in n)
    groups = [g for opt in trainer.optimizers for g in opt.param_groups if {id(p) for p in g["params"]} == router]
    assert len(groups) == 1 and groups[0]["lr"] == pytest.approx(0.1 * trainer.cfg.lr)


@pytest.mark.parametrize("argv, match", [
    (["--config", "k4"], "--config must be one of"),
    (["--ep", "3"], "--ep 3 must divide the routed expert count"),
    (["--ep", "4"], "--ep 4 needs 4 processes"),
    (["--seq-len", "100000"], "--seq-len 100000 exceeds max_position_embeddings"),
    (["--steps", "0"], "--steps must be a positive int"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--resume", "/nonexistent/k3-run"], "--resume '/nonexistent/k3-run' does not exist"),
    (["--lora", "-2"], "--lora must be >= 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive int"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be >= 0"),
    (["--override", '{"num_experts_per_tok": 32}'], "num_experts_per_tok"),
    (["--override", '{"hidden_sise": 64}'], "--override: unknown K3Config field"),
    (["--profile", "two"], "--profile must be START:COUNT"),
    (["--profile", "0:2"], "--profile START and COUNT must be >= 1"),
    (["--steps", "4", "--profile", "3:3"], "--profile 3:3 ends at step 5, after the last step --steps 4"),
], ids=["unknown-preset", "ep-not-dividing-experts", "ep-without-processes", "seq-len-too-long", "zero-steps",
        "negative-lr", "missing-resume", "negative-lora", "zero-micro-batch", "negative-max-grad-norm",
        "bad-override-value", "unknown-override-field", "profile-not-a-range", "profile-from-step-0",
        "profile-past-the-last-step"])
def test_bad_config_errors_name_the_option(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit, match=match):
        k3infra_main(["train", "--out", str(tmp_path), "--no-progress", *argv])


def test_resume_dir_without_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        k3infra_main(["train", "--resume", str(tmp_path)])


def test_override_must_be_json_object(capsys):
    with pytest.raises(SystemExit):
        k3infra_main(["train", "--override", "[1, 2]"])
    assert "--override must be a JSON object" in capsys.readouterr().err


def test_lora_init_from_pretrained_weights(tmp_path, train_cache):
    base = Trainer(_cfg(tmp_path, train_cache, steps=3), tiny_factory)
    base.fit()
    trained = {n: p.detach().clone() for n, p in base.model.named_parameters()}
    tuned = Trainer(_cfg(tmp_path, train_cache, steps=1, lora=4, out=str(tmp_path / "lora"),
                         init_from=str(tmp_path / "run")), tiny_factory)
    weights = dict(tuned.model.get_base_model().named_parameters())
    tuned.state.close()
    assert tuned.start_step == 0
    assert all(torch.equal(weights[n], p) for n, p in trained.items()
               if n in weights)
    assert sum(n in weights for n in trained) >= 3


def test_micro_batches_accumulate_the_whole_batch_gradient(tmp_path, train_cache):
    """Two micro-batches of 2 rows give the one-forward step's loss and update (no clipping on either side)."""
    runs = {}
    for name, rows in (("whole", None), ("micro", 2)):
        trainer = Trainer(_cfg(tmp_path, train_cache, steps=2, out=str(tmp_path / name), micro_batch_size=rows,
                               max_grad_norm=0.0, optimizer="adamw"), tiny_factory)
        entries = [trainer.train_step(step) for step in range(2)]
        runs[name] = ([e["loss"] for e in entries], [p.detach().clone() for p in trainer.model.parameters()])
        trainer.state.close()
    assert runs["micro"][0] == pytest.approx(runs["whole"][0], abs=1e-5)
    for a, b in zip(runs["micro"][1], runs["whole"][1]):
        assert torch.allclose(a, b, atol=1e-5)


def test_grad_norm_clipping(tmp_path, train_cache):
    trainer = Trainer(_cfg(tmp_path, train_cache, steps=1, max_grad_norm=1e-3), tiny_factory)
    entry = trainer.train_step(0)
    assert entry["grad_norm"] > 1e-3
    # the optimizers consumed the clipped gradients: recompute the norm of what is left in .grad before zeroing
    trainer.state.close()
    trainer = Trainer(_cfg(tmp_path, train_cache, steps=1, out=str(tmp_path / "b"), max_grad_norm=1e-3), tiny_factory)
    for optimizer in trainer.optimizers:
        optimizer.zero_grad = lambda set_to_none=True: None  # keep .grad to inspect it
    trainer.train_step(0)
    norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in trainer.model.parameters() if p.grad is not None))
    assert float(norm) == pytest.approx(1e-3, rel=1e-3)
    trainer.state.close()


def test_k3_model_resumes_the_identical_curve(tmp_path, train_cache):
    """The K3 model has parameters that get no gradient in a step (so no optimizer state at save time), which a
    fresh optimizer's state dict holds anyway: resuming must load around them, not fail."""
    full = Trainer(_cfg(tmp_path, train_cache, steps=4, save_every=2)).fit()
    resumed = Trainer(_cfg(tmp_path, train_cache, steps=4, out=str(tmp_path / "again"),
                           resume=str(tmp_path / "run" / "checkpoints" / "step_2"))).fit()
    assert [h["loss"] for h in resumed.history[2:]] == full.losses[2:]


def test_profile_records_the_chosen_steps(tmp_path, train_cache):
    """``--profile 2:2``: a Chrome trace and two operator tables (by name, by input shapes) in OUT/profile, the
    operator count on the last recorded step's history entry, the steps outside the range untouched."""
    result = Trainer(_cfg(tmp_path, train_cache, steps=4, profile=(2, 2)), tiny_factory).fit()
    folder = result.out / "profile"
    trace = json.loads(gzip.decompress((folder / "trace-rank0.json.gz").read_bytes()))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)
    assert "Self CPU" in (folder / "ops-rank0.txt").read_text()
    by_shape = (folder / "ops-by-shape-rank0.txt").read_text()
    assert "Input Shapes" in by_shape and "[[" in by_shape  # one row per operator and input shapes
    recorded = [h for h in result.history if "profile_kernels_per_step" in h]
    assert [h["step"] for h in recorded] == [3] and recorded[0]["profile_kernels_per_step"] > 100
    assert recorded[0]["profile_trace"] == str(folder / "trace-rank0.json.gz")
    assert not (folder / "trace-rank0.json").exists()


def test_cli_summary_reports_the_step_phases(tmp_path, train_cache, capsys):
    code = k3infra_main(["train", "--config", "k3-debug", "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                         "--out", str(tmp_path / "run"), "--cache-dir", str(train_cache), "--max-corpus-mb", "1",
                         "--no-progress", "--no-tensorboard", "--no-plot", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "MFU n/a  forward+backward " in out and " ms (last step)" in out
    last = json.loads((tmp_path / "run" / "history.json").read_text())[-1]
    assert f"update {last['update_ms']:,.1f} ms" in out


def test_one_weight_cast_block_spans_each_steps_micro_batches(tmp_path, train_cache):
    from k3infra.model import weight_casts

    trainer = Trainer(_cfg(tmp_path, train_cache, steps=2, batch_size=4, micro_batch_size=1), tiny_factory)
    blocks = []
    trainer.model.register_forward_pre_hook(lambda module, args: blocks.append(weight_casts._casts))
    for step in range(2):
        trainer.train_step(step)
        assert not weight_casts.active()  # closed before the optimizer changes the weights
    assert len(blocks) == 8 and None not in blocks
    # one block (the same cache object, kept alive here) per optimizer step
    assert all(b is blocks[0] for b in blocks[:4]) and all(b is blocks[4] for b in blocks[4:])
    assert blocks[0] is not blocks[4]
    trainer.state.close()
