"""SFT then GRPO on the seeded tool tasks, writing a run directory the viewer reads.

Run directory: ``config.json``, ``metrics.jsonl`` (one line per GRPO iteration and per evaluation),
``groups.jsonl`` (every group: task, parent trajectory, children with actions, observations, rewards),
``traj/`` (trajectories in the project's JSONL format), ``curves.png`` and ``tb/`` (TensorBoard).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass

import torch

from agentenv.posttrain.grpo import group_advantages, grpo_loss, sft_loss
from agentenv.posttrain.policy import encode_segments, pad_batch, token_logprobs
from agentenv.posttrain.rollout import (
    EnvClock,
    evaluate,
    fork_groups,
    record_transcripts,
    rollout_groups,
    transcript_segments,
)
from agentenv.posttrain.tasks import make_tasks
from agentenv.rl.policy import ScriptedPolicy
from agentenv.rl.pool import EnvPool

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Sizes and hyper-parameters of one SFT + GRPO run."""

    seed: int = 0
    sft_tasks: int = 8
    sft_steps: int = 40
    sft_lr: float = 3e-3
    grpo_iters: int = 20
    groups_per_iter: int = 4
    group_size: int = 8
    grpo_lr: float = 5e-4
    clip_eps: float = 0.2
    beta: float = 0.04
    grpo_epochs: int = 1
    temperature: float = 1.0
    prefetch: bool = True
    """Fork the next GRPO iteration's groups while this one's policy works."""
    fsync: str = "none"
    """Trajectory durability (`TrajectoryWriter`): lines reach the OS at once (a crash of this process loses
    nothing) but are not fsynced; ``step`` costs an fsync per step on the event loop (~3 ms on a busy disk)."""
    max_action_tokens: int = 24
    train_tasks: int = 64
    eval_tasks: int = 32
    eval_samples: int = 0
    """Also score held-out success of the sampling policy (at `temperature`): this many samples per task."""
    max_envs: int = 64
    task_family: str = "code"
    """Which `agentenv.posttrain.tasks.FAMILIES` the train and held-out tasks come from."""


def sft(model, tokenizer, samples: list[list[tuple[str, bool]]], *, steps: int, lr: float, batch: int = 8,
        seed: int = 0) -> list[float]:
    """Supervised fine-tuning on segment lists; returns the loss per step."""
    rng = random.Random(seed)
    encoded = [encode_segments(tokenizer, s) for s in samples]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        ids, mask = pad_batch([rng.choice(encoded) for _ in range(batch)], tokenizer.pad_token_id)
        loss = sft_loss(token_logprobs(model, ids, tokenizer.pad_token_id), mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def grpo_step(model, ref_model, opt, tokenizer, groups, *, clip_eps: float, beta: float, epochs: int = 1) -> dict:
    """One GRPO update from finished groups (lists of `Episode`); returns loss and stats.

    Groups whose rewards are all equal have zero advantage everywhere and carry no signal: they are left out
    of the batch (so they do not dilute the mean), and when no group is left the optimizer does not step
    (Adam's moments would otherwise keep moving the weights on a zero loss).
    """
    informative = [g for g in groups if len({e.reward for e in g}) > 1]
    stats = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "informative_groups": len(informative)}
    if not informative:
        return stats
    rewards = torch.tensor([[e.reward for e in g] for g in informative], dtype=torch.float32)
    adv = group_advantages(rewards).flatten()
    episodes = [e for g in informative for e in g]
    ids, mask = pad_batch([encode_segments(tokenizer, e.segments) for e in episodes], tokenizer.pad_token_id)
    with torch.no_grad():
        old = token_logprobs(model, ids, tokenizer.pad_token_id)
        ref = token_logprobs(ref_model, ids, tokenizer.pad_token_id) if beta > 0 else None
    model.train()
    for _ in range(epochs):
        loss, step_stats = grpo_loss(token_logprobs(model, ids, tokenizer.pad_token_id), old, adv, mask,
                                     clip_eps=clip_eps, beta=beta, logp_ref=ref)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return stats | step_stats | {"loss": float(loss.detach())}


def _success(episodes) -> float:
    return sum(e.reward >= 1.0 for e in episodes) / max(1, len(episodes))


