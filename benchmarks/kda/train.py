"""FlashKDA training benchmark: forward + backward of ours vs fla-core 0.6.0 in one run, correctness gates first.

Rows (the training bar's six): bf16, K3 flags (in-kernel L2 norm, bounded gate ``lower_bound=-5`` with ``A_log`` and
``dt_bias``, beta sigmoid), fp32 initial and final state, gradients for every input; K = V = 128: ``B1-T8192-H64``,
``varlen1024x8-H64``, ``B8-T4096-H32``, ``B1-T32768-H32``, GVA ``B1-T8192-H16-HV64`` (16 q/k heads, 64 value
heads); and ``B1-T8192-H64-K64`` (K = V = 64).

Per row: median ms of ``forward + backward`` for ``flashkda.chunk_kda`` (v2 where ``prefers_v2_training`` holds, as
on a Hopper GPU at these rows; ``FLASHKDA_KERNELS=v1`` times v1) and ``fla.ops.kda.chunk_kda`` (fla's own Triton
path: ``FLASHKDA_DISABLE=1``, ``FLA_FLASH_KDA=0``), the ratio, and the peak extra memory of each step.

Gates, before any timing: (1) at a small shape, ours vs fp64 autograd through ``flashkda.reference`` (o, final
state and every gradient, relative RMS error <= 1e-2); (2) at every row, ours vs fla (same bound). A row whose
gate fails is reported with its error and not timed.

Then a short training loop: a small KDA language model (two ``KimiDeltaAttention`` layers from flashkda vs the same
model built from ``fla.layers.KimiDeltaAttention`` with copied weights, and fla's from another init as the noise
yardstick) trained on the same batches; the row keeps the curves' summary.

Usage: ``python -m benchmarks.kda.train [--cases [NAME ...]] [--rep N] [--no-write] [--steps N] [--profile
[--ncu-range]] [--no-gate] [--ours-only] [--warmup {ours,fla}] [--slices N ...] [--loop-first]
[--gate-T T ...] [--disable-recompute]``. ``--cases`` with no name runs no op row (only the training loop). Every
phase prints its elapsed seconds (first calls include Triton compilation and fla's autotuning), and the results file
is rewritten after every row, so a run cut by a time cap keeps the rows it finished. ``--profile`` prints the CUDA
kernel table of ours and of fla at the first row (both kept in its JSON row). On the GPU machine:
``bash benchmarks/device/run.sh "kda --train"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLASHKDA_DISABLE", "1")

from benchmarks.harness import (  # noqa: E402
    Row,
    machine_info,
    machine_line,
    rms_ratio,
    time_fn,
    update_markdown,
    write_results,
)

# Rows with the same head count are adjacent: fla autotunes per head count (over 100 s for its first training
# call on the device), and the next row with that count reuses the result.
TRAIN_CASES = {
    "B1-T8192-H64": dict(B=1, T=8192, H=64, lengths=None),
    "varlen1024x8-H64": dict(B=1, T=8192, H=64, lengths=(1024,) * 8),
    "B8-T4096-H32": dict(B=8, T=4096, H=32, lengths=None),
    "B1-T32768-H32": dict(B=1, T=32768, H=32, lengths=None),
    "B1-T8192-H16-HV64": dict(B=1, T=8192, H=16, HV=64, lengths=None),
    "B1-T8192-H64-K64": dict(B=1, T=8192, H=64, D=64, lengths=None),
}
FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)
GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
TOL = 1e-2


def dims(case: dict) -> tuple[int, int]:
    """``(value heads, head dim)`` of a `TRAIN_CASES` entry."""
    return case.get("HV", case["H"]), case.get("D", 128)


def make_inputs(B: int, T: int, H: int, lengths, device: str, D: int = 128, seed: int = 0, HV: int | None = None):
    """Leaf inputs of one row (``H`` q/k heads, ``HV`` value heads, default ``H``; head dim ``D``) and the varlen
    keywords."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    HV = H if HV is None else HV

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    N = B if lengths is None else len(lengths)
    x = dict(q=rn(B, T, H, D), k=rn(B, T, H, D), v=rn(B, T, HV, D), g=rn(B, T, HV, D), beta=rn(B, T, HV))
    x["A_log"] = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
    x["dt_bias"] = rn(HV * D, dtype=torch.float32)
    x["initial_state"] = rn(N, HV, D, D, dtype=torch.float32) * 0.1
    for t in x.values():
        t.requires_grad_()
    extra = {}
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        extra["cu_seqlens"] = cu.to(device)
    return x, extra


