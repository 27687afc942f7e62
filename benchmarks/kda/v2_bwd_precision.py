"""Gradient precision of the v2 backward's emulation, and of fla 0.6.0's backward, against fp64 autograd.

On the H200 this gives the per-tensor errors that the backward kernels must match (the emulation is their oracle)
next to fla's own errors and our kernels' (``chunk_kda_v2`` at chunk 16) on the same inputs, with the worst
ratio ours / fla (the issue's bar: ours no worse than fla vs fp64, per tensor):
``python -m benchmarks.kda.v2_bwd_precision [--device cuda] [--T 1024] [--seeds 8]``. Each row pools its errors over
``--seeds`` fresh random cases (squared errors and squared references summed over the seeds before the ratio):
``dA_log`` has one value per head, so one H4 case gives a relative RMS of four numbers. Without CUDA, fla is skipped
and the table has the emulation only. Results: ``benchmarks/results/kda-v2-bwd-precision-<date>.json``.
The helpers are also the CPU tests' (`tests/flashkda/test_bwd_v2_emulate.py`).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from flashkda import reference
from flashkda.bwd.v2.checkpoints import emulate_recurrence_train
from flashkda.bwd.v2.emulate import emulate_backward
from flashkda.fwd.v2.emulate import emulate_prepare
from flashkda.fwd.v2.emulate32 import emulate_prepare32
from flashkda.fwd.v2.workspace import build_chunk_layout
from flashkda.fwd.v2.workspace32 import build_chunk_layout32

logger = logging.getLogger(__name__)

K = 128
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")


def _scale(c):
    """The query scale of a case: ``K ** -0.5`` at its head width."""
    return c["q"].shape[-1] ** -0.5


def make_case(B, T, H, cu=None, HV=None, seed=0, a_log=True, init=True, device="cpu", K=K):
    """Random bf16 inputs, ``do`` and ``dht`` (as the forward v2 tests' inputs; head width ``K``), on ``device``."""
    HV = HV or H
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = (randn(B, T, H, K).bfloat16() for _ in range(2))
    v, g = (randn(B, T, HV, K).bfloat16() for _ in range(2))
    beta = randn(B, T, HV).bfloat16()
    A_log = torch.rand(HV, generator=gen) * 2 - 1 if a_log else None
    dt_bias = randn(HV * K) * 0.5
    h0 = randn(N, HV, K, K) * 0.1 if init else None
    do = randn(B, T, HV, K).bfloat16()
    dht = randn(N, HV, K, K) * 0.1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    c = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0, do=do, dht=dht, cu=cu_t)
    return {n: (None if x is None else x.to(device)) for n, x in c.items()}


def autograd_grads(c, lower_bound):
    """fp64 gradients of ``sum(o * do) + sum(final_state * dht)`` through `flashkda.reference`."""
    leaves = {n: (None if c[n] is None else c[n].double().requires_grad_())
              for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")}
    o, s = reference.chunk_kda_reference(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], _scale(c), leaves["h0"], True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=lower_bound, cu_seqlens=c["cu"], A_log=leaves["A_log"], dt_bias=leaves["dt_bias"])
    ((o * c["do"].double()).sum() + (s * c["dht"].double()).sum()).backward()
    names = dict(dq="q", dk="k", dv="v", dg="g", dbeta="beta", dA_log="A_log", ddt_bias="dt_bias", dh0="h0")
    return {n: (None if leaves[x] is None else leaves[x].grad) for n, x in names.items()}