async def _sampled_success(pool, held_out, model, tokenizer, cfg: TrainConfig, clock: EnvClock) -> float:
    """Held-out success of the sampling policy: `cfg.eval_samples` episodes per task at `cfg.temperature`, with
    the same sampling seed before and after GRPO."""
    gen = torch.Generator().manual_seed(cfg.seed + 7919)
    tasks = [t for t in held_out for _ in range(cfg.eval_samples)]
    return _success(await evaluate(pool, tasks, model, tokenizer, clock=clock, max_new_tokens=cfg.max_action_tokens,
                                   temperature=cfg.temperature, generator=gen))


def _write(path: str, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


async def run(run_dir: str | os.PathLike, provider, model, tokenizer, config: TrainConfig | None = None) -> dict:
    """SFT on scripted transcripts, then GRPO with forked groups; evaluates held-out success after each phase.

    Returns:
        ``{"solver", "sft", "grpo"}`` held-out success rates, ``env_share`` and ``seconds``.
    """
    import copy

    cfg = config or TrainConfig()
    run_dir = os.fspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    traj_dir = os.path.join(run_dir, "traj")
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    metrics_path, groups_path = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "groups.jsonl")
    for p in (metrics_path, groups_path):
        if os.path.exists(p):
            os.remove(p)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    train_tasks = make_tasks(cfg.train_tasks, split="train", start=cfg.seed * 10_000, family=cfg.task_family)
    held_out = make_tasks(cfg.eval_tasks, split="held_out", start=cfg.seed * 10_000, family=cfg.task_family)
    t_start = time.perf_counter()
    clock = EnvClock()
    async with EnvPool(provider, max_envs=cfg.max_envs, record_dir=traj_dir, fsync=cfg.fsync) as pool:
        sft_set = train_tasks[:cfg.sft_tasks]
        ids = await clock(record_transcripts(pool, sft_set))
        solver = await clock(pool.run(held_out, ScriptedPolicy))
        samples = [transcript_segments(os.path.join(traj_dir, f"{i}.jsonl"), t) for i, t in zip(ids, sft_set)]
        losses = sft(model, tokenizer, samples, steps=cfg.sft_steps, lr=cfg.sft_lr, seed=cfg.seed)
        ref_model = copy.deepcopy(model).eval() if cfg.beta > 0 else None
        ev = await evaluate(pool, held_out, model, tokenizer, clock=clock, max_new_tokens=cfg.max_action_tokens)
        result = {"solver": sum(r.reward >= 1.0 for r in solver) / len(solver), "sft": _success(ev)}
        if cfg.eval_samples:
            result["sft_sampled"] = await _sampled_success(pool, held_out, model, tokenizer, cfg, clock)
        _write(metrics_path, {"phase": "sft", "iter": 0, "sft_loss_first": losses[0], "sft_loss_last": losses[-1],
                              "heldout_success": result["sft"], "solver_success": result["solver"],
                              "heldout_success_sampled": result.get("sft_sampled")})
        t_warm = time.perf_counter()
        await clock(pool.warm(train_tasks), "template")
        result["template_s"] = time.perf_counter() - t_warm
        env_shares = await _grpo(pool, model, ref_model, tokenizer, train_tasks, cfg, rng, gen, clock,
                                 metrics_path, groups_path)
        ev = await evaluate(pool, held_out, model, tokenizer, clock=clock, max_new_tokens=cfg.max_action_tokens)
        result["grpo"] = _success(ev)
        if cfg.eval_samples:
            result["grpo_sampled"] = await _sampled_success(pool, held_out, model, tokenizer, cfg, clock)
        _write(metrics_path, {"phase": "final", "iter": cfg.grpo_iters, "heldout_success": result["grpo"],
                              "heldout_success_sampled": result.get("grpo_sampled")})
    result["seconds"] = time.perf_counter() - t_start
    result["env_share"] = sum(env_shares) / len(env_shares) if env_shares else 0.0
    write_curves(run_dir)
    return result


