"""Render a `PlanResult`: the explanation of the best plan in words, a rich table, a JSON document."""

from __future__ import annotations

import math
from dataclasses import asdict

from k3infra.plan.memory import weight_bytes
from k3infra.plan.search import Plan, PlanResult

__all__ = ["explain", "to_json", "table"]

GB = 1e9
_LABELS = {
    "weights": "weights", "buffers": "fp32 buffers (router, QB statistics)", "gradients": "gradients",
    "optimizer": "master weights + optimizer states",
    "fsdp_gather": "FSDP gathered layers", "activations": "saved activations", "attn_res": "AttnRes block sums",
    "logits": "logits", "ep_buffer": "EP dispatch buffer", "moonep_prefetch": "MoonEP redundant-expert prefetch",
    "kv_cache": "MLA latent / KV cache", "kda_state": "KDA recurrent + conv state",
    "redundant_experts": "redundant expert replicas",
}  # fmt: skip


def memory_terms(plan: Plan) -> list[tuple[str, float]]:
    """Non-zero memory terms of a plan, largest first, in bytes."""
    items = [(k, v) for k, v in plan.memory.items() if k not in ("total", "stage") and v > 0]
    return sorted(items, key=lambda kv: -kv[1])


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB" if x >= 0.1 * GB or x == 0 else f"{x / 1e6:.3g} MB"


def min_gpus_to_load(result: PlanResult) -> int | None:
    """GPUs whose usable memory holds the serving weights alone (no cache), or None for training."""
    if result.kind != "serve" or result.workload is None:
        return None
    w = result.workload
    return math.ceil(weight_bytes(result.model, w.weight_dtype, w.dense_weight_dtype) / result.usable)


def explain(result: PlanResult, *, efficiency: float | None = None) -> str:
    """The best plan in a few sentences, or why nothing fits."""
    best = result.best
    load = min_gpus_to_load(result)
    loading = ""
    if load is not None:
        w = result.workload
        weights = weight_bytes(result.model, w.weight_dtype, w.dense_weight_dtype)
        loading = f" Weights alone take {_gb(weights)}: at least {load} GPUs of this kind."
    if best is None:
        return result.reason() + loading
    L = best.layout
    terms = ", ".join(f"{_LABELS.get(k, k)} {_gb(v)}" for k, v in memory_terms(best)[:4])
    head = (
        f"Best of {len(result.feasible)} feasible layouts (of {len(result.plans)} evaluated) on "
        f"{result.cluster.gpus}x{result.cluster.gpu.name}: {L.label()}"
    )
    mem = (
        f"Peak {_gb(best.peak)} of {_gb(result.usable)} usable per GPU (pipeline stage {int(best.memory['stage'])}): "
        f"{terms}."
    )
    comm = sorted(((n, e["nvlink"] + e["network"], e) for n, e in best.comm.items()), key=lambda x: -x[1])
    words = "; ".join(
        f"{n.replace('_', ' ')} {_gb(total)} ({_gb(e['network'])} over the network)" for n, total, e in comm[:3]
    )
    if result.kind == "train":
        t = best.time
        lines = [
            head + f", {L.recompute} recompute, {best.micro_batches} micro-batch(es) per step.",
            mem,
            f"Step {t['step_s']:.3g} s = compute {t['compute_s']:.3g} s + pipeline bubble {t['bubble_s']:.3g} s + "
            f"exposed communication {t['exposed_comm_s']:.3g} s (of {t['comm_s']:.3g} s in total) + "
            f"optimizer update {t['update_s']:.3g} s; "
            f"{t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}%"
            + (f" with GEMMs assumed at {100 * efficiency:.0f}% of peak." if efficiency else "."),
        ]
    else:
        t = best.time
        lines = [
            head + ".",
            mem,
            f"Decode step {1e3 * t['decode_step_s']:.3g} ms ({_gb(t['hbm_bytes'])} read from HBM per GPU per "
            f"stage), {t['decode_tokens_per_s']:,.0f} tokens/s over all sequences; prefill of one context "
            f"≈ {t['prefill_s']:.3g} s on one replica." + loading,
        ]
    if words:
        lines.append(f"Traffic per GPU per step: {words}.")
    lines.extend(_alternatives(result, best))
    return "\n".join(lines)


