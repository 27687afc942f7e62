"""`k3infra bench ep`: MoonEP dispatch+combine vs a naive all-to-all dispatcher, in one run, on 2 GPUs.

Usage (device machine):  python -m benchmarks.ep.run [--tokens 4096] [--hiddens 7168,3584]
One GPU (no communication): python -m benchmarks.ep.run --local   (same as benchmarks.ep.local)
CPU smoke (gloo):         python -m benchmarks.ep.run --backend gloo --tokens 64 --hiddens 32 --experts 16 --topk 4

Per (hidden, skew): correctness gate at ``--gate-tokens`` (every slot checked against the reference
dispatch; combine of identity experts against ``x * sum(w)``, for ours and the baseline), the plan at full
size checked against the loop reference planner, then dispatch / combine timed with CUDA events (both
ranks in lockstep; rank 0's median reported), expert load max/mean, peak memory, and the bytes and time
of redundant-expert weight prefetch and gradient reduction (experts are SwiGLU ``3 x H x F`` bf16).
Expert compute is not timed: the "experts" are the identity. A CPU planner study (EP = 8/16/64) follows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.ep.naive import naive_combine, naive_dispatch
from benchmarks.ep.shapes import add_shape_args
from benchmarks.ep.study import planner_study
from benchmarks.harness import Row, machine_info, time_fn, write_results
from benchmarks.progress import track
from moonep import Buffer
from moonep.reference import reference_dispatch, reference_plan
from moonep.skew import make_routing

BASELINE = "naive all_to_all (token x K copies, host-synced splits)"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--expert-width", type=int, default=512, help="F of the SwiGLU experts whose weights move")
    p.add_argument("--gate-tokens", type=int, default=128, help="tokens per rank of the correctness gate")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    p.add_argument("--reps", type=int, default=30, help="timed calls per case")
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="torch.distributed backend (gloo: CPU)")
    p.add_argument("--world", type=int, default=2, help="EP ranks (processes; one GPU each on NCCL)")
    p.add_argument("--no-study", action="store_true", help="skip the CPU planner study at EP = 8/16/64")
    p.add_argument("--chunk-sweep", default="1,2,8", help="num_chunks values also timed (graph) on uniform routing")
    p.add_argument("--no-write", action="store_true", help="print only; write no results JSON")
    return p.parse_args(argv)


def _gate(args: argparse.Namespace, rank: int, world: int, hidden: int, skew: str, device: str) -> str:
    """Exact slot placement and combine for ours and the baseline at a small size; '' if all pass."""
    S, K, E = args.gate_tokens, args.topk, args.experts
    gen = torch.Generator().manual_seed(hidden)
    xs = [torch.randn(S, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    routes = [make_routing(skew, S, K, E, world, rank=r, seed=11) for r in range(world)]
    idx, w = (t.to(device) for t in routes[rank])
    x = xs[rank].to(device)
    buffer = Buffer(None, S, hidden, K, E, device=device, validate=True)
    out = buffer.dispatch(x, idx, w)
    counts = torch.stack([torch.bincount(i.view(-1), minlength=E) for i, _ in routes])
    ref = reference_plan(counts)
    expected = reference_dispatch([i for i, _ in routes], ref)[rank]
    src = torch.tensor([e[0] for e in expected]).clamp(min=0)
    tok = torch.tensor([e[1] for e in expected]).clamp(min=0)
    used = torch.tensor([e[0] >= 0 for e in expected])
    want = torch.stack(xs)[src, tok] * used[:, None]
    if not torch.equal(out.x_CH.cpu(), want.to(torch.bfloat16)):
        return "dispatch slots differ from the reference"
    combined, _ = buffer.combine(out.x_CH, out.handle, out.weights_C)
    ideal = (x.float() * w.float().sum(1, keepdim=True)).cpu()
    rel = float((combined.float().cpu() - ideal).norm() / ideal.norm())
    buffer.destroy()
    x_naive, _, handle = naive_dispatch(x, idx, E)
    naive_out = naive_combine(x_naive, w, handle).float().cpu()
    rel_naive = float((naive_out - ideal).norm() / ideal.norm())
    if rel > 1e-2 or rel_naive > 1e-2:
        return f"combine rel. error ours {rel:.2e}, naive {rel_naive:.2e}"
    return ""


def _peak(fn, device: str) -> float:
    if not device.startswith("cuda"):
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _case(args: argparse.Namespace, rank: int, world: int, hidden: int, skew: str, device: str, hp_group) -> dict:
    S, K, E = args.tokens, args.topk, args.experts
    note = _gate(args, rank, world, hidden, skew, device)
    idx, w = (t.to(device) for t in make_routing(skew, S, K, E, world, rank=rank, seed=1))
    x = torch.randn(S, hidden, device=device).to(torch.bfloat16)
    buffer = Buffer(None, S, hidden, K, E, device=device, validate=False)
    out = buffer.dispatch(x, idx, w)
    plan = out.handle.plan
    ref = reference_plan(plan.counts_RE.cpu())
    if not all(torch.equal(getattr(plan, k).cpu(), v) for k, v in ref.items()):
        note = (note + "; " if note else "") + "device plan differs from the CPU reference planner"
    stats = plan.stats()
    timing = dict(warmup=args.warmup, rep=args.reps, device=device)
    result: dict = {"case": f"H{hidden}-{skew}", "hidden": hidden, "skew": skew, "note": note, **stats}
    if note:  # never time a path whose correctness gate failed
        buffer.destroy()
        return result

    def ours_both() -> None:
        o = buffer.dispatch(x, idx, w)
        buffer.combine(o.x_CH, o.handle, o.weights_C)

    result["dispatch_ms"] = time_fn(lambda: buffer.dispatch(x, idx, w), **timing).median_ms
    result["combine_ms"] = time_fn(lambda: buffer.combine(out.x_CH, out.handle, out.weights_C), **timing).median_ms
    t = time_fn(ours_both, **timing)
    result["ours_ms"], result["ours_p80_ms"] = t.median_ms, t.p80_ms
    result["ours_peak_gib"] = _peak(ours_both, device)
    if device.startswith("cuda"):
        result.update(_graphed(args, rank, world, buffer, x, idx, w, device, timing, parts=True))
        if hp_group is not None:  # the same, on a process group whose NCCL stream has high priority
            hp = Buffer(hp_group, S, hidden, K, E, device=device, validate=False)
            graphed = _graphed(args, rank, world, hp, x, idx, w, device, timing)
            result.update({f"hp_{k}": v for k, v in graphed.items()})
            hp.destroy()
        if skew == "uniform":  # the planner chain before fusing it (torch ops), in the same run
            other = Buffer(None, S, hidden, K, E, device=device, validate=False, planner="torch")
            graphed = _graphed(args, rank, world, other, x, idx, w, device, timing)
            result.update({f"torch_planner_{k}": v for k, v in graphed.items()})
            if hp_group is not None:
                other_hp = Buffer(hp_group, S, hidden, K, E, device=device, validate=False, planner="torch")
                graphed = _graphed(args, rank, world, other_hp, x, idx, w, device, timing)
                result.update({f"torch_planner_hp_{k}": v for k, v in graphed.items()})
                other_hp.destroy()
            other.destroy()
        # Ablation on uniform routing: other chunk counts (1: no transfer overlaps the stores or the reduction).
        for chunks in [int(c) for c in args.chunk_sweep.split(",") if c] if skew == "uniform" else []:
            other = Buffer(None, S, hidden, K, E, device=device, validate=False, num_chunks=chunks)
            graphed = _graphed(args, rank, world, other, x, idx, w, device, timing)
            result.update({f"chunks{chunks}_{k}": v for k, v in graphed.items()})
            other.destroy()
        result.update(_nvlink(args, hidden, x, idx, w, out, device, timing))
    result.update(_planned_and_remote(args, rank, world, buffer, x, idx, w, device, timing, hp_group, skew))
    buffer.destroy()

    unbalanced = Buffer(None, S, hidden, K, E, device=device, validate=False, balanced=False)

    def unbalanced_both() -> None:
        o = unbalanced.dispatch(x, idx, w)
        unbalanced.combine(o.x_CH, o.handle, o.weights_C)

    result["unbalanced_ms"] = time_fn(unbalanced_both, **timing).median_ms
    unbalanced.destroy()

    x_naive, _, handle = naive_dispatch(x, idx, E)

    def naive_both() -> None:
        xn, _, h = naive_dispatch(x, idx, E)
        naive_combine(xn, w, h)

    result["naive_dispatch_ms"] = time_fn(lambda: naive_dispatch(x, idx, E), **timing).median_ms
    result["naive_combine_ms"] = time_fn(lambda: naive_combine(x_naive, w, handle), **timing).median_ms
    t = time_fn(naive_both, **timing)
    result["naive_ms"], result["naive_p80_ms"] = t.median_ms, t.p80_ms
    result["naive_peak_gib"] = _peak(naive_both, device)
    off_rank_copies = int((torch.div(idx, E // world, rounding_mode="floor") != rank).sum())
    result["naive_offrank_gb"] = off_rank_copies * hidden * 2 / 1e9
    result["ours_offrank_gb"] = (world - 1) * S * hidden * 2 / 1e9  # per direction: rows all-gathered
    result.update(_weights(args, rank, world, hidden, idx, w, x, device, timing))
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def _planned_and_remote(args, rank, world, buffer, x, idx, w, device, timing, hp_group, skew) -> dict:
    """The two changes of the 02:15 UTC round, timed beside the current path on the same group as its best
    number (the high-priority NCCL group when there is one), each first checked against ``buffer`` (the
    default path; ``*_bitwise_equal`` records whether the bits agree, timing needs a relative error <= 1e-3):

    - ``remote_planned_*``: ``combine_path="remote_only"`` and the plan made ahead (`Buffer.plan`, its own
      graph): ``graph_ms`` is dispatch(plan=) + combine, the critical path once the plan overlaps the
      previous micro-batch's experts; ``graph_plan_ms`` the planning itself (every skew);
    - on uniform routing also each change alone: ``remote_*`` (remote-only combine, with the plan inside
      dispatch; dispatch and combine also as separate graphs) and ``planned_*`` (planned ahead, all-to-all
      combine).
    """
    S, K, E = args.tokens, args.topk, args.experts
    group = hp_group  # None: the default group
    variants = [("remote_planned", "remote_only", True, False)]
    if skew == "uniform":
        variants += [("remote", "remote_only", False, True), ("planned", "all_to_all", True, False)]
    result: dict = {"variants_group": "high-priority NCCL group" if hp_group is not None else "default group"}
    want = buffer.combine(*_eager_parts(buffer, x, idx, w))[0]
    for name, path, preplanned, parts in variants:
        other = Buffer(group, S, x.shape[1], K, E, device=device, validate=False, combine_path=path)

        def both(other=other, preplanned=preplanned) -> torch.Tensor:
            planned = other.plan(idx, w) if preplanned else None
            o = other.dispatch(x, idx, w, plan=planned)
            return other.combine(o.x_CH, o.handle, o.weights_C)[0]

        got = both()
        # Designed to give the default path's bits; a last-ulp difference (e.g. FMA contraction) is recorded
        # but still timed, anything larger is not.
        result[f"{name}_bitwise_equal"] = bool(torch.equal(got, want))
        rel = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))
        if rel > 1e-3:
            result[f"{name}_graph_note"] = f"{name}: eager output differs from the default path ({rel:.1e}); not timed"
            other.destroy()
            continue
        result[f"{name}_eager_ms"] = time_fn(both, **timing).median_ms  # planning included
        if device.startswith("cuda"):
            graphed = _graphed(args, rank, world, other, x, idx, w, device, timing, parts=parts, preplanned=preplanned)
            result.update({f"{name}_{k}": v for k, v in graphed.items()})
            if name == "planned":
                result.update(_plan_overlap(args, other, idx, w, timing))
        other.destroy()
    return result


def _plan_overlap(args, buffer, idx, w, timing) -> dict:
    """What `Buffer.plan` costs once it runs beside expert compute: a stand-in expert GEMM (the SwiGLU's
    first projection of the ``S*K`` slots, ``[S*K, H] x [H, 2F]`` bf16) as a CUDA graph alone, and with
    ``buffer.plan(..., async_finish=True)`` forked beside it (communication stream) and joined after; the
    difference is the planning left on the critical path."""
    S, K = args.tokens, args.topk
    try:
        a = torch.randn(S * K, buffer.H, device=buffer.device).to(torch.bfloat16)
        b = torch.randn(buffer.H, 2 * args.expert_width, device=buffer.device).to(torch.bfloat16)
        idx_s, w_s = idx.clone(), w.clone()
        held: dict = {}

        def gemm() -> None:
            held["y"] = a @ b

        def both() -> None:
            held["planned"] = buffer.plan(idx_s, w_s, async_finish=True)
            gemm()
            held["planned"].event.current_stream_wait()

        graphs = {}
        for name, fn in (("gemm", gemm), ("both", both)):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
        graphs["both"].replay()
        want = buffer.plan(idx_s, w_s).handle.recv_slots_TK
        if not torch.equal(held["planned"].handle.recv_slots_TK, want):
            return {"overlap_note": "plan made beside the GEMM differs from a plain plan; not timed"}
        gemm_ms = time_fn(graphs["gemm"].replay, **timing).median_ms
        both_ms = time_fn(graphs["both"].replay, **timing).median_ms
        return {"overlap_gemm_ms": gemm_ms, "overlap_both_ms": both_ms, "overlap_exposed_ms": both_ms - gemm_ms}
    except Exception as error:  # a side measurement: record why it is missing
        return {"overlap_note": f"plan/GEMM overlap failed: {type(error).__name__}: {error}"[:300]}


def _graphed(
    args, rank, world, buffer, x, idx, w, device, timing, parts: bool = False, preplanned: bool = False
) -> dict:
    """Dispatch+combine captured once in a CUDA graph (static shapes, no host sync), replayed per step.

    The routing lives in static tensors: a new micro-batch copies its ``topk_idx``/``topk_weights`` in and
    replays; the plan is recomputed on the device inside the graph, or, with ``preplanned``, by
    ``buffer.plan`` in a graph of its own replayed before (timed apart: ``graph_plan_ms``). Checked against
    eager runs (plan inside dispatch) for the captured routing and for a different (hot-rank) routing
    copied in afterwards: the outputs must be equal bit for bit.
    """
    S, K, E = args.tokens, args.topk, args.experts
    x_s, idx_s, w_s = x.clone(), idx.clone(), w.clone()
    holder: dict = {}

    def plan_step() -> None:
        holder["planned"] = buffer.plan(idx_s, w_s) if preplanned else None

    def step() -> None:
        o = buffer.dispatch(x_s, idx_s, w_s, plan=holder["planned"])
        holder["y"] = buffer.combine(o.x_CH, o.handle, o.weights_C)[0]

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                plan_step()
                step()
        torch.cuda.current_stream().wait_stream(side)
        plan_graph = torch.cuda.CUDAGraph() if preplanned else None
        if plan_graph is not None:
            with torch.cuda.graph(plan_graph):  # its outputs (the plan) are the step graph's inputs
                plan_step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        checks = []
        for skew in ("captured", "hot_rank"):
            if skew == "hot_rank":
                new_idx, new_w = make_routing("hot_rank", S, K, E, world, rank=rank, seed=9)
                idx_s.copy_(new_idx)
                w_s.copy_(new_w)
            if plan_graph is not None:
                plan_graph.replay()
            graph.replay()
            eager = buffer.combine(*_eager_parts(buffer, x_s, idx_s, w_s))[0]
            checks.append(torch.equal(holder["y"], eager))
        if not all(checks):
            return {"graph_note": f"CUDA-graph replay differs from eager ({checks}); not timed"}
        idx_s.copy_(idx)
        w_s.copy_(w)
        if plan_graph is not None:
            plan_graph.replay()
        t = time_fn(graph.replay, **timing)
        result = {"graph_ms": t.median_ms, "graph_p80_ms": t.p80_ms}
        if plan_graph is not None:
            result["graph_plan_ms"] = time_fn(plan_graph.replay, **timing).median_ms
    except Exception as error:  # capture support depends on the NCCL/torch build: record why not
        return {"graph_note": f"CUDA-graph capture failed: {type(error).__name__}: {error}"[:300]}
    del graph
    if parts:
        result.update(_graphed_parts(buffer, x_s, idx_s, w_s, timing, holder["planned"]))
    return result


def _graphed_parts(buffer, x_s, idx_s, w_s, timing, planned=None) -> dict:
    """Dispatch alone and combine alone (of one captured dispatch's output), each as its own CUDA graph."""
    try:
        held: dict = {}
        dispatch_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(dispatch_graph):
            held["o"] = buffer.dispatch(x_s, idx_s, w_s, plan=planned)
        dispatch_graph.replay()
        o = held["o"]
        combine_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(combine_graph):
            buffer.combine(o.x_CH, o.handle, o.weights_C)
        return {
            "graph_dispatch_ms": time_fn(dispatch_graph.replay, **timing).median_ms,
            "graph_combine_ms": time_fn(combine_graph.replay, **timing).median_ms,
        }
    except Exception as error:  # a breakdown only: record why it is missing
        return {"graph_parts_note": f"split capture failed: {type(error).__name__}: {error}"[:300]}


def _eager_parts(buffer, x, idx, w):
    o = buffer.dispatch(x, idx, w)
    return o.x_CH, o.handle, o.weights_C


def _nvlink(args, hidden, x, idx, w, reference_out, device, timing) -> dict:
    """The symmetric-memory transport: same slots and combine as the NCCL path, then timed."""
    S, K, E = args.tokens, args.topk, args.experts
    try:
        nv = Buffer(None, S, hidden, K, E, device=device, validate=False, transport="nvlink")
        out = nv.dispatch(x, idx, w)
        same = torch.equal(out.x_CH, reference_out.x_CH)
        y_nv, _ = nv.combine(out.x_CH, out.handle, out.weights_C)
        y_ref, _ = nv.combine(reference_out.x_CH, out.handle, reference_out.weights_C)
        if not same or not torch.equal(y_nv, y_ref):
            return {"nvlink_note": "nvlink transport gave different slots or combine; not timed"}

        def both() -> None:
            o = nv.dispatch(x, idx, w)
            nv.combine(o.x_CH, o.handle, o.weights_C)

        res = {
            "nvlink_dispatch_ms": time_fn(lambda: nv.dispatch(x, idx, w), **timing).median_ms,
            "nvlink_combine_ms": time_fn(lambda: nv.combine(out.x_CH, out.handle, out.weights_C), **timing).median_ms,
            "nvlink_ms": time_fn(both, **timing).median_ms,
        }
        rank, world = nv.rank, nv.num_ranks
        res.update({f"nvlink_{k}": v for k, v in _graphed(args, rank, world, nv, x, idx, w, device, timing).items()})
        nv.destroy()
        return res
    except Exception as error:  # the fast path is optional: record why it did not run
        return {"nvlink_note": f"nvlink transport failed: {type(error).__name__}: {error}"[:300]}


def _weights(args, rank, world, hidden, idx, w, x, device, timing) -> dict:
    """Prefetch and gradient reduction of the redundant experts this skew needs (num_redundant_slots = max)."""
    S, K, E = args.tokens, args.topk, args.experts
    probe = Buffer(None, S, hidden, K, E, device=device, validate=False)
    plan = probe.dispatch(x, idx, w).handle.plan
    need = int(plan.num_redundant_R.max())
    probe.destroy()
    if need == 0:
        return {"redundant_max": 0, "prefetch_gb": 0.0, "prefetch_ms": 0.0, "reduce_grad_ms": 0.0}
    buffer = Buffer(None, S, hidden, K, E, device=device, validate=False, num_redundant_slots=need)
    P, W = E // world, (3 * args.expert_width, hidden)
    # Persistent [P + N] stacks: home experts first, the redundant ones fetched into the tail in place.
    stack = torch.randn(P + need, *W, device=device).to(torch.bfloat16)
    grad = torch.randn_like(stack)
    expert_bytes = stack[0].numel() * stack.element_size()
    res = {
        "redundant_max": need,
        "prefetch_gb": need * expert_bytes / 1e9,
        "prefetch_ms": time_fn(lambda: buffer.prefetch_weight(plan, stack[:P], out=stack[P:]), **timing).median_ms,
        "reduce_grad_ms": time_fn(lambda: buffer.reduce_grad(plan, grad, inplace=True), **timing).median_ms,
    }
    buffer.destroy()
    return res


def _high_priority_group(world: int):
    """A second NCCL group over the same ranks whose internal stream has high priority (its copy kernels
    then get SMs ahead of the slot stores and reductions they overlap); None where the build lacks it."""
    try:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        return dist.new_group(list(range(world)), pg_options=options)
    except Exception as error:  # noqa: BLE001 - optional variant: record and go on without it
        print(f"no high-priority NCCL group: {type(error).__name__}: {error}", flush=True)
        return None


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        device = "cpu"
    kwargs = {"device_id": torch.device(device)} if args.backend == "nccl" else {}
    dist.init_process_group(
        args.backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300), **kwargs
    )
    rows = []
    hp_group = _high_priority_group(world) if args.backend == "nccl" else None
    try:
        cases = [(int(h), skew) for h in args.hiddens.split(",") for skew in args.skews.split(",")]
        for hidden, skew in track(cases, "ep cases") if rank == 0 else cases:
            row = _case(args, rank, world, hidden, skew, device, hp_group)
            rows.append(row)
            if rank == 0:  # written after every case, so a later failure keeps what was measured
                print(json.dumps(row), flush=True)
                Path(out_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _to_rows(results: list[dict], args: argparse.Namespace) -> list[Row]:
    def best(r: dict) -> float:  # the fastest verified CUDA-graph replay when one was captured, else eager
        graphs = [v for v in (r.get("graph_ms"), r.get("hp_graph_ms")) if v]
        return min(graphs) if graphs else r["ours_ms"]

    uniform = {r["hidden"]: best(r) for r in results if r["skew"] == "uniform" and "ours_ms" in r}
    rows = []
    for r in results:
        params = {"S": args.tokens, "H": r["hidden"], "E": args.experts, "K": args.topk, "skew": r["skew"]}
        if "ours_ms" not in r:
            rows.append(Row(r["case"], BASELINE, None, float("nan"), params, {}, f"gate failed: {r['note']}"))
            continue
        ours = best(r)
        extra = {
            "dispatch ms": r["dispatch_ms"],
            "combine ms": r["combine_ms"],
            "naive disp ms": r["naive_dispatch_ms"],
            "naive comb ms": r["naive_combine_ms"],
            "unbalanced ms": r["unbalanced_ms"],
            "eager ms": r["ours_ms"],
            "graph ms": r.get("graph_ms"),
            "graph ms (high-prio NCCL stream)": r.get("hp_graph_ms"),
            "graph dispatch ms": r.get("graph_dispatch_ms"),
            "graph combine ms": r.get("graph_combine_ms"),
            **{f"graph ms (num_chunks={c})": r.get(f"chunks{c}_graph_ms") for c in args.chunk_sweep.split(",") if c},
            "graph ms (torch planner)": r.get("torch_planner_graph_ms"),
            "graph ms (torch planner, high-prio)": r.get("torch_planner_hp_graph_ms"),
            # Variants on the group of r["variants_group"] (high-priority when present): compare with the
            # "graph ms (high-prio NCCL stream)" column of the same row.
            "graph ms (remote-only combine, preplanned)": r.get("remote_planned_graph_ms"),
            "graph plan ms (Buffer.plan, off the critical path)": r.get("remote_planned_graph_plan_ms"),
            "graph ms (remote-only combine)": r.get("remote_graph_ms"),
            "graph dispatch ms (remote-only)": r.get("remote_graph_dispatch_ms"),
            "graph combine ms (remote-only)": r.get("remote_graph_combine_ms"),
            "graph ms (preplanned, all-to-all combine)": r.get("planned_graph_ms"),
            "eager ms (remote-only combine, planned in the step)": r.get("remote_planned_eager_ms"),
            "stand-in expert GEMM ms": r.get("overlap_gemm_ms"),
            "GEMM + Buffer.plan beside it ms": r.get("overlap_both_ms"),
            "plan exposed beside GEMM ms": r.get("overlap_exposed_ms"),
            "remote-only bits = default": r.get("remote_planned_bitwise_equal"),
            "nvlink eager ms": r.get("nvlink_ms"),
            "nvlink graph ms": r.get("nvlink_graph_ms"),
            "nvlink disp ms": r.get("nvlink_dispatch_ms"),
            "nvlink comb ms": r.get("nvlink_combine_ms"),
            "vs uniform": ours / uniform[r["hidden"]] if uniform.get(r["hidden"]) else None,
            "disp GB/s": r["ours_offrank_gb"] / (r["dispatch_ms"] / 1e3),
            "comb GB/s": r["ours_offrank_gb"] / (r["combine_ms"] / 1e3),
            "load max/mean": r["max_over_mean"],
            "unbal. max/mean": r["unbalanced_max_over_mean"],
            "peak GiB": r["ours_peak_gib"],
            "naive peak GiB": r["naive_peak_gib"],
            "redundant max": r["redundant_max"],
            "prefetch GB (max rank)": r["prefetch_gb"],
            "prefetch ms": r["prefetch_ms"],
            "reduce_grad ms": r["reduce_grad_ms"],
        }
        if r.get("graph_ms") or r.get("hp_graph_ms"):
            hp = r.get("hp_graph_ms") and (not r.get("graph_ms") or r["hp_graph_ms"] < r["graph_ms"])
            how = "ours = CUDA-graph replay (NCCL" + (", high-priority NCCL stream)" if hp else ")")
        else:
            how = "ours = eager (NCCL)"
        notes = [how, r["note"], r.get("graph_note", ""), r.get("hp_graph_note", ""), r.get("graph_parts_note", "")]
        prefixes = ("chunks", "torch_planner", "remote", "planned")
        notes += [v for k, v in r.items() if k.startswith(prefixes) and k.endswith(("_graph_note", "_parts_note"))]
        if r.get("remote_planned_graph_ms"):
            notes.append(f"remote-only/preplanned variants on the {r['variants_group']}")
        notes += [r.get("nvlink_note", ""), r.get("nvlink_graph_note", ""), r.get("overlap_note", "")]
        rows.append(Row(r["case"], BASELINE, r["naive_ms"], ours, params, extra, "; ".join(filter(None, notes))))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `k3infra bench ep --local`: one GPU, no communication (planner chain, slot stores, reduction).
    if "--local" in argv:
        from benchmarks.ep import local

        return local.main([a for a in argv if a != "--local"])
    args = _parse(argv)
    if args.backend == "nccl" and torch.cuda.device_count() < args.world:
        print(
            f"needs {args.world} CUDA devices (found {torch.cuda.device_count()}); try --backend gloo for a smoke run"
        )
        return 2
    from k3infra.testing import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "rows.json")
        try:
            mp.spawn(_worker, args=(args.world, free_port(), args, out_path), nprocs=args.world, join=True)
        except Exception as error:  # keep and report the cases measured before the failure
            print(f"benchmark workers failed: {error}")
        results = json.loads(Path(out_path).read_text()) if Path(out_path).exists() else []
    if not results:
        return 1
    rows = _to_rows(results, args)
    if not args.no_study:
        rows += planner_study(tokens=args.tokens, top_k=args.topk, num_experts=args.experts)
    for row in rows:
        speed = f"{row.speedup:.1f}x" if row.speedup else "-"
        print(f"{row.case:28s} ours {row.ours_ms:8.3f} ms  naive {row.baseline_ms or float('nan'):8.3f} ms  {speed}")
    if not args.no_write:
        info = machine_info()
        path = write_results("ep", rows, title=f"MoonEP dispatch+combine, EP={args.world}", info=info)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
