"""The pre-training loop: FSDP2 + MoonEP + Muon/AdamW + DCP, on a packed offline corpus.

Example (one process, CPU, about a minute)::

    >>> from k3infra.train import TrainConfig, train
    >>> result = train(TrainConfig(preset="k3-debug", steps=50, out="runs/debug"))
    >>> result.final_loss < result.unigram_entropy
    True
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from k3infra.model.config import K3Config, flops_per_token, preset_names
from k3infra.model.weight_casts import cast_once
from k3infra.train.callbacks import TrainerCallback
from k3infra.train.checkpoint import load_checkpoint, load_model_weights, resolve_checkpoint, save_checkpoint
from k3infra.train.compile import apply_compile, mark_packed_dynamic
from k3infra.train.data import TrainData, prepare_data
from k3infra.train.metrics import PhaseClock, TensorBoardLogger, format_mfu, mfu, peak_flops, plot_curves
from k3infra.train.optim import build_optimizers, build_schedulers
from k3infra.train.parallel import (
    ParallelState,
    apply_fsdp,
    clip_grad_norm,
    decoder_layers,
    expert_parameters,
    init_parallel,
    reduce_expert_gradients,
)

logger = logging.getLogger(__name__)

RUN_SIZES = {"k3-debug": (64, 8), "k3-mini": (4096, 64), "k3": (8192, 1024)}
"""Default ``(seq_len, batch_size)`` per preset (``K3_MODEL.md`` §3 run targets)."""
MICRO_BATCH_ROWS = {"k3-debug": None, "k3-mini": 4, "k3": 1}
"""Default rows per forward per rank (None: the rank's whole share); k3-mini's 64 × 4096 tokens do not fit one
forward on one GPU."""


@dataclass
class TrainConfig:
    """Every knob of a run; the CLI maps one option to each field."""

    preset: str = "k3-debug"
    steps: int = 200
    seq_len: int | None = None
    """Tokens per packed row (default per preset, `RUN_SIZES`)."""
    batch_size: int | None = None
    """Rows per step over all ranks (the global batch); must be divisible by the world size."""
    micro_batch_size: int | None = None
    """Rows per forward/backward on one rank (gradient accumulation); default per preset, `MICRO_BATCH_ROWS`."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (over all ranks, FSDP shards and EP experts) to this; 0 disables."""
    lr: float = 3e-3
    weight_decay: float = 0.1
    optimizer: str = "muon"
    """``muon`` (Muon for matrices, AdamW for the rest) or ``adamw`` (AdamW for everything, the baseline)."""
    ep: int = 1
    out: str = "runs/k3-train"
    resume: str | None = None
    init_from: str | None = None
    """Checkpoint (or run folder) whose model weights start this run, with fresh optimizers and step 0 (LoRA)."""
    save_every: int = 0
    """Checkpoint every this many steps (0: only at the end)."""
    lora: int = 0
    """LoRA rank (0: full pre-training)."""
    router_lr_scale: float = 0.0
    """With LoRA: 0 freezes the router, > 0 trains it at ``lr ·`` this."""
    activation_checkpointing: bool = False
    compile: bool | str = False
    """``torch.compile`` each decoder layer (True or ``"layer"``) or each child module of a decoder layer
    (``"module"``); `k3infra.train.compile.apply_compile`, after activation checkpointing, before FSDP."""
    qk_clip_tau: float = 100.0
    """MuonClip threshold τ (0 disables QK-Clip)."""
    rebalance_every: int = 0
    """With ``ep > 1``: recompute the experts' placement from the load history every this many steps and move
    them (`k3infra.train.elastic.ElasticMoE`); 0: experts stay at home."""
    profile: tuple[int, int] | None = None
    """Record optimizer steps ``(start, count)`` (1-based) with ``torch.profiler`` into ``<out>/profile/``
    (`k3infra.train.profiling.StepProfiler`); None: off."""
    seed: int = 0
    corpus: list[str] = field(default_factory=list)
    max_corpus_bytes: int | None = 16 << 20
    cache_dir: str | None = None
    device: str = "auto"
    progress: bool = True
    tensorboard: bool = True
    plot: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)
    """K3Config fields replaced on top of the preset (e.g. ``{"kda_backend": "fla"}``)."""

    def resolved(self) -> TrainConfig:
        """A copy with preset-dependent defaults filled in; raises ValueError naming a bad option."""
        if self.preset not in preset_names():
            raise ValueError(f"--config must be one of {preset_names()}, got {self.preset!r}")
        seq_len, batch = RUN_SIZES[self.preset]
        out = replace(self, seq_len=self.seq_len or seq_len, batch_size=self.batch_size or batch,
                      micro_batch_size=MICRO_BATCH_ROWS[self.preset] if self.micro_batch_size is None
                      else self.micro_batch_size)
        if out.micro_batch_size is not None and (not isinstance(out.micro_batch_size, int)
                                                 or out.micro_batch_size < 1):
            raise ValueError(f"--micro-batch-size must be a positive int, got {out.micro_batch_size!r}")
        if not out.max_grad_norm >= 0:
            raise ValueError(f"--max-grad-norm must be >= 0 (0: no clipping), got {out.max_grad_norm}")
        for name in ("steps", "seq_len", "batch_size"):
            value = getattr(out, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value!r}")
        if out.seq_len < 2:
            raise ValueError(f"--seq-len must be >= 2, got {out.seq_len}")
        if not out.lr > 0:
            raise ValueError(f"--lr must be > 0, got {out.lr}")
        if out.optimizer not in ("muon", "adamw"):
            raise ValueError(f"--optimizer must be 'muon' or 'adamw', got {out.optimizer!r}")
        if out.save_every < 0:
            raise ValueError(f"--save-every must be >= 0, got {out.save_every}")
        if out.lora < 0:
            raise ValueError(f"--lora must be >= 0 (a LoRA rank), got {out.lora}")
        if out.router_lr_scale < 0:
            raise ValueError(f"--router-lr-scale must be >= 0, got {out.router_lr_scale}")
        if out.qk_clip_tau < 0:
            raise ValueError(f"--qk-clip-tau must be >= 0, got {out.qk_clip_tau}")
        if out.compile not in (False, True, "layer", "module"):
            raise ValueError(f"--compile must be 'layer' or 'module' (or given without a value), got {out.compile!r}")
        if not isinstance(out.rebalance_every, int) or out.rebalance_every < 0:
            raise ValueError(f"--rebalance-every must be an int >= 0 (0: off), got {out.rebalance_every!r}")
        if out.profile is not None:
            start, count = out.profile
            if not (isinstance(start, int) and isinstance(count, int) and start >= 1 and count >= 1):
                raise ValueError(f"--profile START and COUNT must be ints >= 1, got {out.profile!r}")
            if start + count - 1 > out.steps:
                raise ValueError(f"--profile {start}:{count} ends at step {start + count - 1}, after the last step "
                                 f"--steps {out.steps}")
        return out


