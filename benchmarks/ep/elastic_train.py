"""Training a small `moonep.elastic.PlacedMoELayer` on gloo under Zipf(1.2) routing drift, on local processes.

The pieces (model, data, step, process runner) are shared with ``tests/moonep/test_placed_training.py`` and
``tests/moonep/test_elastic_replicas.py``. As a benchmark, `main` trains ``R`` processes twice on the same
data from the same weights: once on the initial placement (never rebalanced), once rebalanced every
``--every`` steps from the load history (`PlacedMoELayer.rebalance`, weights and AdamW state moved), and
reports both loss curves and the max/mean slots per rank of each.

Data: every token picks ``K`` distinct experts from a Zipf(1.2) popularity whose order drifts (random
neighbour swaps every step); its input carries a bump on those experts' coordinates (``H >= E``) and the
router starts as a scaled identity, so the learned router follows the drifting popularity.

Usage: python -m benchmarks.ep.elastic_train [--ranks 4] [--steps 60] [--every 5] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing as mp
import queue
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# Before any worker forms a group: torch.distributed.nn.functional binds ``group.WORLD`` as a default argument
# when it is first imported (the first AdamW imports it, through torch._dynamo); after `init_process_group`,
# that default would keep the gloo group alive past `destroy_process_group` (see `leave_group`).
import torch.distributed.nn.functional  # noqa: F401

ZIPF_S = 1.2
PLACED_TIMEOUT_S = 30.0
"""Seconds a collective of the placed-training run may wait for a peer (all ranks stay alive there)."""
EXIT_TIMEOUT_S = 30.0
"""Seconds a worker may take to exit after its result (slow on a loaded 2-core machine)."""


@dataclass(frozen=True)
class Config:
    experts: int = 8
    hidden: int = 8
    intermediate: int = 16
    top_k: int = 2
    tokens: int = 60
    """Global batch (tokens per step over all ranks; a multiple of every group size the job goes through)."""
    extra_slots: int = 2
    """Replica slots per rank beyond ``ceil(E / R)``."""
    min_ranks: int = 3
    lr: float = 1e-2
    seed: int = 0


def slots_per_rank(cfg: Config, ranks: int) -> int:
    return math.ceil(cfg.experts / ranks) + cfg.extra_slots


def zipf_batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``x`` ``[T, H]`` and target ``y`` ``[T, H]`` (same on every rank)."""
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
    order = torch.randperm(cfg.experts, generator=gen)
    for _ in range(step + 1):  # the drift up to this step: one neighbour swap per step
        i = int(torch.randint(0, cfg.experts - 1, (1,), generator=gen))
        order[[i, i + 1]] = order[[i + 1, i]]
    p = 1.0 / torch.arange(1, cfg.experts + 1, dtype=torch.float64) ** ZIPF_S
    popularity = torch.empty_like(p)
    popularity[order] = p / p.sum()
    gen = torch.Generator().manual_seed(cfg.seed * 104729 + step)
    idx = torch.multinomial(popularity.expand(cfg.tokens, -1), cfg.top_k, replacement=False, generator=gen)
    x = 0.3 * torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    x.scatter_add_(1, idx, torch.full(idx.shape, 2.0))
    return x, torch.tanh(x.flip(1) * 2.0)