def emulated_grads(c, lower_bound, exact, every=4, ck_dtype=torch.bfloat16, chunk=16):
    """`emulate_backward` on the forward emulation's workspace and checkpoints (or ``exact``)."""
    B, T = c["q"].shape[:2]
    layout = (build_chunk_layout if chunk == 16 else build_chunk_layout32)(B, T, c["cu"], c["q"].device)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], _scale(c), layout, lower_bound, c["do"])
    kw = dict(A_log=c["A_log"], dt_bias=c["dt_bias"], initial_state=c["h0"], dht=c["dht"], chunk=chunk)
    if exact:
        grads = emulate_backward(*args, exact=True, **kw)
    else:
        ws = (emulate_prepare if chunk == 16 else emulate_prepare32)(
            c["q"], c["k"], c["g"], c["beta"], _scale(c), layout, lower_bound, c["A_log"], c["dt_bias"])
        _, _, ck = emulate_recurrence_train(ws, c["v"], c["h0"], every, ck_dtype)
        grads = emulate_backward(*args, ws=ws, checkpoints=ck, every=every, **kw)
    return {n: getattr(grads, n) for n in NAMES}


def rel_rms(x, ref):
    """``rms(x - ref) / rms(ref)``."""
    return float((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def errors(c, lower_bound, exact, ref=None, **kw):
    """Relative RMS of the emulation's gradients against fp64 autograd, per tensor."""
    ref = autograd_grads(c, lower_bound) if ref is None else ref
    got = emulated_grads(c, lower_bound, exact, **kw)
    return compare(got, ref)


def squared_errors(got, ref):
    """``(sum((got - ref)^2), sum(ref^2))`` per tensor (dicts by `NAMES`; tensors without a reference left out)."""
    out = {}
    for n in NAMES:
        if ref[n] is None:
            assert got[n] is None, n
            continue
        assert got[n].shape == ref[n].shape, (n, got[n].shape, ref[n].shape)
        assert torch.isfinite(got[n]).all(), n
        out[n] = (float((got[n].double() - ref[n]).pow(2).sum()), float(ref[n].double().pow(2).sum()))
    return out


def compare(got, ref):
    """Relative RMS per tensor of ``got`` against ``ref`` (dicts by `NAMES`)."""
    return {n: (e2 / r2) ** 0.5 for n, (e2, r2) in squared_errors(got, ref).items()}


def _loss_grads(c, call):
    """Gradients of ``sum(o * do) + sum(final_state * dht)`` for ``call(leaves) -> (o, final_state)`` on fresh
    leaves of case ``c``, by `NAMES`."""
    leaves = {n: (None if c[n] is None else c[n].detach().clone().requires_grad_())
              for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")}
    o, s = call(leaves)
    ((o.float() * c["do"].float()).sum() + (s.float() * c["dht"].float()).sum()).backward()
    names = dict(dq="q", dk="k", dv="v", dg="g", dbeta="beta", dA_log="A_log", ddt_bias="dt_bias", dh0="h0")
    return {n: (None if leaves[x] is None else leaves[x].grad) for n, x in names.items()}


def fla_grads(c, lower_bound):
    """fla 0.6.0 ``chunk_kda`` bf16 gradients of the same loss (CUDA only)."""
    from fla.ops.kda import chunk_kda

    return _loss_grads(c, lambda x: chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=_scale(x), initial_state=x["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
        lower_bound=lower_bound, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=c["cu"]))


def v2_grads(c, lower_bound, chunk=16):
    """Our v2 training kernels' gradients of the same loss (``flashkda.bwd.v2.chunk_kda_v2``; Hopper only)."""
    from flashkda.bwd.v2 import chunk_kda_v2

    return _loss_grads(c, lambda x: chunk_kda_v2(
        x["q"], x["k"], x["v"], x["g"], x["beta"], _scale(x), x["h0"], True, lower_bound, c["cu"], x["A_log"],
        x["dt_bias"], chunk_size=chunk))


def worst_ratio(extra: dict) -> dict:
    """The bar's summary of one row's errors: the tensor where ours / fla (both against fp64) is largest, and that
    ratio; empty when either backend's errors are missing."""
    ratios = {n: extra[f"ours c16 {n}"] / extra[f"fla {n}"] for n in NAMES
              if f"ours c16 {n}" in extra and extra.get(f"fla {n}")}
    if not ratios:
        return {}
    worst = max(ratios, key=ratios.get)
    return {"ours / fla worst tensor": worst, "ours / fla worst ratio": ratios[worst]}


def describe(extra: dict) -> str:
    """One log line of a row's numbers (floats in scientific notation, anything else as is)."""
    return ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items())


def _pool(sums: dict, label: str, got: dict, ref: dict) -> None:
    """Add ``got``'s squared errors against ``ref`` and the squared references to ``sums["<label> <tensor>"]``."""
    for n, (e2, r2) in squared_errors(got, ref).items():
        acc = sums.setdefault(f"{label} {n}", [0.0, 0.0])
        acc[0] += e2
        acc[1] += r2


def _timed(seconds: dict, label: str, fn, *args, **kw):
    """``fn(*args, **kw)``, its wall time added to ``seconds[label]``."""
    start = time.perf_counter()
    try:
        return fn(*args, **kw)
    finally:
        seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start


def run(device: str, T: int, write: bool = True, seeds: int = 1, kinds=("fixed", "varlen"),
        lower_bounds=(-5.0, -0.1)) -> list:
    """Rows of per-tensor errors for a fixed and a varlen case (``kinds``) at each of ``lower_bounds``, each pooled
    over ``seeds`` random cases."""
    from benchmarks.harness import Row, machine_info, write_results

    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"seeds must be a positive int, got {seeds!r}")
    unknown = set(kinds) - {"fixed", "varlen"}
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of ('fixed', 'varlen'), got {kinds!r}")
    cases = {f"fixed-T{T}-H4": dict(B=1, T=T, H=4),
             f"varlen-{T}-H4": dict(B=1, T=T, H=4, cu=[0, T // 3, T // 3 + 1, T])}
    cases = {name: kw for name, kw in cases.items() if name.split("-")[0] in kinds}
    info = machine_info() if write else None
    rows = []
    for name, kw in cases.items():
        for lb in lower_bounds:
            sums: dict[str, list[float]] = {}
            seconds: dict[str, float] = {}
            for seed in range(seeds):
                c = make_case(**kw, seed=seed, device=device)
                ref = _timed(seconds, "fp64", autograd_grads, c, lb)
                for chunk in (16, 32):
                    if chunk == 32 and "cu" in kw:
                        continue
                    label = f"emulation c{chunk}"
                    _pool(sums, label, _timed(seconds, label, emulated_grads, c, lb, False, chunk=chunk), ref)
                if device.startswith("cuda"):
                    for label, grads in (("fla", fla_grads), ("ours c16", v2_grads)):
                        try:
                            _pool(sums, label, _timed(seconds, label, grads, c, lb), ref)
                        except Exception as exc:  # a backend missing or failing: the other numbers still stand
                            logger.warning("%s failed on %s seed %d: %s", label, name, seed, exc)
            extra = {k: (e2 / r2) ** 0.5 for k, (e2, r2) in sums.items()}
            extra.update(worst_ratio(extra))
            case = f"{name}-lb{lb}" + (f"-{seeds}seeds" if seeds > 1 else "")
            rows.append(Row(case=case, baseline="fla 0.6.0 chunk_kda bf16 (rel. RMS vs fp64)",
                            baseline_ms=None, ours_ms=None, params=dict(T=T, lower_bound=lb, seeds=seeds),
                            extra=extra, note="gradient errors, not times"))
            logger.info("%s lb %s: %s", name, lb, describe(extra))
            logger.info("  seconds: %s", ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
            if write:  # after every row (the same file each time): a run cut short keeps what it measured
                path = write_results("kda-v2-bwd-precision", rows, title="FlashKDA v2 backward precision",
                                     info=info)
                logger.info("wrote %s", path)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--seeds", type=int, default=8, help="random cases pooled per row")
    parser.add_argument("--kinds", nargs="+", choices=("fixed", "varlen"), default=("fixed", "varlen"))
    parser.add_argument("--lower-bounds", nargs="+", type=float, default=(-5.0, -0.1))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run(args.device, args.T, write=not args.no_write, seeds=args.seeds, kinds=tuple(args.kinds),
        lower_bounds=tuple(args.lower_bounds))


if __name__ == "__main__":
    main()
