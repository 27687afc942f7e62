"""Faults: a peer that dies or stalls mid-dispatch or mid-combine makes every survivor raise `CommError`
within the timeout; contract violations on one rank raise `ValueError` on every rank; bad arguments name
themselves."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from k3infra.testing import RankFailure, run_ranks
from moonep import Buffer, CommError, compute_plan
from moonep.skew import make_routing

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 1.0
S, H, K, P = 6, 4, 2, 2
# Collective the faulty rank breaks: the token rows (after the layout exchange), or combine's partials.
FAULT_POINTS = {
    "dispatch": ("start_all_gather", "dispatch token"),
    "combine": ("start_all_to_all", "combine"),
    "combine-remote": ("start_all_to_all_remote", "combine"),  # combine_path="remote_only"
}


class _Stalled(Exception):
    """Raised on the stalled rank once the survivors are done, so that the test ends without waiting."""


def _await_fault(buffer: Buffer, device: str, until: float) -> bool:
    """After a call that returned: on CUDA (NCCL) the collectives may still be running, so poll the buffer
    (raising `CommError` once the watchdog gave up on a collective) until the stream drains or ``until``.
    Returns whether the device stream drained (kernels stuck in an aborted collective must return)."""
    if not device.startswith("cuda"):
        return True
    done = torch.cuda.Event()
    done.record()
    while time.monotonic() < until:
        buffer.check_comm()
        if done.query():
            buffer.check_comm()
            return True
        time.sleep(0.01)
    return done.query()


def _drained(until: float) -> bool:
    done = torch.cuda.Event()
    done.record()
    while time.monotonic() < until and not done.query():
        time.sleep(0.01)
    return done.query()


def fault_rank(
    rank: int, world: int, fault: str, where: str, flags: str, device: str = "cpu", timeout_s: float = TIMEOUT_S
) -> tuple[str, float, bool]:
    """Rank 1 dies or stalls at ``where``; the others return ``(outcome, seconds to notice, device released)``."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    path = "remote_only" if where == "combine-remote" else "all_to_all"
    buffer = Buffer(
        None, S, H, K, P * world, dtype=torch.float32, timeout_s=timeout_s, device=device, combine_path=path
    )
    idx, w = (t.to(device) for t in make_routing("uniform", S, K, P * world, world, rank=rank))
    x = torch.randn(S, H, device=device)
    out = None
    # Every rank completes one dispatch first: combine needs its handle, and NCCL connects peers lazily during
    # the first collectives (2-3 s on 2xH200), which would otherwise count as the fault's detection time.
    if where != "dispatch" or device != "cpu":
        out = buffer.dispatch(x, idx, w)
        _await_fault(buffer, device, time.monotonic() + 30)
    if rank == 1:
        method, prefix = FAULT_POINTS[where]
        original = getattr(buffer.transport, method)

        def faulty(out_t, inp, what="", *args, **kwargs):
            if not what.startswith(prefix):
                return original(out_t, inp, what, *args, **kwargs)
            if fault == "die":
                os._exit(3)
            # Stall: neither join the collective nor leave, until every survivor has reported (at most 60 s).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(list(Path(flags).iterdir())) < world - 1:
                time.sleep(0.05)
            raise _Stalled

        setattr(buffer.transport, method, faulty)
    start = time.monotonic()
    released = True
    try:
        if where == "dispatch":
            buffer.dispatch(x, idx, w)
        else:
            buffer.combine(out.x_CH, out.handle)
        # NCCL: the call returns before its collectives finish; the fault shows once the watchdog gives up.
        released = _await_fault(buffer, device, start + timeout_s + 10)
        outcome = "no error"
    except CommError:
        outcome = "CommError"
    except _Stalled:
        return "stalled", time.monotonic() - start, True
    elapsed = time.monotonic() - start
    Path(flags, f"rank{rank}").touch()
    if outcome == "CommError" and device.startswith("cuda"):
        # The watchdog aborted the group: kernels stuck in the collective must return, so that host threads
        # blocked on the device (a synchronize, a .cpu()) are released.
        released = _drained(time.monotonic() + 10)
    return outcome, elapsed, released