def step(fn, x, extra, do, dht):
    """One training step of the op: forward, then backward into every input; returns (o, ht, grads)."""
    import torch

    o, ht = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], A_log=x["A_log"],
               dt_bias=x["dt_bias"], **FLAGS, **extra)
    grads = torch.autograd.grad((o, ht), [x[n] for n in GRAD_NAMES], (do, dht))
    return o, ht, dict(zip(GRAD_NAMES, grads))


def peak_extra_mib(fn, device: str) -> float:
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def gate_vs_reference(ours, device: str, B: int = 2, T: int = 200, H: int = 4) -> dict[str, float]:
    """Gate: ours vs fp64 autograd through the (token-recurrent) reference at ``B x T x H``, bf16, the rows' flags.

    Returns name -> relative RMS error."""
    import torch

    from flashkda.reference import chunk_kda_reference

    x, extra = make_inputs(B, T, H, None, device, D=128, seed=1)
    do = torch.randn(B, T, H, 128, device=device, dtype=torch.bfloat16)
    dht = torch.randn(B, H, 128, 128, device=device)
    o, ht, grads = step(ours, x, extra, do, dht)
    rx = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rht = chunk_kda_reference(rx["q"], rx["k"], rx["v"], rx["g"], rx["beta"], scale=128**-0.5,
                                  initial_state=rx["initial_state"], A_log=rx["A_log"], dt_bias=rx["dt_bias"],
                                  **{k: v for k, v in FLAGS.items() if k != "safe_gate"})
    rgrads = torch.autograd.grad((ro, rht), [rx[n] for n in GRAD_NAMES], (do.double(), dht.double()))
    errs = {"o": rms_ratio(o, ro), "final_state": rms_ratio(ht, rht)}
    errs.update({f"d{n}": rms_ratio(grads[n], r) for n, r in zip(GRAD_NAMES, rgrads)})
    return errs


