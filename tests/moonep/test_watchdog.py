"""The NCCL transport's watchdog, driven by real gloo collectives (CPU): a stalled or dead peer fires it within
its timeout; collectives that each finish in time do not, even when together they take longer (a
collective's clock starts when the one before it completed)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from k3infra.testing import run_ranks
from moonep.transports.watchdog import Watchdog

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 1.5
STEP_S = 0.9  # each chained collective completes this long after the previous one (< TIMEOUT_S < 2 * STEP_S)


def _wait_for(path: Path, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.02)


def _watch(rank: int, world: int, scenario: str, flags: str) -> tuple[str | None, float, int]:
    """Rank 0 watches its collectives; rank 1 stalls, dies or joins each one ``STEP_S`` late.

    Returns (rank 0): the watchdog's message (None if it never fired), seconds from the first issue to the
    firing (or to the end), and collectives still pending.
    """
    x = torch.full((4,), float(rank))
    if rank == 1:
        if scenario == "die":
            time.sleep(0.2)
            os._exit(3)
        if scenario == "stall":  # join only once rank 0's watchdog gave up, so the processes end cleanly
            _wait_for(Path(flags, "fired"))
            dist.all_gather_into_tensor(torch.empty(8), x)
            return None, 0.0, 0
        for _ in range(2):
            time.sleep(STEP_S)
            dist.all_gather_into_tensor(torch.empty(8), x)
        return None, 0.0, 0
    fired = threading.Event()
    seen: list[float] = []

    def on_expire(message: str) -> None:
        seen.append(time.monotonic())
        Path(flags, "fired").touch()
        fired.set()

    watchdog = Watchdog(TIMEOUT_S, on_expire, poll_s=0.005)
    start = time.monotonic()
    works = [
        dist.all_gather_into_tensor(torch.empty(8), x, async_op=True) for _ in range(1 if scenario != "chain" else 2)
    ]
    for work in works:
        watchdog.watch(work, "test all_gather")
    if scenario == "chain":
        for work in works:
            work.wait()
        deadline = time.monotonic() + 2.0
        while watchdog.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        fired.wait(TIMEOUT_S + 10)
    watchdog.close()
    end = seen[0] if seen else time.monotonic()
    if scenario == "stall":
        works[0].wait()  # rank 1 joined after the firing
    return watchdog.expired, end - start, watchdog.pending()


@pytest.mark.parametrize("scenario", ["stall", "die"])
def test_watchdog_fires_within_timeout_when_a_peer_stalls_or_dies(scenario: str, tmp_path: Path) -> None:
    results = run_ranks(_watch, 2, scenario, str(tmp_path), timeout_s=60, pg_timeout_s=30, allow_failures=True)
    message, elapsed, _ = results[0]
    assert message is not None and "test all_gather" in message, results[0]
    # A dead peer may be reported by the backend at once ("failed"), a stalled one only by the deadline.
    low = TIMEOUT_S - 0.05 if scenario == "stall" else 0.0
    assert low <= elapsed < TIMEOUT_S + 3.0, f"fired after {elapsed:.2f} s"


def test_watchdog_times_each_collective_from_when_the_previous_one_completed(tmp_path: Path) -> None:
    results = run_ranks(_watch, 2, "chain", str(tmp_path), timeout_s=60, pg_timeout_s=30)
    message, elapsed, pending = results[0]
    assert elapsed > TIMEOUT_S, f"the chain took only {elapsed:.2f} s: the test does not test the clock"
    assert message is None, message
    assert pending == 0


class _CompletedWork:
    """A completed collective whose ``exception()`` behaves as torch 2.11's NCCL Work did on the H200
    (torch 2.11): the pybind result cannot be converted, so the call raises TypeError."""

    def is_completed(self) -> bool:
        return True

    def exception(self):
        raise TypeError("Unable to convert function return value to a Python type!")


class _BrokenWork:
    def is_completed(self) -> bool:
        raise ValueError("internal failure")


def _until(predicate, limit_s: float = 5.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.005)
    return predicate()


def test_watchdog_survives_an_unconvertible_work_exception() -> None:
    watchdog = Watchdog(1.0, lambda message: None, poll_s=0.001)
    for _ in range(3):
        watchdog.watch(_CompletedWork(), "all_gather")
    assert _until(lambda: watchdog.pending() == 0), "completed works must be retired"
    assert watchdog.expired is None and watchdog.failure is None
    watchdog.close()


def test_watchdog_that_stops_on_an_internal_error_stops_queueing() -> None:
    watchdog = Watchdog(1.0, lambda message: None, poll_s=0.001)
    watchdog.watch(_BrokenWork(), "all_gather")
    assert _until(lambda: watchdog.failure is not None), "the thread must record why it stopped"
    assert "ValueError" in watchdog.failure
    watchdog.watch(_CompletedWork(), "all_gather")  # no thread left to retire it: must not be kept
    assert watchdog.pending() == 0
    watchdog.close()