def check_survivors(results: list, fault: str, timeout_s: float) -> None:
    """Every rank but the faulty rank 1 raised `CommError` within the timeout (+3 s) and was released."""
    for rank in [r for r in range(len(results)) if r != 1]:
        assert not isinstance(results[rank], RankFailure), results[rank]
        outcome, elapsed, released = results[rank]
        assert outcome == "CommError", f"rank {rank}: {outcome}"
        assert elapsed < timeout_s + 3.0, f"rank {rank} took {elapsed:.1f} s to notice"
        assert released, f"rank {rank}: the device stream did not drain after the abort"
    if fault == "stall":
        # The stalled rank is released as soon as every survivor raised: the test never waits out a sleep
        # (its wall time is the processes' start-up plus about one timeout).
        assert not isinstance(results[1], RankFailure), results[1]
        outcome, stalled_for, _ = results[1]
        assert outcome == "stalled" and stalled_for < timeout_s + 5.0, results[1]


@pytest.mark.parametrize("where", ["dispatch", "combine"])
@pytest.mark.parametrize("fault", ["die", "stall"])
def test_peer_fault_raises_comm_error_on_every_survivor(fault: str, where: str, tmp_path: Path) -> None:
    results = run_ranks(fault_rank, 3, fault, where, str(tmp_path), timeout_s=60, pg_timeout_s=30, allow_failures=True)
    check_survivors(results, fault, TIMEOUT_S)


def test_peer_death_in_remote_only_combine_raises_comm_error(tmp_path: Path) -> None:
    # The remote-only combine's exchange (this rank's split 0) fails like the all-to-all it replaces.
    results = run_ranks(
        fault_rank, 3, "die", "combine-remote", str(tmp_path), timeout_s=60, pg_timeout_s=30, allow_failures=True
    )
    check_survivors(results, "die", TIMEOUT_S)


def _expect_value_error(fn, match: str) -> None:
    try:
        fn()
    except ValueError as error:
        assert match in str(error), f"{match!r} not in {error}"
        return
    raise AssertionError(f"no ValueError ({match})")


