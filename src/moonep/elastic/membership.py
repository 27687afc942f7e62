"""Store-backed membership: heartbeats, generations and the agreement on who is in the next one.

All state lives in a `torch.distributed.TCPStore` that outlives every worker (hosted by the launcher, as
torchrun's c10d rendezvous does). Keys:
    ``hb/<member>``             heartbeat counter, bumped every ``heartbeat_s`` by a daemon thread
    ``gen/<g>/members``         the members of generation ``g``, comma-separated, in group-rank order
    ``gen/<g>/ready/<member>``  set when the member is about to form generation ``g`` (`gather`)
    ``joiners/n``, ``joiners/<i>``   members asking to join, in arrival order; ``joiners/admitted`` how many were
    ``admit/<member>``          the generation a joiner was admitted to
A generation's member list is written once with ``compare_set``: the first proposal wins and every member
reads the same list, so survivors agree without a leader.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the launcher's store."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class Membership:
    """One worker's view of the elastic group.

    Args:
        host, port: the launcher's `TCPStore`.
        member_id: a stable name of this worker (no commas), unique over the job's life.
        heartbeat_s: seconds between heartbeats.
        timeout_s: store operations' timeout.
    """

    def __init__(self, host: str, port: int, member_id: str, *, heartbeat_s: float = 0.2, timeout_s: float = 30.0):
        if not member_id or "," in member_id:
            raise ValueError(f"member_id must be a non-empty name without commas, got {member_id!r}")
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.member_id, self.heartbeat_s = member_id, heartbeat_s
        self.store = connect(host, port, timeout_s)
        self._beat_store = connect(host, port, timeout_s)
        self._stop = threading.Event()
        self._beat_store.add(f"hb/{member_id}", 1)
        self._thread = threading.Thread(target=self._beat, name=f"moonep-heartbeat-{member_id}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat_store.add(f"hb/{self.member_id}", 1)
            except Exception as error:  # noqa: BLE001 - the store went away: the job is over
                logger.warning("heartbeat of %s stopped: %s", self.member_id, error)
                return

    def close(self) -> None:
        """Stop heartbeating (peers then treat this member as gone)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.heartbeat_s + 1)

    def members(self, generation: int) -> list[str]:
        """The agreed members of ``generation`` (blocks until it is agreed or the store times out)."""
        return self.store.get(f"gen/{generation}/members").decode().split(",")

    def propose(self, generation: int, members: list[str]) -> list[str]:
        """Propose ``members`` for ``generation``; returns the agreed list (the first proposal written)."""
        agreed = self.store.compare_set(f"gen/{generation}/members", "", ",".join(members)).decode()
        return agreed.split(",")

    def alive(self, candidates: list[str], stale_s: float) -> list[str]:
        """Those of ``candidates`` whose heartbeat advanced during the next ``stale_s`` seconds (order kept)."""
        before = {m: self.store.add(f"hb/{m}", 0) for m in candidates}
        time.sleep(stale_s)
        return [m for m in candidates if m == self.member_id or self.store.add(f"hb/{m}", 0) > before[m]]

    def gather(self, generation: int, members: list[str], stale_s: float, timeout_s: float) -> list[str]:
        """Say this member is ready to form ``generation`` and wait until all ``members`` are.

        Returns:
            ``[]`` when every member arrived; else the members that did not arrive and whose heartbeat stood
            still for ``stale_s`` (they died after the agreement): the generation cannot form.

        Raises:
            TimeoutError: members with a live heartbeat did not arrive within ``timeout_s``.
        """
        self.store.set(f"gen/{generation}/ready/{self.member_id}", "1")
        start = time.monotonic()
        waiting = {m: (self.store.add(f"hb/{m}", 0), start) for m in members if m != self.member_id}
        while waiting:
            now = time.monotonic()
            for member, (count, since) in list(waiting.items()):
                if self.store.check([f"gen/{generation}/ready/{member}"]):
                    del waiting[member]
                elif (beat := self.store.add(f"hb/{member}", 0)) != count:
                    waiting[member] = (beat, now)
                elif now - since > stale_s:
                    dead = [m for m, (c, t) in waiting.items() if now - t > stale_s]
                    logger.warning("generation %d: %s died before it formed", generation, dead)
                    return dead
            if waiting and now - start > timeout_s:
                raise TimeoutError(f"generation {generation}: {sorted(waiting)} alive, not ready after {timeout_s} s")
            time.sleep(0.05)
        return []

    # -- joining -----------------------------------------------------------------------------------------

    def ask_to_join(self) -> None:
        """Register as a joiner; the group admits it at its next rebalance boundary."""
        index = self.store.add("joiners/n", 1) - 1
        self.store.set(f"joiners/{index}", self.member_id)

    def pending_joiners(self) -> list[str]:
        """Joiners registered but not admitted yet, in arrival order."""
        total, admitted = self.store.add("joiners/n", 0), self.store.add("joiners/admitted", 0)
        return [self.store.get(f"joiners/{i}").decode() for i in range(admitted, total)]

    def admit(self, joiners: list[str], generation: int) -> None:
        """Tell ``joiners`` they are members of ``generation``."""
        self.store.add("joiners/admitted", len(joiners))
        for member in joiners:
            self.store.set(f"admit/{member}", str(generation))

    def wait_admitted(self, timeout_s: float) -> int:
        """Block until this joiner is admitted; returns the generation."""
        key = f"admit/{self.member_id}"
        self.store.wait([key], datetime.timedelta(seconds=timeout_s))
        return int(self.store.get(key))
