"""Enumerate layouts, evaluate memory, communication and time, rank the feasible ones.

`plan_train` / `plan_serve` return a `PlanResult`: every evaluated `Plan` (sorted, feasible first), the usable
bytes per GPU, and when nothing fits a reason naming the term that overflows and by how much.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from k3infra.plan.cluster import ClusterSpec
from k3infra.plan.comm import serve_comm, train_comm
from k3infra.plan.memory import serve_memory, train_memory
from k3infra.plan.model import ModelSpec
from k3infra.plan.timing import serve_time, train_time
from k3infra.plan.workload import OVERLAP, RECOMPUTE, Layout, ServeWorkload, TrainWorkload

__all__ = ["Plan", "PlanResult", "SearchOptions", "plan_train", "plan_serve", "divisors"]

GB = 1e9


@dataclass(frozen=True)
class SearchOptions:
    """Which layouts to try and the assumptions of the estimate.

    Each ``*_choices`` is a tuple of allowed values or None (enumerate). ``reserve`` is the fraction of GPU
    memory left for the CUDA context, allocator fragmentation and kernels' workspaces.
    """

    tp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    vp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    zero: tuple[int, ...] | None = None
    redundant: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None
    reserve: float = 0.1
    efficiency: float = 0.5
    overlap: str = "dp"
    ep_imbalance: float = 1.0
    max_vp: int = 4
    max_cp: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.reserve < 1:
            raise ValueError(f"--reserve must be in [0, 1), got {self.reserve}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"--efficiency must be in (0, 1], got {self.efficiency}")
        if self.overlap not in OVERLAP:
            raise ValueError(f"--overlap must be one of {OVERLAP}, got {self.overlap!r}")
        if self.ep_imbalance < 1:
            raise ValueError(f"--ep-imbalance must be >= 1, got {self.ep_imbalance}")
        if self.recompute is not None and any(r not in RECOMPUTE for r in self.recompute):
            raise ValueError(f"--recompute must be among {RECOMPUTE} or auto, got {self.recompute}")


@dataclass
class Plan:
    """One evaluated layout: memory terms (bytes), comm per collective and link (bytes), time terms (s)."""

    layout: Layout
    memory: dict[str, float]
    comm: dict[str, dict[str, float]]
    time: dict[str, float]
    usable: float
    micro_batches: int = 1

    @property
    def peak(self) -> float:
        return self.memory["total"]

    @property
    def feasible(self) -> bool:
        return self.peak <= self.usable

    def overflow(self) -> str:
        """Which terms make the plan not fit, in words."""
        over = self.peak - self.usable
        terms = sorted(((v, k) for k, v in self.memory.items() if k not in ("total", "stage")), reverse=True)
        top = ", ".join(f"{k} {v / GB:.1f} GB" for v, k in terms[:3] if v > 0)
        return (
            f"{self.layout.label()} ({self.layout.recompute} recompute) needs {self.peak / GB:.1f} GB on pipeline "
            f"stage {int(self.memory['stage'])} but {self.usable / GB:.1f} GB are usable: over by {over / GB:.1f} "
            f"GB; largest terms: {top}"
        )


@dataclass
class PlanResult:
    kind: str
    model: ModelSpec
    cluster: ClusterSpec
    plans: list[Plan]
    usable: float
    rejected: dict[str, int] = field(default_factory=dict)
    """Layouts not evaluated, by reason."""
    workload: TrainWorkload | ServeWorkload | None = None

    @property
    def feasible(self) -> list[Plan]:
        return [p for p in self.plans if p.feasible]

    @property
    def best(self) -> Plan | None:
        return self.feasible[0] if self.feasible else None

    def reason(self) -> str:
        """Why nothing fits: the closest plan's overflow, or why no layout could be formed."""
        if self.best is not None:
            return ""
        if self.plans:
            closest = min(self.plans, key=lambda p: p.peak)
            return "no layout fits; the closest: " + closest.overflow()
        why = "; ".join(f"{n}× {r}" for r, n in sorted(self.rejected.items(), key=lambda x: -x[1])[:3])
        return f"no valid layout for {self.cluster.gpus} GPUs: " + (
            why or "none matches the given --tp/--ep/--pp/--vp/--cp/--zero/--redundant choices"
        )


def divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _heads(model: ModelSpec) -> list[int]:
    return [s.heads for s in (model.kda, model.mla, model.gqa) if s is not None]


def _allowed(values: list[int], chosen: tuple | None) -> list:
    return [v for v in values if chosen is None or v in chosen]