async def _grpo(pool, model, ref_model, tokenizer, train_tasks, cfg: TrainConfig, rng: random.Random, gen,
                clock: EnvClock, metrics_path: str, groups_path: str) -> list[float]:
    """The GRPO iterations; returns each one's env share. With `cfg.prefetch`, the next iteration's groups are
    reset and forked (on the pool's workers) while this one's policy samples and updates; their wall time is
    then only what the iteration still waits for (``fork_wait``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.grpo_lr)
    background = EnvClock()
    env_shares: list[float] = []
    tasks = rng.sample(train_tasks, cfg.groups_per_iter)
    pending = asyncio.ensure_future(fork_groups(pool, tasks, cfg.group_size, clock=background)) \
        if cfg.prefetch else None
    try:
        for it in range(1, cfg.grpo_iters + 1):
            t0, policy0, parts0 = time.perf_counter(), clock.policy_seconds, dict(clock.parts)
            forked = None
            if pending is not None:
                forked, pending = await clock(pending, "fork_wait"), None
            next_tasks = rng.sample(train_tasks, cfg.groups_per_iter) if it < cfg.grpo_iters else None
            if cfg.prefetch and next_tasks is not None:
                pending = asyncio.ensure_future(fork_groups(pool, next_tasks, cfg.group_size, clock=background))
            groups = await rollout_groups(pool, tasks, model, tokenizer, cfg.group_size, temperature=cfg.temperature,
                                          generator=gen, clock=clock, max_new_tokens=cfg.max_action_tokens,
                                          forked=forked, close_after=pending)
            t_update = time.perf_counter()
            stats = grpo_step(model, ref_model, opt, tokenizer, groups, clip_eps=cfg.clip_eps, beta=cfg.beta,
                              epochs=cfg.grpo_epochs)
            update_s = time.perf_counter() - t_update
            wall = time.perf_counter() - t0
            sample_s = clock.policy_seconds - policy0
            flat = [e for g in groups for e in g]
            row = {"phase": "grpo", "iter": it, "reward": sum(e.reward for e in flat) / len(flat),
                   "train_success": _success(flat), "wall_s": wall, "sample_s": sample_s, "update_s": update_s,
                   "env_share": max(0.0, wall - sample_s - update_s) / wall,
                   "env_parts_s": {k: v - parts0.get(k, 0.0) for k, v in clock.parts.items()
                                   if v - parts0.get(k, 0.0) > 0}, **stats}
            env_shares.append(row["env_share"])
            _write(metrics_path, row)
            for g_index, (task, group) in enumerate(zip(tasks, groups)):
                _write(groups_path, {"iter": it, "group": g_index, "task_id": task.id,
                                     "instruction": task.instruction, "parent": group[0].parent_id,
                                     "children": [asdict(e) | {"segments": None} for e in group]})
            tasks = next_tasks
    finally:
        if pending is not None:  # an iteration failed: the prefetched groups are closed, not leaked
            try:
                left = await pending
                await asyncio.gather(*(k.close() for b in left.envs for k in b))
            except Exception as e:  # noqa: BLE001 - the iteration's own error is the one to raise
                log.warning("closing prefetched groups: %r", e)
    return env_shares


def write_curves(run_dir: str) -> None:
    """``curves.png`` (reward, success, loss, env-time share per GRPO iteration) and TensorBoard scalars under
    ``tb/``, from ``metrics.jsonl``; each is skipped with a log line when its library is missing."""
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8")]
    grpo = [r for r in rows if r["phase"] == "grpo"]
    keys = ("reward", "train_success", "loss", "env_share")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3))
        for ax, key in zip(axes, keys):
            ax.plot([r["iter"] for r in grpo], [r[key] for r in grpo])
            ax.set_title(key)
            ax.set_xlabel("GRPO iteration")
        fig.tight_layout()
        fig.savefig(os.path.join(run_dir, "curves.png"), dpi=80)
        plt.close(fig)
    except ImportError:
        log.info("matplotlib missing: no curves.png")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard missing: no tb/")
        return
    writer = SummaryWriter(os.path.join(run_dir, "tb"))
    for r in grpo:
        for key in keys:
            writer.add_scalar(f"grpo/{key}", r[key], r["iter"])
    for r in rows:
        if "heldout_success" in r:
            writer.add_scalar(f"heldout_success/{r['phase']}", r["heldout_success"], r["iter"])
    writer.close()