class Progress:
    """Prints ``[elapsed s] message`` lines, so a run cut by a cap shows where its time went."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", flush=True)


def run_ops(args, device: str, log: Progress, save) -> list[Row]:
    """The fp64 gate (unless ``--no-gate``), then the op rows in order; ``save(rows)`` after every row."""
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from flashkda import chunk_kda as ours

    names = list(TRAIN_CASES) if args.cases is None else args.cases
    if not names:
        return []
    for T in () if args.no_gate or args.warmup else args.gate_T:
        B = 2 if T <= 1024 else 1
        errs = gate_vs_reference(ours, device, B=B, T=T)
        worst = max(errs.values())
        log(f"gate vs fp64 reference (B{B} T{T} H4 D128 bf16): worst {worst:.2e} " +
            " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
        if worst > TOL:
            print("correctness gate FAILED: no timing", file=sys.stderr)
            return [Row(f"gate-vs-fp64-T{T}", "fp64 reference", None, float("nan"), {}, errs, "gate failed")]

    rows = []
    for name in names:
        if args.warmup == "ours":
            warm_case(name, ours, device, log, args.slices)
            continue
        if args.warmup == "fla":
            warm_case(name, fla_chunk_kda, device, log)
            continue
        for keep in (False, True) if args.disable_recompute else (False,):
            rows.append(run_case(name, ours, fla_chunk_kda, args, args.profile and name == names[0] and not keep,
                                 device, log, disable_recompute=keep))
            save(rows)
            torch.cuda.empty_cache()
    return rows


def warm_case(name: str, fn, device: str, log: Progress, slices: list[int] = ()) -> None:
    """``--warmup``: one forward + backward at the row's shape, to fill Triton's on-disk cache (compiled kernels and,
    with ``TRITON_CACHE_AUTOTUNING=1``, fla's autotune choices) from a parallel process before the timed run; for
    ours also once per head-slice count of ``slices`` (the slice width is a compile-time constant of some kernels)."""
    import torch

    c = TRAIN_CASES[name]
    HV, D = dims(c)
    x, extra = make_inputs(c["B"], c["T"], c["H"], c["lengths"], device, D=D, HV=HV)
    N = c["B"] if c["lengths"] is None else len(c["lengths"])
    do = torch.randn(c["B"], c["T"], HV, D, device=device, dtype=torch.bfloat16)
    dht = torch.randn(N, HV, D, D, device=device)
    for n in (None, *slices):
        log(f"{name}: warm-up call" + ("" if n is None else f" with {n} head slices"))
        step(fn if n is None else ours_in_head_slices(n), x, extra, do, dht)
        torch.cuda.synchronize()
    log(f"{name}: warm")


def ours_in_head_slices(n: int):
    """The v1 training path (`chunk_kda_autograd`) with its backward in ``n`` head slices (``head_slices``)."""
    from flashkda.chunk import chunk_kda_autograd

    def fn(q, k, v, g, beta, **kw):
        return chunk_kda_autograd(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, head_slices=n, **kw)

    return fn


def run_case(name: str, ours, fla_chunk_kda, args, with_profile: bool, device: str, log: Progress,
             disable_recompute: bool = False) -> Row:
    """One row: ours first (compile, time, peak memory, profile), then fla, then the gate ours vs fla.

    Ours is measured before fla's first call (which autotunes), so a row cut short by a cap still printed ours.
    ``disable_recompute``: both sides get ``disable_recompute=True`` (the forward keeps its intermediates for the
    backward; the row is named ``<case>-disable_recompute``).
    """
    import torch

    from flashkda.bwd.chunk_bwd import backward_head_slices
    from flashkda.bwd.gated_dots import fused_gates

    c = TRAIN_CASES[name]
    HV, D = dims(c)
    x, extra = make_inputs(c["B"], c["T"], c["H"], c["lengths"], device, D=D, HV=HV)
    if disable_recompute:
        extra = dict(extra, disable_recompute=True)
        name = f"{name}-disable_recompute"
    baseline = "fla 0.6.0 chunk_kda fwd+bwd" + (" (disable_recompute=True)" if disable_recompute else "")
    N = c["B"] if c["lengths"] is None else len(c["lengths"])
    do = torch.randn(c["B"], c["T"], HV, D, device=device, dtype=torch.bfloat16)
    dht = torch.randn(N, HV, D, D, device=device)
    NC = sum(-(-n // 64) for n in c["lengths"]) if c["lengths"] else c["B"] * -(-c["T"] // 64)
    slices = backward_head_slices(N, NC, HV, HV // c["H"], 64, D, D)
    params = dict(B=c["B"], T=c["T"], H=c["H"], HV=HV, K=D, V=D, dtype="bf16", varlen=c["lengths"] is not None)

    def run_fla():
        return step(fla_chunk_kda, x, extra, do, dht)

    def run_ours():
        return step(ours, x, extra, do, dht)

    log(f"{name}: first call of ours")
    o, ht, g = run_ours()
    torch.cuda.synchronize()
    log(f"{name}: timing ours")
    t_ours = time_fn(run_ours, device=device, warmup=2, rep=args.rep)
    mem_ours = peak_extra_mib(run_ours, device)
    log(f"{name}: ours {t_ours.median_ms:.2f} ms (p20-p80 {t_ours.p20_ms:.2f}-{t_ours.p80_ms:.2f}), "
        f"peak {mem_ours:.0f} MiB")
    from benchmarks.kda.calibrate import ours_path

    path = ours_path(x, dict(FLAGS, **extra), training=True)
    extras = {"ours_path": path, "ours_peak_MiB": round(mem_ours), "ours_p20_ms": t_ours.p20_ms,
              "ours_p80_ms": t_ours.p80_ms}
    if path.startswith("v1"):  # v1's backward options
        extras.update(ours_head_slices=len(slices), ours_fused_gates=fused_gates("tf32", D))
    for n in args.slices:
        def run_sliced(n: int = n):
            return step(ours_in_head_slices(n), x, extra, do, dht)

        t_n = time_fn(run_sliced, device=device, warmup=2, rep=args.rep)
        mem_n = peak_extra_mib(run_sliced, device)
        extras[f"ours_ms_{n}_slices"], extras[f"ours_peak_MiB_{n}_slices"] = t_n.median_ms, round(mem_n)
        log(f"{name}: ours with {n} head slices {t_n.median_ms:.2f} ms, peak {mem_n:.0f} MiB")
    if with_profile:
        extras["ours_profile_top"] = profile(run_ours)
    if args.ours_only:
        return Row(name, baseline, None, t_ours.median_ms, params, extras, "ours only (--ours-only)")
    log(f"{name}: first call of fla (autotunes)")
    fo, fht, fg = run_fla()
    torch.cuda.synchronize()
    cmp = {"o": rms_ratio(o, fo), "final_state": rms_ratio(ht, fht)}
    cmp.update({f"d{n}": rms_ratio(g[n], fg[n]) for n in GRAD_NAMES})
    del o, ht, g, fo, fht, fg
    worst_name = max(cmp, key=cmp.get)
    extras["worst_err_vs_fla"] = cmp[worst_name]
    log(f"{name}: ours vs fla " + " ".join(f"{k}={v:.1e}" for k, v in cmp.items()))
    if cmp[worst_name] > TOL:
        log(f"{name}: ours vs fla gate FAILED ({worst_name} {cmp[worst_name]:.2e}); fla not timed")
        return Row(name, baseline, None, float("nan"), params, extras, f"gate failed on {worst_name}")
    log(f"{name}: timing fla")
    t_fla = time_fn(run_fla, device=device, warmup=2, rep=args.rep)
    mem_fla = peak_extra_mib(run_fla, device)
    extras["fla_peak_MiB"] = round(mem_fla)
    note = f"ours = flashkda.chunk_kda: {path}" + (
        "; both keep the forward's states (disable_recompute=True)" if disable_recompute else "")
    row = Row(name, baseline, t_fla.median_ms, t_ours.median_ms, params, extras, note)
    log(f"{name}: fla {t_fla.median_ms:.2f} ms, ours {t_ours.median_ms:.2f} ms ({row.speedup:.2f}x); "
        f"peak fla {mem_fla:.0f} MiB ours {mem_ours:.0f} MiB")
    if with_profile:
        extras["fla_profile_top"] = profile(run_fla)
    if with_profile and args.ncu_range:
        ncu_range([(f"ours {name}", run_ours), (f"fla {name}", run_fla)])
    return row


def ncu_range(calls) -> None:
    """Warm up every ``(label, fn)`` twice, then call each once inside ``cudaProfilerStart/Stop``."""
    import torch

    for _, fn in calls:
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in calls:
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled: " + ", ".join(label for label, _ in calls), flush=True)


def profile(fn, top: int = 25) -> list[list]:
    """CUDA kernel profile of one call of ``fn``: prints the table, returns ``[[kernel, ms, calls], ...]`` (top)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(averages.table(sort_by=key, row_limit=30), flush=True)
        except (AttributeError, KeyError, ValueError):
            continue
        rows = sorted(((e.key, getattr(e, key) / 1e3, e.count) for e in averages), key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        print(f"profiled CUDA time {total:.2f} ms", flush=True)
        return [["total", round(total, 3), sum(r[2] for r in rows)]] + [[n, round(ms, 3), c] for n, ms, c in
                                                                        rows[:top]]
    return []


def training_loop(steps: int, device: str, log: Progress, warmup: bool = False) -> Row | None:
    """Train the same small KDA LM with flashkda's and fla's layers (same init, same batches); compare the losses.

    A third run, fla's layers from another initialisation (seed 1) on the same batches, is the noise yardstick: the
    gap ours-fla at equal init should be well inside the gap between two inits of the same model.
    With ``warmup`` every model runs two steps and nothing is returned (fills the Triton cache).
    """
    import torch
    import torch.nn as nn
    from fla.layers import KimiDeltaAttention as FlaKDA

    from flashkda.layer import KimiDeltaAttention

    vocab, width, T, B = 256, 256, 512, 8

    class TinyLM(nn.Module):
        def __init__(self, layer_cls):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.norms = nn.ModuleList(nn.RMSNorm(width) for _ in range(2))
            self.mixers = nn.ModuleList(
                layer_cls(hidden_size=width, head_dim=64, num_heads=4, lower_bound=-5.0, safe_gate=True,
                          layer_idx=i) for i in range(2))
            self.head = nn.Linear(width, vocab)

        def forward(self, ids):
            h = self.embed(ids)
            for norm, mixer in zip(self.norms, self.mixers):
                h = h + mixer(norm(h))[0]
            return self.head(h)

    steps = 2 if warmup else steps
    torch.manual_seed(0)
    ours = TinyLM(KimiDeltaAttention).to(device)
    theirs = TinyLM(FlaKDA).to(device)
    theirs.load_state_dict(ours.state_dict())
    torch.manual_seed(1)
    theirs_seed1 = TinyLM(FlaKDA).to(device)
    # A learnable stream: each sequence repeats a random 32-token motif, so a recurrent model can copy it.
    gen = torch.Generator(device=device).manual_seed(0)
    batches = []
    for _ in range(steps):
        motif = torch.randint(0, vocab, (B, 32), generator=gen, device=device)
        batches.append(motif.repeat(1, T // 32 + 1)[:, : T + 1])
    curves, seconds = {}, {}
    for label, model in (("flashkda", ours), ("fla", theirs), ("fla_seed1", theirs_seed1)):
        log(f"training loop: {steps} steps with {label} layers")
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses = []
        start = time.perf_counter()
        for ids in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        seconds[label] = time.perf_counter() - start
        curves[label] = losses
    if warmup:
        return None
    return loss_row(curves, seconds, dict(steps=steps, layers=2, width=width, heads=4, head_dim=64, T=T, B=B))


def loss_row(curves: dict[str, list[float]], seconds: dict[str, float], params: dict) -> Row:
    """Summary of the three loss curves (printed, and kept in the row: every 25th step, window means, gaps)."""
    ours, fla, fla1 = curves["flashkda"], curves["fla"], curves["fla_seed1"]
    steps = len(ours)
    last = max(1, min(50, steps // 4))

    def mean_abs_gap(a, b, window=slice(None)):
        pairs = list(zip(a[window], b[window]))
        return sum(abs(x - y) for x, y in pairs) / len(pairs)

    summary = {
        "first_loss": ours[0], "final_loss_ours": ours[-1], "final_loss_fla": fla[-1],
        "final_loss_fla_seed1": fla1[-1], "max_abs_loss_diff": max(abs(a - b) for a, b in zip(ours, fla)),
        f"mean_loss_last{last}_ours": sum(ours[-last:]) / last, f"mean_loss_last{last}_fla": sum(fla[-last:]) / last,
        f"mean_loss_last{last}_fla_seed1": sum(fla1[-last:]) / last,
        "mean_abs_gap_ours_fla": mean_abs_gap(ours, fla),
        "mean_abs_gap_fla_seed0_seed1": mean_abs_gap(fla, fla1),
        f"mean_abs_gap_last{last}_ours_fla": mean_abs_gap(ours, fla, slice(-last, None)),
        f"mean_abs_gap_last{last}_fla_seed0_seed1": mean_abs_gap(fla, fla1, slice(-last, None)),
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "curve_every_25": {k: [round(x, 4) for x in v[::25]] + [round(v[-1], 4)] for k, v in curves.items()},
    }
    print("training loop loss (flashkda | fla | fla from seed 1):", flush=True)
    for i in range(0, steps, max(1, steps // 12)):
        print(f"  step {i:3d}: {ours[i]:.4f} | {fla[i]:.4f} | {fla1[i]:.4f}", flush=True)
    print(f"  final: {ours[-1]:.4f} | {fla[-1]:.4f} | {fla1[-1]:.4f}; mean |ours - fla| "
          f"{summary['mean_abs_gap_ours_fla']:.4f} (last {last}: {summary[f'mean_abs_gap_last{last}_ours_fla']:.4f}); "
          f"mean |fla seed 0 - seed 1| {summary['mean_abs_gap_fla_seed0_seed1']:.4f} "
          f"(last {last}: {summary[f'mean_abs_gap_last{last}_fla_seed0_seed1']:.4f}); seconds {summary['seconds']}",
          flush=True)
    return Row("tiny-LM-train-loop", "same model with fla layers", None, float("nan"), params, summary,
               "loss curves, not timing; fla_seed1 = fla layers from another init (noise yardstick)")


def markdown_row(row: Row) -> Row:
    """``row`` as BENCHMARKS.md shows it: scalar extras only (no percentiles); the loss row as one sentence."""
    if row.case == "tiny-LM-train-loop":
        x = row.extra
        note = (f"loss over {row.params.get('steps')} steps, same init and batches: flashkda {x['first_loss']:.3f} -> "
                f"{x['final_loss_ours']:.3f}, fla {x['final_loss_fla']:.3f}; mean abs gap ours-fla "
                f"{x['mean_abs_gap_ours_fla']:.4f} vs fla seed 0 - seed 1 {x['mean_abs_gap_fla_seed0_seed1']:.4f}")
        return dataclasses.replace(row, extra={}, note=note)
    extra = {k: v for k, v in row.extra.items()
             if isinstance(v, (int, float, str)) and not k.endswith(("_p20_ms", "_p80_ms"))}
    return dataclasses.replace(row, extra=extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=None,
                        help=f"subset of {list(TRAIN_CASES)} in this order (none: no op row)")
    parser.add_argument("--rep", type=int, default=10, help="timed steps per row and side (default 10)")
    parser.add_argument("--steps", type=int, default=300, help="training-loop steps (0 to skip)")
    parser.add_argument("--ours-only", action="store_true", help="time only ours (no fla call in the op rows)")
    parser.add_argument("--warmup", choices=("ours", "fla"), default=None,
                        help="one untimed call per row (and 2 training steps) of one side, nothing written: fills "
                             "Triton's on-disk cache from a parallel process")
    parser.add_argument("--loop-first", action="store_true", help="run the training loop before the op rows")
    parser.add_argument("--gate-T", type=int, nargs="+", default=[200],
                        help="sequence lengths of the fp64 gates (B2 up to T 1024, else B1; H4)")
    parser.add_argument("--slices", type=int, nargs="*", default=[],
                        help="also time ours at every row with these fixed backward head-slice counts")
    parser.add_argument("--disable-recompute", action="store_true",
                        help="after each row, the same row with disable_recompute=True on both sides")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results JSON")
    parser.add_argument("--profile", action="store_true",
                        help="print CUDA kernel profiles of ours and fla at the first row")
    parser.add_argument("--ncu-range", action="store_true",
                        help="with --profile: then one step of ours and of fla inside a CUDA profiler range (for "
                             "ncu --profile-from-start off)")
    parser.add_argument("--no-gate", action="store_true", help="skip the fp64 reference gate (rows still check fla)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.kda.train needs a CUDA device; nothing measured", file=sys.stderr)
        return 2
    unknown = [name for name in args.cases or () if name not in TRAIN_CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(TRAIN_CASES)}")
    info = machine_info()
    print(machine_line(info), flush=True)
    log = Progress()

    def save(rows: list[Row]) -> None:
        if rows and not args.no_write:
            title = "FlashKDA training (forward + backward)"
            path = write_results("kda-train", rows, title=title, info=info)
            # BENCHMARKS.md gets the scalar columns only (the profile and the loss curves stay in the JSON)
            update_markdown("kda-train", [markdown_row(r) for r in rows], info, title=title, json_name=path.name)
            log(f"wrote {path}")

    if args.warmup:
        args.no_write = True
    rows: list[Row] = []
    loop = args.steps > 0 and not args.ours_only
    if loop and args.loop_first:
        rows += filter(None, [training_loop(args.steps, "cuda", log, warmup=args.warmup is not None)])
        save(rows)
    rows += run_ops(args, "cuda", log, lambda op_rows: save(rows + op_rows))
    if loop and not args.loop_first:
        rows += filter(None, [training_loop(args.steps, "cuda", log, warmup=args.warmup is not None)])
        save(rows)
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