def build_layer(cfg: Config, *, buffer_timeout_s: float = 5.0) -> torch.nn.Module:
    """A `PlacedMoELayer` on the default group, weights drawn for all logical experts (same on every rank)."""
    from moonep import Buffer
    from moonep.elastic import PlacedMoELayer

    world = dist.get_world_size()
    X = world * slots_per_rank(cfg, world)
    S = cfg.tokens // cfg.min_ranks
    buffer = Buffer(None, S, cfg.hidden, cfg.top_k, X, dtype=torch.float32, balanced=False, timeout_s=buffer_timeout_s)
    layer = PlacedMoELayer(buffer, cfg.intermediate, cfg.experts, num_shared=1)
    gen = torch.Generator().manual_seed(cfg.seed)
    E, H, Fi = cfg.experts, cfg.hidden, cfg.intermediate
    with torch.no_grad():
        layer.router.weight_EH.copy_(3.0 * torch.eye(E, H))
        full = {
            "w1_PFH": torch.randn(E, Fi, H, generator=gen) * H**-0.5,
            "w2_PHF": torch.randn(E, H, Fi, generator=gen) * Fi**-0.5,
            "shared_w1_FH": torch.randn(Fi, H, generator=gen) * H**-0.5,
            "shared_w2_HF": torch.randn(H, Fi, generator=gen) * Fi**-0.5,
        }
        rows = torch.tensor(layer.logical_ids())
        layer.w1_PFH.copy_(full["w1_PFH"][rows])
        layer.w2_PHF.copy_(full["w2_PHF"][rows])
        layer.shared_w1_FH.copy_(full["shared_w1_FH"])
        layer.shared_w2_HF.copy_(full["shared_w2_HF"])
    return layer


def make_optimizer(cfg: Config) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)


def train_step(
    cfg: Config, layer: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, before_backward=None
) -> tuple[float, float]:
    """One step on this rank's share of the global batch; returns ``(global loss, max/mean slots per rank)``.

    The loss is normalised by the global element count and the replicated weights' gradients are summed over
    the group, so the step computes the same thing on any group size. ``before_backward()`` runs between the
    forward and the backward (the tests kill a worker there)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = zipf_batch(cfg, step)
    n = cfg.tokens // world
    output = layer(x[rank * n : rank * n + n])
    if before_backward is not None:
        before_backward()
    loss = ((output.out_sH - y[rank * n : rank * n + n]) ** 2).sum() / (cfg.tokens * cfg.hidden)
    optimizer.zero_grad()
    loss.backward()
    for name, param in layer.named_parameters():
        if name not in ("w1_PFH", "w2_PHF"):
            dist.all_reduce(param.grad)
    layer.sync_replica_grads()
    total = loss.detach().clone()
    dist.all_reduce(total)  # every collective of the step before the update: a failure never leaves it half-applied
    optimizer.step()
    per_rank = output.tokens_per_expert_E.double().view(world, -1).sum(1)
    return float(total), float(per_rank.max() / per_rank.mean())


def run_processes(
    target: Callable[..., None], args_of: dict[str, tuple], timeout_s: float, killed: tuple[str, ...] = ()
) -> dict[str, object]:
    """Run ``target(member, results_queue, *args_of[member])`` in one spawned process per member.

    Each worker puts ``(member, ok, value)`` on the queue. Returns ``{member: value}`` of every member not in
    ``killed``; raises AssertionError on a worker's failure, a timeout, a process left alive or an unclean exit.
    """
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = {m: ctx.Process(target=target, args=(m, results, *a)) for m, a in args_of.items()}
    outcome: dict[str, object] = {}
    try:
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + timeout_s
        expected = len(procs) - len(killed)
        while len(outcome) < expected and time.monotonic() < deadline:
            try:
                member, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                continue
            assert ok, f"member {member} failed:\n{value}"
            outcome[member] = value
        assert len(outcome) == expected, f"only {sorted(outcome)} finished within {timeout_s} s"
    finally:
        for p in procs.values():
            p.join(timeout=EXIT_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
    assert not any(p.is_alive() for p in procs.values()), "a worker process was left behind"
    exits = {m: p.exitcode for m, p in procs.items()}
    assert all(exits[m] == -9 for m in killed), f"killed workers did not die by SIGKILL: {exits}"
    assert all(code == 0 for m, code in exits.items() if m not in killed), f"workers did not exit cleanly: {exits}"
    return outcome


def leave_group() -> None:
    """Leave the default gloo group for good: a barrier (no rank closes its connections while a peer still
    reads), then `dist.destroy_process_group`, which must free the group here so that its worker threads are
    joined while the interpreter is alive.

    A gloo worker thread drops its reference to a collective's tensors a moment after the caller's wait has
    returned. If the group lives on into interpreter exit, that drop can fall in the finalization, where taking
    the GIL to free a tensor's Python object ends the thread inside a C++ destructor: "terminate called without
    an active exception", SIGABRT after a clean result.

    Raises:
        RuntimeError: something still references the group after `destroy_process_group`.
    """
    group = weakref.ref(dist.group.WORLD)
    dist.barrier()
    dist.destroy_process_group()
    if group() is not None:
        raise RuntimeError(
            "the default process group outlived destroy_process_group (e.g. a module first imported after "
            "init_process_group bound group.WORLD as a default argument); its gloo threads would run into "
            "interpreter exit"
        )


def placed_training_worker(member: str, results: mp.Queue, port: int, world: int, cfg: Config, steps: int, every: int):
    """Train twice in one process group: ``static`` (initial placement) and ``rebalanced`` (every ``every``)."""
    try:
        rank = int(member)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        out: dict[str, dict] = {}
        for mode in ("static", "rebalanced"):
            # no rank is killed here: a long timeout only keeps a loaded machine's slow exchange from reading as a
            # dead peer
            layer = build_layer(cfg, buffer_timeout_s=PLACED_TIMEOUT_S)
            optimizer = make_optimizer(cfg)(layer)
            losses, balance, received, seconds = [], [], 0, 0.0
            for step in range(steps):
                if mode == "rebalanced" and step and step % every == 0:
                    t0 = time.perf_counter()
                    received += layer.rebalance(optimizer)
                    seconds += time.perf_counter() - t0
                loss, max_over_mean = train_step(cfg, layer, optimizer, step)
                losses.append(loss)
                balance.append(max_over_mean)
            layer.buffer.destroy()
            out[mode] = {"losses": losses, "max_over_mean": balance, "rows_received": received, "rebalance_s": seconds}
        leave_group()
        results.put((member, True, out))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((member, False, traceback.format_exc()))


def run_placed_training(world: int, cfg: Config, steps: int, every: int, timeout_s: float) -> dict[str, dict]:
    """`placed_training_worker` on ``world`` processes; returns rank 0's result."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    args = {str(r): (store.port, world, cfg, steps, every) for r in range(world)}
    return run_processes(placed_training_worker, args, timeout_s)["0"]