@dataclass
class TrainResult:
    """What a run produced (rank 0's view; the loss is the global-batch mean on every rank)."""

    history: list[dict]
    """Per step: ``step``, ``loss``, ``lr``, ``tokens_per_s``, ``mfu`` (None on CPU), ``forward_backward_ms`` (all
    micro-batches) and ``update_ms`` (gradient reduction, clipping, optimizers, QK-Clip, balancing; both on the
    device's timeline, so host-only time in between is in neither), ``grad_tokens``, ``grad_norm`` (before
    clipping; None with ``max_grad_norm = 0``)."""
    unigram_entropy: float
    uniform_entropy: float
    out: Path
    curve: Path | None
    checkpoint: Path | None
    peak_memory_gib: float | None
    is_main: bool = True
    """Whether this process is rank 0 (the one that prints and plots)."""

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]

    @property
    def final_loss(self) -> float:
        return self.history[-1]["loss"]


def default_model_factory(config: K3Config) -> nn.Module:
    """``K3ForCausalLM(config)``."""
    from k3infra.model import K3ForCausalLM

    return K3ForCausalLM(config)


def _check_model_config(cfg: TrainConfig, config: K3Config) -> None:
    if not isinstance(cfg.ep, int) or cfg.ep < 1:
        raise ValueError(f"--ep must be a positive int, got {cfg.ep!r}")
    if config.n_routed_experts % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} must divide the routed expert count n_routed_experts="
                         f"{config.n_routed_experts} of --config {cfg.preset}")
    if cfg.seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings} of --config {cfg.preset}")


