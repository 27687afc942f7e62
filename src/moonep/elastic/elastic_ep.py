"""`ElasticEP`: keep an expert-parallel job training through a rank's death and admit ranks that join.

A training loop wraps each step in ``with elastic.step_guard() as step:``. On `moonep.CommError` (or a
torch.distributed error of the loop's own collectives) inside the step, the guard swallows it and recovers:
the survivors agree on the next generation's members (heartbeats, `Membership`), build a fresh gloo group on
a new store prefix and rebuild the model for ``EP = R'`` (`build`). Its experts come from the survivors'
memory when they can (`moonep.elastic.rehome`): every expert with a copy on a survivor is sent from there
with its optimizer state, and only experts with no surviving copy are read from the last committed
checkpoint; otherwise everything is loaded from that checkpoint. ``elastic.step`` is set to the first step
not applied, so the step in flight is redone on the survivors, never dropped. After a step that finished,
the guard commits a checkpoint (every ``checkpoint_every`` steps) and, every ``rebalance_every`` steps,
admits pending joiners (a new generation that includes them; everybody reloads from the checkpoint) or, with
no joiner, recomputes the placement of every `PlacedMoELayer` from its load history and moves the experts.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

# Before `ElasticEP` forms a group: this module binds ``group.WORLD`` as a default argument when first imported
# (the first AdamW imports it, through torch._dynamo); after `init_process_group` that default would keep the
# group alive past `destroy_process_group`, its gloo threads running into interpreter exit (SIGABRT there).
import torch.distributed.nn.functional  # noqa: F401

from moonep.elastic.checkpoint import expert_modules, load_shards, save_shard
from moonep.elastic.membership import Membership
from moonep.elastic.rehome import rehome_live
from moonep.errors import CommError

logger = logging.getLogger(__name__)

FAILURES = (CommError, dist.DistError)
"""Exceptions inside a step that mean a peer is gone (gloo raises `DistBackendError` in plain collectives)."""


MAX_REGROUPS = 3
"""Attempts at forming the survivors' group when members keep dying while it forms."""

_ABANDONED: list[object] = []
"""Process groups of generations that lost a peer: kept referenced so that their destructors never run."""


def _forget_groups() -> None:
    """Unregister every process group without shutting it down.

    On gloo, `ProcessGroup.shutdown` (what `dist.destroy_process_group` calls) waits for work that is stuck
    with the dead peer and never returns; the broken groups are dropped from torch.distributed's registry
    instead, so that `init_process_group` can form the next generation.
    """
    world = dist.distributed_c10d._world
    for group in world.pg_map:
        with contextlib.suppress(Exception):  # stops gloo's work stuck with the dead peer (else it ends at exit)
            group.abort()
        _ABANDONED.append(group)
    dist.distributed_c10d._update_default_pg(None)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config):
        table.clear()
    for table in (world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state):
        table.clear()
    world.group_count = 0
    dist.distributed_c10d._unregister_all_process_groups()