def expert_state(layer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, list]:
    """``{logical e: [[w1 row, its AdamW exp_avg, exp_avg_sq, the same for w2], ...one list per copy]}`` of
    every row this rank holds, as numpy arrays (a queue would pass tensors by shared memory)."""
    out: dict[int, list] = {}
    for p, e in enumerate(layer.logical_ids()):
        tensors = []
        for param in (layer.w1_PFH, layer.w2_PHF):
            state = optimizer.state[param]
            tensors += [t[p].detach().numpy().copy() for t in (param, state["exp_avg"], state["exp_avg_sq"])]
        out.setdefault(e, []).append(tensors)
    return out


def elastic_worker(
    member: str,
    results: mp.Queue,
    port: int,
    ckpt: str,
    initial: list[str],
    kills: dict[str, int | str],
    cfg: Config,
    steps: int,
    checkpoint_every: int,
    rebalance_every: int,
    wipe_by: str,
    join_after: str,
) -> None:
    """One `ElasticEP` worker training a `PlacedMoELayer`; ``kills[member]``: SIGKILLed at that step, between
    its forward and its backward (members with the same step: the first kills them all at once; the
    checkpoint directory is removed first if it is ``wipe_by``), or, for ``"regroup"``, while the survivors
    regroup: once agreed into the next generation, before it says it is ready to form it. A member not in
    ``initial`` asks to join once ``join_after`` was killed."""
    try:
        import os
        import shutil
        import signal

        from moonep.elastic import ElasticEP

        elastic = ElasticEP(
            "127.0.0.1", port, member, lambda: build_layer(cfg), ckpt, initial, checkpoint_every=checkpoint_every,
            rebalance_every=rebalance_every, stale_s=1.0, timeout_s=30.0, make_optimizer=make_optimizer(cfg),
        )  # fmt: skip
        if kills.get(member) == "regroup":

            def die_when_agreed(*_: object) -> None:
                elastic.store.set(f"test/killed/{member}", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

            elastic.membership.gather = die_when_agreed
        if member not in initial:
            elastic.store.wait([f"test/killed/{join_after}"], datetime.timedelta(seconds=60))
        layer = elastic.start()
        losses: dict[int, float] = {}

        elastic.store.set(f"test/pid/{member}", str(os.getpid()))
        together = sorted(m for m, s in kills.items() if s == kills.get(member))

        def die() -> None:
            # the first of the members killed at this step kills them all at once, itself last
            now = repr(time.time())
            for m in together:
                elastic.store.set(f"test/killed/{m}", now)
            if member == wipe_by:
                shutil.rmtree(ckpt, ignore_errors=True)
            for m in together[1:]:
                os.kill(int(elastic.store.get(f"test/pid/{m}")), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

        while elastic.step < steps:
            with elastic.step_guard() as step:
                hook = die if kills.get(member) == step and together[0] == member else None
                losses[step], _ = train_step(cfg, layer, elastic.optimizer, step, hook)
            layer = elastic.model
        killed_at = {m: float(elastic.store.get(f"test/killed/{m}")) for m in kills}
        state = expert_state(layer, elastic.optimizer)
        results.put((member, True, {"losses": losses, "events": elastic.events, "members": elastic.members,
                                    "killed_at": killed_at, "experts": state}))  # fmt: skip
        elastic.close()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((member, False, traceback.format_exc()))


def run_elastic(
    initial: list[str],
    kills: dict[str, int | str],
    ckpt: Path,
    cfg: Config,
    steps: int,
    *,
    checkpoint_every: int = 1,
    rebalance_every: int = 1000,
    wipe_by: str = "",
    joiners: tuple[str, ...] = (),
    join_after: str = "",
    timeout_s: float = 120.0,
) -> dict[str, dict]:
    """`elastic_worker` for every member of ``initial`` and ``joiners``; returns the survivors' results."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    args = {
        m: (store.port, str(ckpt), initial, kills, cfg, steps, checkpoint_every, rebalance_every, wipe_by, join_after)
        for m in [*initial, *joiners]
    }
    return run_processes(elastic_worker, args, timeout_s, killed=tuple(kills))


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness import Row, machine_info, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5, help="steps between placement updates")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    cfg = Config(experts=args.experts, hidden=args.experts, tokens=240, extra_slots=2)
    t0 = time.perf_counter()
    result = run_placed_training(args.ranks, cfg, args.steps, args.every, timeout_s=600)
    wall = time.perf_counter() - t0
    static, placed = result["static"], result["rebalanced"]
    after = slice(args.every, None)  # steps from the first rebalance on
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    summary = {
        "static_max_over_mean": mean(static["max_over_mean"][after]),
        "rebalanced_max_over_mean": mean(placed["max_over_mean"][after]),
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(static["losses"], placed["losses"], strict=True)),
        "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in zip(static["losses"], placed["losses"], strict=True)),
        "rows_received_rank0": placed["rows_received"],
        "rebalance_s_rank0": placed["rebalance_s"],
        "wall_s": wall,
    }
    print({k: round(v, 5) if isinstance(v, float) else v for k, v in summary.items()})
    if not args.no_write:
        row = Row(
            f"placed-training-E{cfg.experts}-R{args.ranks}-K{cfg.top_k}-zipf{ZIPF_S}",
            "initial placement, never rebalanced (max/mean slots per rank, mean over steps after the first rebalance)",
            summary["static_max_over_mean"],
            summary["rebalanced_max_over_mean"],
            {"config": asdict(cfg), "ranks": args.ranks, "steps": args.steps, "every": args.every},
            {**summary, "static": static, "rebalanced": placed},
            "gloo on local CPU processes; the numbers are max/mean ratios, not times",
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = write_results("ep-placed-training", [row], markdown=Path(tmp) / "unused.md", info=machine_info())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
