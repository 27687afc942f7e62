"""Collectives over torch.distributed (gloo on the CPU, NCCL on GPUs) with faults mapped to `CommError`.

On gloo every collective is issued with ``async_op=True`` and waited with the buffer's timeout, so a peer
that died (connection closed) or stalled (timeout) surfaces as `CommError` on every surviving rank. On
NCCL the wait is a stream dependency (no host blocking); a `moonep.transports.watchdog.Watchdog` thread
times every issued collective instead and, past the timeout, aborts the process group (the stuck kernels
return, host threads blocked on the device are released) and marks the transport broken: the buffer's
next call, or the current one at its next host synchronisation, raises `CommError`. The process group's
own timeout should be longer than the buffer's, or its watchdog ends the process first.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from moonep.errors import CommError
from moonep.transports.watchdog import Watchdog

logger = logging.getLogger(__name__)


class TorchDistTransport:
    """Equal-split all-gather and all-to-all on one process group.

    Args:
        group: the process group (None: the default group).
        timeout_s: seconds a collective may take before `CommError` (gloo: host wait; NCCL: `Watchdog`).
    """

    chunked_combine = True
    """Combine may send its partials in token chunks through `start_all_to_all` (else: `sum_partials`)."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.broken: str | None = None
        self.watchdog = Watchdog(timeout_s, self._expire, cuda=True) if self.backend == "nccl" else None

    def _expire(self, message: str) -> None:
        """The watchdog's verdict (on its thread): mark the transport broken, then abort the group so that
        kernels stuck in the collective return."""
        self.broken = f"{message} on rank {self.rank}"
        group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        try:
            group.abort()
        except Exception as error:  # noqa: BLE001 - builds without ProcessGroup.abort: try the backend's
            logger.warning("ProcessGroup.abort failed (%s); aborting the NCCL backend", error)
            try:
                group._get_backend(torch.device("cuda")).abort()
            except Exception as inner:  # noqa: BLE001 - nothing left to try; the broken flag still raises
                logger.error("could not abort the NCCL communicator: %s", inner)

    def _wait(self, work: dist.Work | None, what: str) -> None:
        self.check()  # the watchdog may have aborted the group since the collective was issued
        if work is None:
            return
        try:
            if self.backend == "gloo":
                work.wait(self.timeout)
            else:
                work.wait()
        except RuntimeError as error:
            self.broken = f"{what} failed on rank {self.rank}: {error}"
            raise CommError(
                f"{what} did not complete on rank {self.rank} within {self.timeout.total_seconds():.0f} s "
                f"(a peer died or stalled): {error}. Destroy this Buffer and rebuild the process group."
            ) from error

    def close(self) -> None:
        """Release transport resources (the process group itself belongs to the caller)."""
        self.broken = self.broken or "closed"
        if self.watchdog is not None:
            self.watchdog.close()

    def check(self) -> None:
        """Raise `CommError` if a collective failed or timed out (no host synchronisation)."""
        if self.broken is not None:
            raise CommError(
                f"this buffer's transport is broken ({self.broken}); destroy the Buffer, rebuild the process group "
                "and build a new Buffer"
            )

    def _start(self, issue: Callable[[], dist.Work | None], out: torch.Tensor, what: str) -> Callable[[], torch.Tensor]:
        """Issue a collective now; the returned function waits for it (raising `CommError`) and returns ``out``."""
        try:
            work = issue()
        except RuntimeError as error:
            work = _Failed(error)
        else:
            if self.watchdog is not None and work is not None and not torch.cuda.is_current_stream_capturing():
                self.watchdog.watch(work, f"{what} (rank {self.rank})")

        def finish() -> torch.Tensor:
            self._wait(work, what)
            return out

        return finish

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_gather") -> torch.Tensor:
        """``out`` (``[R * n, ...]``) receives every rank's ``inp`` (``[n, ...]``) in rank order."""
        return self.start_all_gather(out, inp, what)()

    def start_all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_gather"
    ) -> Callable[[], torch.Tensor]:
        """Issue `all_gather` now; the returned function waits for it (raising `CommError`) and returns ``out``.

        Work issued between the two overlaps the transfer (on NCCL the wait is only a stream dependency).
        """
        self.check()
        if self.world_size == 1:
            out.copy_(inp)
            return lambda: out
        inp = inp.contiguous()
        # torch >= 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._start(lambda: gather(out, inp, group=self.group, async_op=True), out, what)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_to_all") -> torch.Tensor:
        """Equal splits: chunk ``i`` of ``inp`` (dim 0) goes to rank ``i``; ``out``'s chunk ``j`` comes from ``j``."""
        return self.start_all_to_all(out, inp, what)()

    def start_all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_to_all"
    ) -> Callable[[], torch.Tensor]:
        """Issue `all_to_all` now; the returned function waits for it (raising `CommError`) and returns ``out``."""
        self.check()
        if self.world_size == 1:
            out.copy_(inp)
            return lambda: out
        inp = inp.contiguous()
        return self._start(lambda: dist.all_to_all_single(out, inp, group=self.group, async_op=True), out, what)

    def start_all_to_all_remote(
        self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_to_all"
    ) -> Callable[[], torch.Tensor]:
        """`start_all_to_all` without this rank's own block: nothing is copied to or from itself.

        ``inp`` is ``[(R-1) * n, ...]``: block ``j`` goes to the ``j``-th other rank (rank order, this rank
        skipped); ``out``'s block ``j`` comes from it. One ``all_to_all_single`` with this rank's split 0
        (on NCCL a send and a receive per peer; with two ranks one send/receive pair). The split sizes are
        Python ints fixed by the shapes: no host synchronisation.
        """
        self.check()
        R = self.world_size
        if R == 1:
            return lambda: out
        n = inp.shape[0] // (R - 1)
        splits = [0 if r == self.rank else n for r in range(R)]
        inp = inp.contiguous()
        return self._start(
            lambda: dist.all_to_all_single(
                out, inp, output_split_sizes=splits, input_split_sizes=splits, group=self.group, async_op=True
            ),
            out,
            what,
        )

    def sum_partials(self, partial_TH: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Send each source rank its rows of ``partial_TH`` (``[R*S, H]``, rows ``src*S + t``) and sum what
        comes back over ranks in fp32: returns ``[num_tokens, H]`` fp32 for this rank's tokens."""
        R = self.world_size
        back_TH = self.all_to_all(torch.empty_like(partial_TH), partial_TH, "combine all_to_all")
        # Summing with an fp32 accumulator avoids materialising an fp32 copy of the R partials.
        return torch.sum(back_TH.view(R, -1, partial_TH.shape[1])[:, :num_tokens], dim=0, dtype=torch.float32)


class _Failed:
    """A work whose issue already failed: waiting re-raises the error."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def wait(self, *_: object) -> None:
        raise self.error