def _contract_violations(rank: int, world: int) -> list[str]:
    E = P * world
    seen = []
    buffer = Buffer(None, S, H, K, E, dtype=torch.float32, timeout_s=10)
    idx, w = make_routing("uniform", S, K, E, world, rank=rank)
    x = torch.randn(S, H)
    bad_idx = idx.clone()
    if rank == 0:
        bad_idx[0, 0] = E  # out of range on one rank only
    _expect_value_error(lambda: buffer.dispatch(x, bad_idx, w), "rank 0 passed expert ids outside")
    seen.append("ids")
    too_many = torch.randn(S + 1, H) if rank == 1 else x
    idx_many = torch.zeros(S + 1, K, dtype=torch.long) if rank == 1 else idx
    w_many = torch.ones(S + 1, K) if rank == 1 else w
    _expect_value_error(lambda: buffer.dispatch(too_many, idx_many, w_many), "rank 1 passed more tokens")
    seen.append("capacity")
    x_dtype = x.double() if rank == 1 else x
    _expect_value_error(lambda: buffer.dispatch(x_dtype, idx, w), "rank 1 passed tensors of the wrong dtype")
    seen.append("dtype")
    x_shape = torch.randn(S, H + 1) if rank == 0 else x
    _expect_value_error(lambda: buffer.dispatch(x_shape, idx, w), "rank 0 passed x/topk_idx/topk_weights with wrong")
    seen.append("shape")
    out = buffer.dispatch(x, idx, w)  # the buffer still works after rejected calls
    _expect_value_error(lambda: buffer.combine(out.x_CH[:-1], out.handle, out.weights_C), "y_CH must be")
    _expect_value_error(lambda: buffer.combine(out.x_CH, out.handle, out.weights_C[:-1]), "weights_C must be")
    _expect_value_error(lambda: buffer.prefetch_weight(out.handle.plan, torch.zeros(P + 1, 3)), "weight_P must")
    _expect_value_error(lambda: buffer.reduce_grad(out.handle.plan, torch.zeros(1, 3)), "grad_L must")
    _expect_value_error(
        lambda: buffer.prefetch_weight(out.handle.plan, torch.zeros(P, 3), out=torch.zeros(1, 4)), "out must"
    )
    try:
        buffer.combine(out.x_CH, out.handle.plan)
        raise AssertionError("combine accepted a Plan as its handle")
    except TypeError as error:
        assert "handle must be the DispatchHandle" in str(error)
    small = Buffer(None, S, H, K, E, dtype=torch.float32, num_redundant_slots=0)
    hot, hot_w = make_routing("one_expert", S, K, E, world, rank=rank)
    plan = small.dispatch(x, hot, hot_w).handle.plan
    _expect_value_error(lambda: small.prefetch_weight(plan, torch.zeros(P, 3)), "num_redundant_slots=0")
    seen.append("combine/prefetch/reduce_grad arguments")
    planned = buffer.plan(idx, w)
    other_w = w.clone() if rank == 0 else w  # equal values, but not the tensor the plan was made from
    _expect_value_error(lambda: buffer.dispatch(x, idx, other_w, plan=planned), "rank 0 passed topk_idx/topk_weights")
    x_wide = torch.randn(S, H + 1) if rank == 1 else x
    _expect_value_error(lambda: buffer.dispatch(x_wide, idx, w, plan=planned), "rank 1 passed x/topk_idx")
    try:
        buffer.dispatch(x, idx, w, plan=planned.plan)
        raise AssertionError("dispatch accepted a Plan as its PlannedDispatch")
    except TypeError as error:
        assert "plan must be the PlannedDispatch" in str(error)
    assert torch.equal(buffer.dispatch(x, idx, w, plan=planned).x_CH, out.x_CH)  # still works after rejections
    seen.append("dispatch(plan=...) arguments")
    _expect_value_error(lambda: Buffer(None, S, H + rank, K, E), "ranks disagree on Buffer sizes")
    paths = ("all_to_all", "remote_only")
    _expect_value_error(lambda: Buffer(None, S, H, K, E, combine_path=paths[rank % 2]), "combine_path) per rank")
    seen.append("disagreeing sizes")
    for kwargs, name in (
        ({"hidden": 0}, "hidden"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens_per_rank": -2}, "max_tokens_per_rank"),
        ({"num_experts": E + 1}, "num_experts"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"num_redundant_slots": E}, "num_redundant_slots"),
        ({"transport": "bogus"}, "transport"),
        ({"num_chunks": 0}, "num_chunks"),
        ({"planner": "triton"}, "planner must be one of"),
        ({"ranks_per_node": 2}, "ranks_per_node"),
        ({"transport": "nvlink"}, "transport='nvlink' needs CUDA"),
        ({"combine_path": "p2p"}, "combine_path must be one of"),
        ({"combine_path": "remote_only", "transport": "hierarchical", "ranks_per_node": 1}, "needs transport='torch'"),
    ):
        args = {"max_tokens_per_rank": S, "hidden": H, "top_k": K, "num_experts": E, **kwargs}
        _expect_value_error(lambda a=args: Buffer(None, **a), name)
    seen.append("constructor arguments")
    buffer.destroy()
    try:
        buffer.dispatch(x, idx, w)
    except RuntimeError as error:
        assert "destroyed" in str(error)
        seen.append("destroyed")
    return seen


def test_contract_violations_raise_value_error_on_every_rank() -> None:
    results = run_ranks(_contract_violations, 2, timeout_s=120)
    assert results[0] == results[1] and len(results[0]) == 9


@pytest.mark.parametrize(
    ("counts", "match"),
    [
        (torch.zeros(4, dtype=torch.long), "must be [R, E]"),
        (torch.zeros(3, 4, dtype=torch.long), "multiple of its ranks"),
    ],
    ids=["1d", "E-not-multiple-of-R"],
)
def test_compute_plan_rejects_bad_counts(counts: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("]", r"\]")):
        compute_plan(counts)
