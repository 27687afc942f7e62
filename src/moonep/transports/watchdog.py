"""A host thread that turns a stalled NCCL collective into `moonep.CommError` within the buffer's timeout.

On NCCL, waiting for a collective is a stream dependency: the host issues work and returns, so a peer
that died or stalls leaves the survivors' kernels spinning until the process group's own timeout, when
``ProcessGroupNCCL``'s watchdog takes the whole process down. `Watchdog` instead keeps the issued
collectives of one transport in order and polls their completion (``Work.is_completed()``, a CUDA event
query: no synchronisation of the issuing thread). A collective's clock starts when the one before it on the
same group completed (collectives of one communicator run in issue order), or when it was issued, if later;
once it has run ``timeout_s`` without completing, the watchdog calls ``on_expire`` (the transport marks
itself broken and aborts the process group, so the stuck kernels return and host threads blocked on the
device are released) and every later call of the buffer raises `CommError`.

Not covered: collectives captured in a CUDA graph (a replay issues no work objects to watch). The thread
queries CUDA events while the caller may be capturing a graph on another thread; like ProcessGroupNCCL's
own watchdog it switches itself to thread-local capture mode first, or a query during a global-mode
capture would invalidate that capture.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)


class Watchdog:
    """Deadlines for the collectives of one process group, checked on a daemon thread.

    Args:
        timeout_s: seconds a collective may take before ``on_expire``, counted from its issue or from when
            the collective before it on the group completed, whichever is later (device work queued ahead
            of it on the stream counts too: keep the timeout well above a step's length).
        on_expire: called once, on the watchdog thread, with a message naming the collective.
        poll_s: seconds between completion polls while collectives are pending.
        cuda: the works are CUDA collectives (NCCL): the thread sets its CUDA stream-capture mode to
            thread-local before its first event query.
    """

    def __init__(
        self, timeout_s: float, on_expire: Callable[[str], None], poll_s: float = 0.005, cuda: bool = False
    ) -> None:
        if timeout_s <= 0 or poll_s <= 0:
            raise ValueError(f"timeout_s and poll_s must be > 0, got {timeout_s}, {poll_s}")
        self.timeout_s, self.poll_s, self.on_expire, self.cuda = timeout_s, poll_s, on_expire, cuda
        self._pending: collections.deque[tuple[dist.Work, str, float]] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.expired: str | None = None
        """The message ``on_expire`` was called with, once a deadline passed."""
        self.failure: str | None = None
        """Why the thread itself stopped, if an internal error ended it (collectives are then untimed)."""

    def watch(self, work: dist.Work, what: str) -> None:
        """Track ``work`` (issued just now, after every work watched before it). Cheap: no CUDA call."""
        with self._wake:
            if self._closed or self.expired is not None:
                return
            self._pending.append((work, what, time.monotonic()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="moonep-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()

    def pending(self) -> int:
        """Collectives issued and not yet seen complete."""
        return len(self._pending)

    def close(self) -> None:
        """Stop the thread (pending collectives are no longer timed). Idempotent."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # never die silently: callers would queue works forever
            logger.exception("moonep watchdog: stopped by an internal error; collectives are no longer timed")
            with self._wake:
                self._pending.clear()
                self._closed = True
            self.failure = f"watchdog thread stopped: {type(error).__name__}: {error}"

    def _loop(self) -> None:
        if self.cuda:
            _thread_local_capture_mode()
        ready_at: float | None = None  # when the previous collective was seen complete
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                work, what, issued = self._pending[0]
            now = time.monotonic()
            started = issued if ready_at is None else max(issued, ready_at)
            failure = None
            try:
                done = work.is_completed()
                # A collective NCCL itself found failed (a peer's connection broke) also counts as completed.
                error = _work_error(work) if done else None
            except RuntimeError as raised:
                if "captur" in str(raised):  # refused while a graph is being captured: ask again later
                    time.sleep(self.poll_s)
                    continue
                done, error = True, raised
            if error is not None:
                failure = f"{what} failed: {error}"
            elif done:
                with self._wake:
                    self._pending.popleft()
                ready_at = now  # the next collective could start no earlier than now
                continue
            elif now - started >= self.timeout_s:
                failure = f"{what} did not complete within {self.timeout_s:.3g} s of its turn"
                failure += " (a peer died or stalled)"
            if failure is None:
                time.sleep(self.poll_s)
                continue
            self.expired = failure
            logger.error("moonep watchdog: %s; aborting the process group", failure)
            with self._wake:
                self._pending.clear()
                self._closed = True
            self.on_expire(failure)
            return


def _work_error(work: dist.Work) -> BaseException | None:
    """The error a completed collective ended with, or None. ``Work.exception()`` is deprecated and, in some
    torch builds (2.11 with NCCL), its result cannot be converted to Python at all (TypeError): then a failed
    collective is left to the deadline and to ProcessGroupNCCL's own error handling."""
    try:
        return work.exception()
    except TypeError:
        return None


CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


def _thread_local_capture_mode() -> None:
    """Set the calling thread's CUDA stream-capture mode to thread-local (driver API, as ProcessGroupNCCL's
    watchdog does with ``CUDAStreamCaptureModeGuard``): its event queries are then allowed, and harmless,
    while another thread captures a graph in global mode. Logs and goes on where the driver is not found."""
    try:
        mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        status = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    except (OSError, AttributeError) as error:
        logger.warning("moonep watchdog: could not set thread-local CUDA capture mode (%s)", error)
        return
    if status != 0:
        logger.warning("moonep watchdog: cuThreadExchangeStreamCaptureMode returned %d", status)