def _alternatives(result: PlanResult, best: Plan) -> list[str]:
    """Why not the runner-up, and why not a faster layout that does not fit."""
    key = "step_s" if result.kind == "train" else "decode_step_s"
    out = []
    feasible = result.feasible
    if len(feasible) > 1:
        second = next((p for p in feasible[1:] if p.layout.label() != best.layout.label()), None)
        if second is not None:
            gain = second.time[key] / best.time[key] - 1
            out.append(f"Runner-up {second.layout.label()} ({second.layout.recompute} recompute, "
                       f"{_gb(second.peak)}) is {100 * gain:.1f}% slower.")  # fmt: skip
    faster = [p for p in result.plans if not p.feasible and p.time[key] < best.time[key]]
    if faster:
        quickest = min(faster, key=lambda p: p.time[key])
        out.append(f"Faster but not fitting: {quickest.overflow()}.")
    return out


def _plan_json(plan: Plan) -> dict:
    return {
        "layout": asdict(plan.layout),
        "label": plan.layout.label(),
        "feasible": plan.feasible,
        "micro_batches": plan.micro_batches,
        "memory_bytes": {k: v for k, v in plan.memory.items() if k != "stage"},
        "peak_stage": int(plan.memory["stage"]),
        "comm_bytes": plan.comm,
        "time": plan.time,
    }


def to_json(result: PlanResult, *, top: int = 10, request: dict | None = None) -> dict:
    """A JSON-serialisable summary: model, cluster, the ``top`` plans, the explanation, the reason if none fits."""
    total, expert, active = result.model.count()
    gpu = result.cluster.gpu
    return {
        "kind": result.kind,
        "request": request or {},
        "model": {"name": result.model.name, "family": result.model.family, "params_total": total,
                  "params_routed_experts": expert, "params_active": active, "layers": len(result.model.layers)},
        "cluster": {"name": result.cluster.name, "gpus": result.cluster.gpus, "per_node": result.cluster.per_node,
                    **asdict(gpu)},
        "usable_bytes_per_gpu": result.usable,
        "feasible": result.best is not None,
        "reason": result.reason(),
        "min_gpus_to_load": min_gpus_to_load(result),
        "evaluated": len(result.plans),
        "n_feasible": len(result.feasible),
        "rejected": result.rejected,
        "explanation": explain(result),
        "plans": [_plan_json(p) for p in (result.feasible or sorted(result.plans, key=lambda p: p.peak))[:top]],
    }  # fmt: skip


def table(result: PlanResult, *, top: int = 10):
    """A `rich.table.Table` of the ``top`` plans (feasible ones, else the closest misses)."""
    from rich.table import Table

    plans = (result.feasible or sorted(result.plans, key=lambda p: p.peak))[:top]
    title = f"{result.kind} {result.model.name} on {result.cluster.name} ({_gb(result.usable)} usable per GPU)"
    t = Table(title=title)
    for name in ("#", "layout", "recompute", "peak GB", "top term"):
        t.add_column(name, no_wrap=True)
    if result.kind == "train":
        cols = ("step s", "tokens/s", "MFU %", "exposed comm s")
    else:
        cols = ("decode ms", "tokens/s", "prefill s", "HBM GB/step")
    for name in cols:
        t.add_column(name, justify="right")
    for i, p in enumerate(plans, 1):
        key, value = memory_terms(p)[0]
        row = [str(i), p.layout.label(), p.layout.recompute, f"{p.peak / GB:.1f}" + ("" if p.feasible else " !"),
               f"{key} {value / GB:.1f}"]  # fmt: skip
        tm = p.time
        if result.kind == "train":
            row += [f"{tm['step_s']:.3g}", f"{tm['tokens_per_s']:,.0f}", f"{100 * tm['mfu']:.1f}",
                    f"{tm['exposed_comm_s']:.3g}"]  # fmt: skip
        else:
            row += [f"{1e3 * tm['decode_step_s']:.3g}", f"{tm['decode_tokens_per_s']:,.0f}", f"{tm['prefill_s']:.3g}",
                    f"{tm['hbm_bytes'] / GB:.1f}"]  # fmt: skip
        t.add_row(*row)
    return t