def _layouts(model: ModelSpec, cluster: ClusterSpec, opts: SearchOptions, seq_len: int, recompute: tuple[str, ...],
             rejected: Counter):  # fmt: skip
    world, n_layers = cluster.gpus, len(model.layers)
    experts = model.moe.experts if model.moe else 1
    for tp in _allowed(divisors(world), opts.tp):
        if tp > cluster.per_node or any(h % tp for h in _heads(model)):
            rejected[f"TP{tp} does not divide the attention heads or leaves the NVLink domain"] += 1
            continue
        for cp in _allowed([c for c in divisors(world // tp) if c <= opts.max_cp], opts.cp):
            if seq_len % cp:
                rejected[f"CP{cp} does not divide the sequence"] += 1
                continue
            for pp in _allowed([p for p in divisors(world // (tp * cp)) if p <= n_layers], opts.pp):
                dp = world // (tp * cp * pp)
                vps = [1] if pp == 1 else [v for v in range(1, opts.max_vp + 1) if pp * v <= n_layers]
                for vp in _allowed(vps, opts.vp):
                    eps = [e for e in divisors(tp * cp * dp) if experts % e == 0]
                    for ep in _allowed(eps, opts.ep):
                        # Without a data-parallel group every ZeRO stage is stage 0: try it once unless asked.
                        alone = dp * cp == 1 and tp * cp * dp // ep == 1
                        zeros = [0] if alone and opts.zero is None else [0, 1, 2, 3]
                        slots = [0] if ep == 1 or not model.moe else [0, experts // ep]
                        for zero, red, rc in itertools.product(
                            _allowed(zeros, opts.zero), _allowed(slots, opts.redundant), recompute
                        ):
                            yield Layout(tp=tp, ep=ep, pp=pp, vp=vp, cp=cp, dp=dp, zero=zero, redundant=red,
                                         recompute=rc)  # fmt: skip


def plan_train(model: ModelSpec, cluster: ClusterSpec, work: TrainWorkload, opts: SearchOptions | None = None
               ) -> PlanResult:  # fmt: skip
    """Evaluate every training layout allowed by ``opts`` on ``cluster``; fastest feasible first."""
    opts = opts or SearchOptions()
    usable = cluster.gpu.memory * (1 - opts.reserve)
    rejected: Counter = Counter()
    plans = []
    recompute = opts.recompute or RECOMPUTE
    for layout in _layouts(model, cluster, opts, work.seq_len, recompute, rejected):
        per_step = layout.dp * work.micro_batch
        if work.sequences % per_step:
            rejected[f"{work.sequences} sequences per step do not split into DP{layout.dp} × micro-batch"] += 1
            continue
        m = work.sequences // per_step
        if layout.vp > 1 and m % layout.pp:
            rejected["interleaved pipeline needs micro-batches divisible by PP"] += 1
            continue
        memory = train_memory(model, layout, work, m)
        comm = train_comm(model, layout, work, cluster, m)
        time = train_time(model, layout, work, cluster, m, comm, efficiency=opts.efficiency, overlap=opts.overlap,
                          ep_imbalance=opts.ep_imbalance)  # fmt: skip
        plans.append(Plan(layout, memory, comm, time, usable, m))
    plans.sort(key=lambda p: (not p.feasible, p.time["step_s"], p.peak))
    return PlanResult("train", model, cluster, plans, usable, dict(rejected), work)


def plan_serve(model: ModelSpec, cluster: ClusterSpec, work: ServeWorkload, opts: SearchOptions | None = None
               ) -> PlanResult:  # fmt: skip
    """Evaluate every serving layout (no ZeRO, no recompute, one virtual stage); highest decode throughput
    first."""
    opts = opts or SearchOptions()
    usable = cluster.gpu.memory * (1 - opts.reserve)
    rejected: Counter = Counter()
    serve_opts = SearchOptions(
        tp=opts.tp, ep=opts.ep, pp=opts.pp, vp=(1,), cp=opts.cp, zero=(0,), redundant=opts.redundant or (0,),
        recompute=("none",), max_cp=opts.max_cp,
    )  # fmt: skip
    plans = []
    for layout in _layouts(model, cluster, serve_opts, work.context, ("none",), rejected):
        memory = serve_memory(model, layout, work)
        comm = serve_comm(model, layout, work, cluster)
        time = serve_time(model, layout, work, cluster, memory, comm, efficiency=opts.efficiency)
        plans.append(Plan(layout, memory, comm, time, usable))
    plans.sort(key=lambda p: (not p.feasible, -p.time["decode_tokens_per_s"], p.peak))
    return PlanResult("serve", model, cluster, plans, usable, dict(rejected), work)