def _check_world(cfg: TrainConfig, world_size: int) -> None:
    if cfg.batch_size % world_size:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the world size {world_size} "
                         "(rows per step are split evenly over the ranks)")


class Trainer:
    """Builds data, model, optimizers and parallelism from a `TrainConfig`, then `fit` runs the loop.

    Args:
        cfg: the run settings.
        model_factory: ``K3Config -> nn.Module`` with the `K3ForCausalLM` forward contract (default: the K3 model).
        callbacks: `TrainerCallback` hooks (``cfg.rebalance_every`` adds an `ElasticMoE`, ``cfg.profile`` a
            `profiling.StepProfiler`).
    """

    def __init__(self, cfg: TrainConfig, model_factory: Callable[[K3Config], nn.Module] | None = None,
                 callbacks: list[TrainerCallback] | None = None) -> None:
        self.cfg = cfg = cfg.resolved()
        self.callbacks = list(callbacks or [])
        if cfg.rebalance_every:
            from k3infra.train.elastic import ElasticMoE

            self.callbacks.append(ElasticMoE(cfg.rebalance_every))
        if cfg.profile is not None:
            from k3infra.train.profiling import StepProfiler

            self.callbacks.append(StepProfiler(*cfg.profile))
        resume = resolve_checkpoint(cfg.resume) if cfg.resume else None
        self.init_from = resolve_checkpoint(cfg.init_from, option="--init-from") if cfg.init_from else None
        unknown = sorted(k for k in cfg.overrides if k not in K3Config.__annotations__ and not hasattr(K3Config, k))
        if unknown:
            raise ValueError(f"--override: unknown K3Config field(s) {unknown}")
        self.config = K3Config.from_preset(cfg.preset, **cfg.overrides)
        _check_model_config(cfg, self.config)
        self.state: ParallelState = init_parallel(cfg.ep, cfg.device)
        try:
            _check_world(cfg, self.state.world_size)
            self.data = self._prepare_data()
            self._build(model_factory or default_model_factory)
            self.history: list[dict] = []
            self.start_step = 0
            for callback in self.callbacks:
                callback.setup(self)
            if resume is not None:
                trainer_state = load_checkpoint(resume, model=self.model, optimizers=self.optimizers,
                                                schedulers=self.schedulers, expert_names=set(self.expert_names),
                                                ep_rank=self.state.ep_rank)
                self.start_step = trainer_state["step"]
                self.history = trainer_state["history"]
                saved = trainer_state.get("callbacks", {})
                unattached = sorted(name for name, value in saved.items() if value and name not in
                                    {callback.name for callback in self.callbacks})
                if unattached:  # e.g. experts saved in moved slots: loading them at home would be wrong
                    raise ValueError(f"--resume {resume}: the checkpoint holds the state of {unattached} "
                                     "(--rebalance-every for ElasticMoE); resume with the same options")
                for callback in self.callbacks:
                    callback.load_state_dict(saved.get(callback.name, {}))
                if self.start_step > cfg.steps:
                    raise ValueError(f"--steps {cfg.steps} is below the checkpoint's step {self.start_step}")
        except BaseException:
            self.state.close()
            raise

    def _prepare_data(self) -> TrainData:
        cfg = self.cfg

        def prepare() -> TrainData:
            return prepare_data(cfg.corpus or None, vocab_size=self.config.vocab_size, seq_len=cfg.seq_len,
                                seed=cfg.seed, max_bytes=cfg.max_corpus_bytes, cache_dir=cfg.cache_dir)

        # rank 0 trains and caches the tokenizer; the others then read the cache
        data = prepare() if self.state.is_main else None
        dist.barrier()
        return data if data is not None else prepare()

    def _build(self, model_factory: Callable[[K3Config], nn.Module]) -> None:
        cfg, state = self.cfg, self.state
        torch.manual_seed(cfg.seed)
        model = model_factory(self.config)
        if self.init_from is not None:
            load_model_weights(self.init_from, model)
        if cfg.ep > 1:
            # the buffers live on the training device (the model is still on the CPU here) and carry the
            # activations' dtype (fp32 under bf16 autocast would double the dispatched bytes)
            model.enable_expert_parallel(state.ep_group, max_tokens_per_rank=self._micro_rows() * cfg.seq_len,
                                         device=state.device, dtype=self._compute_dtype())
        self.moe_layers = list(model.moe_layers()) if hasattr(model, "moe_layers") else []
        self.expert_names = list(expert_parameters(model))
        experts = list(expert_parameters(model).values())
        if cfg.lora:
            from k3infra.train.lora import apply_lora, router_parameters

            model = apply_lora(model, rank=cfg.lora)
            for param in router_parameters(model):
                param.requires_grad_(cfg.router_lr_scale > 0)
            self.expert_names = list(expert_parameters(model))
        model.to(state.device)
        if cfg.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            layers = set(decoder_layers(model))
            if not layers:
                raise ValueError("--activation-checkpointing needs model.model.layers (a transformers decoder)")
            apply_activation_checkpointing(model, check_fn=lambda m: m in layers)
        if cfg.compile:
            apply_compile(decoder_layers(model), scope="layer" if cfg.compile is True else cfg.compile)
        if state.world_size > 1:
            apply_fsdp(model, state, ignored=set(experts), param_dtype=self._compute_dtype())
        self.model = model
        self.experts = experts
        self.optimizers = build_optimizers(
            model, lr=cfg.lr, weight_decay=cfg.weight_decay, use_muon=cfg.optimizer == "muon" and not cfg.lora,
            router_lr_scale=cfg.router_lr_scale if cfg.lora else 1.0, replicated=experts,
            replica_group=state.replica_group)
        self.schedulers = build_schedulers(self.optimizers, cfg.steps)
        self.flops_per_token = flops_per_token(self.config, cfg.seq_len)
        self.peak = peak_flops(state.device)

    # -- one step --------------------------------------------------------------------------------------------

    def _micro_rows(self) -> int:
        per_rank = self.cfg.batch_size // self.state.world_size
        return min(per_rank, self.cfg.micro_batch_size or per_rank)

    def _compute_dtype(self) -> torch.dtype | None:
        """bf16 on CUDA (autocast, FSDP's parameter all-gathers, MoonEP's buffers), None (fp32) elsewhere."""
        return torch.bfloat16 if self.state.device.type == "cuda" else None

    def _autocast(self):
        dtype = self._compute_dtype()
        return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def train_step(self, step: int) -> dict:
        """Forward, backward and update on step ``step``'s global batch. Returns the history entry."""
        cfg, state = self.cfg, self.state
        start = time.perf_counter()
        micro = self.data.dataset.micro_batches(step, cfg.batch_size, state.rank, state.world_size,
                                                cfg.micro_batch_size)
        total_targets = self.data.dataset.num_targets(step, cfg.batch_size)
        self.model.train()
        local_sum = torch.zeros((), device=state.device)
        clock = PhaseClock(state.device)
        clock.mark()
        with cast_once():
            for batch in micro:
                batch = batch.to(state.device)
                if cfg.compile:
                    mark_packed_dynamic(batch.cu_seqlens)
                with self._autocast():
                    output = self.model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens,
                                        labels=batch.labels)
                # this rank's token-loss sum over the global target count: the ranks' terms add up to the global mean
                part = output.loss.float() * batch.num_targets if batch.num_targets else output.loss.float() * 0.0
                (part * (state.world_size / total_targets)).backward()
                local_sum += part.detach()
                del output, part
        clock.mark()
        if self.experts and state.world_size > 1:
            reduce_expert_gradients(self.experts, state)
        grad_norm = None
        if cfg.max_grad_norm > 0:
            grad_norm = clip_grad_norm(self.model, self.experts, state, cfg.max_grad_norm)
        lrs = [group["lr"] for group in self.optimizers[0].param_groups]
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for scheduler in self.schedulers:
            scheduler.step()
        self._after_update()
        clock.mark()
        loss = local_sum.detach()
        if state.world_size > 1:
            dist.all_reduce(loss)
        loss = loss.item() / total_targets
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        forward_backward_ms, update_ms = clock.spans_ms()
        tokens_per_s = cfg.batch_size * cfg.seq_len / seconds
        return {"step": step + 1, "loss": loss, "lr": lrs[0], "tokens_per_s": tokens_per_s,
                "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak, state.world_size),
                "forward_backward_ms": forward_backward_ms, "update_ms": update_ms,
                "grad_tokens": total_targets, "grad_norm": grad_norm}

    def _after_update(self) -> None:
        """MuonClip (QK-Clip on the MLA heads) and the Quantile Balancing bias update."""
        if self.cfg.qk_clip_tau > 0 and not self.cfg.lora:
            from k3infra.model.qk_clip import apply_qk_clip

            with torch.no_grad():
                apply_qk_clip(self.model, self.cfg.qk_clip_tau)
        for layer in self.moe_layers:
            layer.update_balancing()

    # -- the loop --------------------------------------------------------------------------------------------

    def _trainer_state(self, step: int) -> dict:
        settings = {k: v for k, v in asdict(self.cfg).items() if k not in ("resume", "init_from", "progress")}
        return {"step": step, "history": self.history, "config": settings,
                "corpus_fingerprint": self.data.corpus_fingerprint,
                "callbacks": {callback.name: callback.state_dict() for callback in self.callbacks}}

    def save(self, step: int) -> Path:
        """Write ``<out>/checkpoints/step_<step>`` (collective)."""
        path = Path(self.cfg.out) / "checkpoints" / f"step_{step}"
        return save_checkpoint(path, model=self.model, optimizers=self.optimizers, schedulers=self.schedulers,
                               trainer_state=self._trainer_state(step), expert_names=set(self.expert_names),
                               ep_rank=self.state.ep_rank)

    def fit(self) -> TrainResult:
        """Run from the start (or resumed) step to ``cfg.steps``; checkpoint, log, plot. Closes the group."""
        cfg, state = self.cfg, self.state
        out = Path(cfg.out)
        writer = TensorBoardLogger(out) if state.is_main and cfg.tensorboard else None
        checkpoint = None
        try:
            for callback in self.callbacks:
                callback.on_fit_begin(self, self.start_step)
            with _progress(cfg.progress and state.is_main, cfg.steps, self.start_step) as advance:
                for step in range(self.start_step, cfg.steps):
                    entry = self.train_step(step)
                    for callback in self.callbacks:
                        callback.on_step_end(self, step, entry)
                    self.history.append(entry)
                    if writer is not None:
                        writer.log(entry["step"], {name: entry[name] for name in (
                            "loss", "lr", "mfu", "tokens_per_s", "forward_backward_ms", "update_ms")})
                    advance(entry)
                    if not cfg.progress and state.is_main:
                        logger.info("step %d/%d loss %.4f %.0f tok/s MFU %s", entry["step"], cfg.steps, entry["loss"],
                                    entry["tokens_per_s"], format_mfu(entry["mfu"]))
                    done = entry["step"]
                    if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps:
                        checkpoint = self.save(done)
            curve = None
            if state.is_main:
                (out / "history.json").write_text(json.dumps(self.history, indent=1))
                if cfg.plot and self.history:
                    curve = plot_curves(self.history, out / "curve.png", unigram_entropy=self.data.unigram_entropy,
                                        uniform_entropy=self.data.uniform_entropy)
            peak_mem = torch.cuda.max_memory_allocated() / 2**30 if state.device.type == "cuda" else None
            return TrainResult(self.history, self.data.unigram_entropy, self.data.uniform_entropy, out, curve,
                               checkpoint, peak_mem, state.is_main)
        finally:
            if writer is not None:
                writer.close()
            for callback in self.callbacks:
                callback.on_fit_end(self)
            self.state.close()


@contextlib.contextmanager
def _progress(enabled: bool, total: int, completed: int):
    """A rich progress bar showing loss, tokens/s and MFU; yields ``advance(entry)``."""
    if not enabled:
        yield lambda entry: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[info]}")) as bar:
        task = bar.add_task("train", total=total, completed=completed, info="")

        def advance(entry: dict) -> None:
            info = (f"loss {entry['loss']:.3f}  {entry['tokens_per_s']:,.0f} tok/s  "
                    f"MFU {format_mfu(entry['mfu'])}")
            bar.update(task, advance=1, info=info)

        yield advance


def train(cfg: TrainConfig, model_factory: Callable[[K3Config], nn.Module] | None = None,
          callbacks: list[TrainerCallback] | None = None) -> TrainResult:
    """Build a `Trainer` and run it (see `TrainConfig` for the options)."""
    return Trainer(cfg, model_factory, callbacks).fit()