class ElasticEP:
    """Membership, recovery and growth for one worker of an elastic expert-parallel group (gloo).

    Args:
        host, port: a `TCPStore` that outlives the workers (the launcher's).
        member_id: this worker's stable name.
        build: ``build() -> torch.nn.Module``, called after each (re)formation of the default process group;
            builds the `moonep.Buffer` (on the default group) and the model with this group size. Its
            weights are replaced by the survivors' or the checkpoint's, except on the first generation.
        checkpoint_dir: shared directory for checkpoint shards (one per generation and step).
        initial_members: the members of the first generation, in rank order; a worker not in it joins.
        checkpoint_every: commit a checkpoint after every this many steps (recovery redoes at most this many).
        rebalance_every: steps between admissions of joiners.
        stale_s: a member whose heartbeat did not advance for this long after a failure is left out.
        timeout_s: the process groups' timeout and the joiner's wait for admission.
        make_optimizer: ``make_optimizer(model) -> torch.optim.Optimizer``, called after each `build`; its
            state is checkpointed and re-homed with the weights (``elastic.optimizer``). Its ``step()`` must
            follow every collective of the training step. Without it, weights only, always from the checkpoint
            (the loop's own update cannot be told apart from a half-applied step).
    """

    def __init__(
        self,
        host: str,
        port: int,
        member_id: str,
        build: Callable[[], torch.nn.Module],
        checkpoint_dir: str | Path,
        initial_members: list[str],
        *,
        checkpoint_every: int = 1,
        rebalance_every: int = 10,
        stale_s: float = 1.0,
        timeout_s: float = 30.0,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    ) -> None:
        if checkpoint_every < 1 or rebalance_every < 1:
            raise ValueError(
                f"checkpoint_every and rebalance_every must be >= 1, got {checkpoint_every}, {rebalance_every}"
            )
        if not initial_members or len(set(initial_members)) != len(initial_members):
            raise ValueError(f"initial_members must be distinct names, got {initial_members!r}")
        self.membership = Membership(host, port, member_id)
        self.store = self.membership.store
        self.member_id, self.build = member_id, build
        self.checkpoint_dir = Path(checkpoint_dir)
        self.initial_members = list(initial_members)
        self.checkpoint_every, self.rebalance_every = checkpoint_every, rebalance_every
        self.stale_s, self.timeout_s = stale_s, timeout_s
        self.generation = -1
        self.members: list[str] = []
        self.model: torch.nn.Module | None = None
        self.make_optimizer = make_optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        self._running = -1
        self._applied = -1
        """The last step whose optimizer step ran on this worker (its in-memory state is after that step)."""
        self.events: list[dict] = []
        """What happened: ``{"kind": "start"|"join"|"shrink"|"grow", "generation", "members", "step", "seconds", "at"}``
        (``at``: wall-clock time the event finished; ``seconds``: how long it took on this worker)."""

    # -- public hooks ------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the current generation."""
        return self.members.index(self.member_id)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def start(self) -> torch.nn.Module:
        """Join the first generation (initial members) or wait to be admitted (others); returns the model."""
        t0 = time.monotonic()
        if self.member_id in self.initial_members:
            self.membership.propose(0, self.initial_members)
            self._enter(0, source="fresh")
            self._commit(-1)
            self._event("start", -1, t0)
        else:
            self.membership.ask_to_join()
            self._enter(self.membership.wait_admitted(self.timeout_s), source="checkpoint")
            self._event("join", self.step, t0)
        return self.model

    @contextlib.contextmanager
    def step_guard(self) -> Iterator[int]:
        """Around one training step: yields the step number; recovers from a peer's failure (the step is
        redone from ``elastic.step``), or commits/admits joiners after a step that finished."""
        step = self._running = self.step
        try:
            yield step
        except FAILURES as error:
            self._recover(step, error, live=True)
            return
        self.step = step + 1
        boundary = self.step % self.rebalance_every == 0
        if boundary or self.step % self.checkpoint_every == 0:
            self._commit(step)
        if boundary:
            try:
                if not self._admit_joiners(step):
                    self._rebalance(step)
            except FAILURES as error:  # half-moved experts: the checkpoint just committed is the safe source
                self._recover(step, error, live=False)

    def close(self) -> None:
        """Leave: stop heartbeating and tear down the process group."""
        self.membership.close()
        if dist.is_initialized():
            with contextlib.suppress(*FAILURES):  # leave together: gloo's shutdown may wait on a peer's exit
                dist.barrier()
        self._teardown()

    # -- internals -----------------------------------------------------------------------------------------

    def _event(self, kind: str, step: int, t0: float, **extra: object) -> None:
        event = dict(kind=kind, generation=self.generation, members=list(self.members), step=step, **extra)
        event["seconds"] = round(time.monotonic() - t0, 3)
        event["at"] = time.time()
        self.events.append(event)
        logger.info("elastic %s: %s", kind, event)

    def _teardown(self, *, broken: bool = False) -> None:
        """Destroy the model's buffers and the default group; ``broken``: a peer died, see `_forget_groups`."""
        if self.model is not None:
            for module in self.model.modules():
                buffer = getattr(module, "buffer", None)
                if buffer is not None and hasattr(buffer, "destroy"):
                    with contextlib.suppress(Exception):
                        buffer.destroy()
        if dist.is_initialized():
            if broken:
                _forget_groups()
            else:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()

    def _enter(self, generation: int, *, source: str, broken: bool = False) -> dict:
        """Form ``generation``'s process group, build the model and restore the state from ``source``:
        ``"fresh"`` (keep ``build``'s), ``"checkpoint"`` (the last committed) or ``"live"`` (the survivors'
        memory where it can, see `rehome_live`). Returns what the re-homing did."""
        members = self.membership.members(generation)
        if self.member_id not in members:
            raise RuntimeError(f"member {self.member_id} was left out of generation {generation}: {members}")
        old_members, old_model, old_optimizer = list(self.members), self.model, self.optimizer
        self._teardown(broken=broken)
        self.generation, self.members = generation, members
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"gen{generation}/", self.store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        self.model = self.build()
        self.optimizer = None
        if self.make_optimizer is not None:
            self.optimizer = self.make_optimizer(self.model)
            self.optimizer.register_step_post_hook(self._on_optimizer_step)
        if source == "fresh":
            return {"source": "fresh"}
        directory, committed = self.store.get("ckpt/committed").decode().split(":")
        if source == "live" and self.optimizer is not None:
            rank_of_old = [members.index(m) if m in members else None for m in old_members]
            done = rehome_live(
                old_model, old_optimizer, self.model, self.optimizer, rank_of_old, self._applied,
                Path(directory), int(committed), self.timeout_s,
            )  # fmt: skip
            if done is not None:
                self.step = self._applied + 1
                return done
        load_shards(Path(directory), self.model, self.rank, self.world_size, self.optimizer)
        self.step = int(committed) + 1
        self._applied = int(committed)
        return {"source": "checkpoint"}

    def _on_optimizer_step(self, *_: object) -> None:
        self._applied = self._running

    def _commit(self, step: int) -> None:
        """Write this rank's shard of the state after ``step``; the last rank to finish marks it committed."""
        directory = self.checkpoint_dir / f"gen{self.generation}-step{step}"
        save_shard(directory, self.model, self.rank, self.member_id, self.world_size, self.optimizer)
        if self.store.add(f"ckpt/{directory.name}/done", 1) == self.world_size:
            previous = self.store.compare_set("ckpt/committed", "", f"{directory}:{step}").decode()
            if previous != f"{directory}:{step}":
                self.store.set("ckpt/committed", f"{directory}:{step}")
                older = Path(previous.split(":")[0])
                self._prune(keep={directory, older})

    def _prune(self, keep: set[Path]) -> None:
        for path in self.checkpoint_dir.glob("gen*-step*"):
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def _recover(self, step: int, error: BaseException, *, live: bool) -> None:
        """Agree on the survivors, form the next generation and re-home; a member that dies while the
        survivors regroup (before the group forms, or during the re-homing) starts the agreement again
        without it, up to `MAX_REGROUPS` times (after a failed re-homing, from the checkpoint)."""
        t0 = time.monotonic()
        lost_from = list(self.members)
        logger.warning("elastic: step %d failed on member %s (%s); regrouping", step, self.member_id, error)
        generation, candidates, source = self.generation + 1, lost_from, "live" if live else "checkpoint"
        regroups = 0
        while True:
            regroups += 1
            if regroups > MAX_REGROUPS:
                raise RuntimeError(f"member {self.member_id}: the survivors of step {step} could not form a group in "
                                   f"{MAX_REGROUPS} attempts (members kept failing while regrouping)")
            agreed = self.membership.propose(generation, self.membership.alive(candidates, self.stale_s))
            if self.member_id not in agreed:
                raise RuntimeError(f"member {self.member_id} was left out of generation {generation}: {agreed}")
            dead = self.membership.gather(generation, agreed, self.stale_s, self.timeout_s)
            if not dead:
                try:
                    rehomed = self._enter(generation, source=source, broken=True)
                    break
                except FAILURES as again:
                    logger.warning("elastic: generation %d failed while forming (%s); regrouping", generation, again)
                    source = "checkpoint"  # the live re-homing may be half done
            candidates, generation = [m for m in agreed if m not in dead], generation + 1
        lost = [m for m in lost_from if m not in self.members]
        self._event("shrink", step, t0, lost=lost, resume_step=self.step, regroups=regroups, **rehomed)

    def _rebalance(self, step: int) -> None:
        """Recompute every `PlacedMoELayer`'s placement from its load history and move the experts."""
        placed = [m for m in expert_modules(self.model).values() if hasattr(m, "rebalance")]
        if not placed:
            return
        t0 = time.monotonic()
        received = sum(module.rebalance(self.optimizer) for module in placed)
        self._event("rebalance", step, t0, received=received)

    def _admit_joiners(self, step: int) -> bool:
        """Admit pending joiners (collective); returns whether the group grew."""
        t0 = time.monotonic()
        joiners = self.membership.pending_joiners() if self.rank == 0 else []
        count = torch.tensor([len(joiners)])
        # all_reduce (not broadcast): it returns on rank 0 only after every rank committed the step.
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if int(count) == 0:
            return False
        if self.rank == 0:
            self.membership.propose(self.generation + 1, self.members + joiners)
            self.membership.admit(joiners, self.generation + 1)
        before = list(self.members)
        self._enter(self.generation + 1, source="checkpoint")
        self._event("grow", step, t0, joined=[m for m in self.members if m not in before])
        return True
