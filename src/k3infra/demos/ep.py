"""MoonEP demo: 4 local ranks (gloo, CPU) dispatch a skewed batch, balanced by redundant experts.

Checks, per skew: every rank computes exactly s*K slots (load max/mean 1.00 against the home placement's),
the slots hold the right tokens (identity experts: combine returns ``x * sum(w)`` exactly in fp32), and
the device planner equals the loop reference.
"""

from __future__ import annotations

from k3infra.demos import DemoRow

WORLD, S, H, K, E = 4, 64, 16, 8, 64
SKEWS = ("uniform", "lognormal2", "hot_rank", "one_expert")


def _rank(rank: int, world: int) -> list[tuple[str, float, float, int, bool]]:
    import torch

    from moonep import Buffer
    from moonep.reference import reference_plan
    from moonep.skew import make_routing

    out = []
    buffer = Buffer(None, S, H, K, E, dtype=torch.float32)
    for skew in SKEWS:
        idx, w = make_routing(skew, S, K, E, world, rank=rank, seed=4)
        x = torch.randn(S, H, generator=torch.Generator().manual_seed(rank))
        dispatched = buffer.dispatch(x, idx, w)
        y, _ = buffer.combine(dispatched.x_CH, dispatched.handle)
        plan = dispatched.handle.plan
        ref = reference_plan(plan.counts_RE)
        same_plan = all(torch.equal(getattr(plan, k), v) for k, v in ref.items())
        exact = torch.allclose(y, x * w.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
        stats = plan.stats()
        out.append(
            (
                skew,
                stats["max_over_mean"],
                stats["unbalanced_max_over_mean"],
                int(stats["max_redundant"]),
                same_plan and exact and plan.load_R.tolist() == [S * K] * world,
            )
        )
    buffer.destroy()
    return out


def run(device: str) -> list[DemoRow]:
    """Runs on the CPU whatever ``device`` is (the demo shows the algorithm; `k3infra bench ep` the speed)."""
    from k3infra.testing import run_ranks

    results = run_ranks(_rank, WORLD, timeout_s=180)
    rows = []
    for i, skew in enumerate(SKEWS):
        _, bal, unbal, redundant, ok = results[0][i]
        ok = ok and all(r[i][4] for r in results)
        rows.append(
            DemoRow(
                "ep",
                f"EP={WORLD} s={S} K={K} E={E} {skew}: dispatch+combine exact, plan = reference",
                f"load max/mean {bal:.2f} (home-only {unbal:.2f}), {redundant} redundant experts/rank max",
                ok,
            )
        )
    return rows
