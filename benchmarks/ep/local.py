"""MoonEP's local (no communication) dispatch-path work on ONE GPU: the planner chain before vs after fusing it,
and the slot stores and combine reduction, at K3 shapes with the layout an EP = 2 run would see.

Usage (device machine, one GPU):  python -m benchmarks.ep.local [--tokens 4096] [--hiddens 7168,3584]
CPU smoke (Triton interpreter):   TRITON_INTERPRET=1 python -m benchmarks.ep.local --device cpu --tokens 8 \
                                      --experts 16 --topk 4 --hiddens 32 --reps 2 --no-write

What is simulated: every rank's routing (`moonep.skew.make_routing`, ranks 0..R-1) is built on this one
device and stacked into the ``[R, 1 + 2*S*K]`` rows the layout all-gather delivers; rank 0's part of a
dispatch+combine then runs with no communication at all:

- planner chain: this rank's layout row, then the plan and the handle (`moonep.layout.Layout`), with
  ``planner="torch"`` (the path of the last 2-GPU run: torch ops + `place_hits_triton`) and
  ``planner="fused"`` (`moonep.fused_plan`), checked equal field by field (and against the loop reference
  planner) before timing;
- dispatch stores: rank 0's own rows and the other ranks' rows (random stand-ins for the all-gathered
  chunks) stored into slots, chunk by chunk as `Buffer` does;
- combine reduction: per chunk, each token's slots reduced in fp32 and the R partial rows summed (the
  partials that would cross the wire are used in place).

Each part is captured in a CUDA graph and replayed (median of ``--reps``); kernel launches per part are
counted with the profiler. The 2-GPU number (`benchmarks.ep.run`) also contains the layout exchange, the
token all-gather and combine's all-to-all, which overlap parts of this work: these numbers are not it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.ep.shapes import add_shape_args
from benchmarks.harness import Row, machine_info, time_fn, write_results
from moonep.layout import Layout, layout_row
from moonep.ops import new_slot_rows, reduce_slots, scatter_rows, sum_ranks
from moonep.reference import reference_plan
from moonep.skew import make_routing

WHAT = "single GPU, no communication: EP=2 layout simulated, rank 0's local work"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--world", type=int, default=2, help="EP ranks whose layout is simulated")
    p.add_argument("--local-skews", default="uniform,one_expert", help="skews whose stores/reduction are timed")
    p.add_argument("--chunks", type=int, default=4, help="row chunks stored into slots one by one, as Buffer does")
    p.add_argument("--reps", type=int, default=50, help="timed calls per case")
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--no-write", action="store_true", help="print only; write no results JSON")
    return p.parse_args(argv)


def _graph(fn) -> tuple[object, object]:
    """``fn`` captured in a CUDA graph after two warm-up runs on a side stream; returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _kernels(fn) -> int | None:
    """CUDA kernels (and memsets/copies) one eager call of ``fn`` launches; None where the profiler fails."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - a count only: the timings stand without it
        return None


def _timed(fn, args: argparse.Namespace) -> float:
    if not args.device.startswith("cuda"):
        return time_fn(fn, device=args.device, warmup=1, rep=args.reps).median_ms
    graph, _ = _graph(fn)
    return time_fn(graph.replay, device=args.device, warmup=3, rep=args.reps).median_ms


def _layouts(args, R, S, K, E, device):
    C = S * K
    return {p: Layout(R, S, K, E, 0, C, True, torch.device(device), planner=p) for p in ("torch", "fused")}


def _planner_case(args: argparse.Namespace, skew: str) -> tuple[dict, tuple]:
    R, S, K, E, device = args.world, args.tokens, args.topk, args.experts, args.device
    routes = [make_routing(skew, S, K, E, R, rank=r, seed=1) for r in range(R)]
    gathered = torch.stack([layout_row(i, w, S, E) for i, w in routes]).to(device)
    idx, w = (t.to(device) for t in routes[0])
    layouts = _layouts(args, R, S, K, E, device)
    results, chains = {}, {}
    for name, layout in layouts.items():

        def chain(layout=layout):
            row = layout.row(idx, w)
            plan, hits = layout.plan(gathered)
            return row, plan, layout.handle(plan, hits, S)

        chains[name] = chain
        results[name] = chain()
    note = []
    (row_t, plan_t, handle_t), (row_f, plan_f, handle_f) = results["torch"], results["fused"]
    if not torch.equal(row_t, row_f):
        note.append("layout rows differ")
    for field in ("counts_RE", "assign_ER", "keep_E", "ovf_start_E", "spare_start_R", "spare_end_R", "src_prefix_RE",
                  "redundant_ids_RN", "redundant_idx_ER", "num_redundant_R", "local_counts_RL", "local_offsets_RL",
                  "load_R"):  # fmt: skip
        if not torch.equal(getattr(plan_t, field), getattr(plan_f, field)):
            note.append(f"plan.{field} differs")
    for field in ("recv_slots_TK", "slot_src_C", "weights_C", "local_counts_L"):
        if not torch.equal(getattr(handle_t, field), getattr(handle_f, field)):
            note.append(f"handle.{field} differs")
    ref = reference_plan(plan_t.counts_RE.cpu())
    if not all(torch.equal(getattr(plan_f, k).cpu(), v) for k, v in ref.items()):
        note.append("fused plan differs from the loop reference")
    stats = plan_f.stats()
    row = {"skew": skew, "note": "; ".join(note), "max_over_mean": stats["max_over_mean"]}
    if not note:
        for name, chain in chains.items():
            row[f"{name}_ms"] = _timed(chain, args)
            row[f"{name}_kernels"] = _kernels(chain) if device.startswith("cuda") else None
    return row, (handle_f, idx, w)


def _local_case(args: argparse.Namespace, hidden: int, handle) -> dict:
    """Rank 0's slot stores (dispatch) and reduction + rank sum (combine), chunk by chunk, no wire."""
    R, S, K, device = args.world, args.tokens, args.topk, args.device
    C = S * K
    gen = torch.Generator(device=device).manual_seed(hidden)
    x = torch.randn(S, hidden, device=device, generator=gen).to(torch.bfloat16)
    n = max(1, min(args.chunks, S))
    sizes = [S // n + (i < S % n) for i in range(n)]
    chunks = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
    gathered, rows = [], []  # stand-ins for the all-gathered chunks: [R*size, H] with rank 0's rows skipped
    for first, size in chunks:
        gathered.append(torch.randn(R * size, hidden, device=device, generator=gen).to(torch.bfloat16))
        r = torch.arange(R, device=device)[:, None] * S + first + torch.arange(size, device=device)[None, :]
        r[0] = -1
        rows.append(r.reshape(-1))
    own = torch.arange(S, device=device)
    used = handle.local_counts_L.sum()

    def dispatch_local() -> torch.Tensor:
        x_CH = new_slot_rows(C, hidden, used, torch.bfloat16, device)
        scatter_rows(x_CH, x, own, handle.recv_slots_TK)
        for g, r in zip(gathered, rows):
            scatter_rows(x_CH, g, r, handle.recv_slots_TK)
        return x_CH

    y_CH = dispatch_local()
    slots_RSK = handle.recv_slots_TK.view(R, S, K)
    out = torch.empty(S, hidden, dtype=torch.bfloat16, device=device)

    def combine_local() -> torch.Tensor:
        for first, size in chunks:
            part = reduce_slots(y_CH, slots_RSK[:, first : first + size].reshape(R * size, K), handle.weights_C,
                                torch.bfloat16)  # fmt: skip
            sum_ranks(part.view(R, size, hidden), out[first : first + size])
        return out

    combine_local()
    ms_d, ms_c = _timed(dispatch_local, args), _timed(combine_local, args)
    written = int(used) * hidden * 2
    read = int((handle.recv_slots_TK >= 0).sum()) * hidden * 2
    return {
        "dispatch_local_ms": ms_d,
        "combine_local_ms": ms_c,
        "dispatch_write_gbs": written / (ms_d / 1e3) / 1e9,
        "combine_read_gbs": read / (ms_c / 1e3) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu with TRITON_INTERPRET=1)")
        return 2
    rows: list[Row] = []
    params = {"S": args.tokens, "E": args.experts, "K": args.topk, "EP (simulated)": args.world}
    local_skews = [s for s in args.local_skews.split(",") if s]
    for skew in args.skews.split(","):
        r, (handle, _, _) = _planner_case(args, skew)
        print(r, flush=True)
        timed = "torch_ms" in r
        extra = {
            "torch kernels": r.get("torch_kernels"),
            "fused kernels": r.get("fused_kernels"),
            "load max/mean": r["max_over_mean"],
        }
        note = f"{WHAT}; planner chain (layout row + plan + handle), CUDA graph" if timed else f"gate: {r['note']}"
        rows.append(
            Row(f"planner-{skew}", "torch planner chain (last 2-GPU run's path)", r.get("torch_ms"),
                r.get("fused_ms", float("nan")), {**params, "skew": skew}, extra, note)
        )  # fmt: skip
        if not timed or skew not in local_skews:
            continue
        for hidden in [int(h) for h in args.hiddens.split(",")]:
            loc = _local_case(args, hidden, handle)
            print({"skew": skew, "hidden": hidden, **loc}, flush=True)
            step_before = r["torch_ms"] + loc["dispatch_local_ms"] + loc["combine_local_ms"]
            step_after = r["fused_ms"] + loc["dispatch_local_ms"] + loc["combine_local_ms"]
            extra = {
                "planner before ms": r["torch_ms"],
                "planner after ms": r["fused_ms"],
                "dispatch stores ms": loc["dispatch_local_ms"],
                "combine reduce+sum ms": loc["combine_local_ms"],
                "stores GB/s (written)": loc["dispatch_write_gbs"],
                "reduce GB/s (read)": loc["combine_read_gbs"],
            }
            rows.append(
                Row(f"local-H{hidden}-{skew}", "same local work with the torch planner chain", step_before,
                    step_after, {**params, "H": hidden, "skew": skew}, extra,
                    f"{WHAT}; sum of the parts' CUDA-graph medians, no wire, no overlap")
            )  # fmt: skip
    for row in rows:
        print(f"{row.case:28s} before {row.baseline_ms or float('nan'):8.3f} ms  after {row.ours_ms:8.3f} ms")
    if not args.no_write:
        path = write_results("ep-local", rows, title="MoonEP local dispatch-path work (1 GPU, no communication)",
                             info=machine_info())  # fmt: skip
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
