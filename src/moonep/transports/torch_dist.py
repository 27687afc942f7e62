"""Collectives over torch.distributed (gloo on the CPU, NCCL on GPUs) with faults mapped to `CommError`.

On gloo every collective is issued with ``async_op=True`` and waited with the buffer's timeout, so a peer
that died (connection closed) or stalled (timeout) surfaces as `CommError` on every surviving rank. On
NCCL the wait is a stream dependency (no host blocking); stalls are then caught by the process group's
own timeout and NCCL's watchdog, which the group was built with.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from moonep.errors import CommError

logger = logging.getLogger(__name__)


class TorchDistTransport:
    """Equal-split all-gather and all-to-all on one process group.

    Args:
        group: the process group (None: the default group).
        timeout_s: seconds a collective may take on gloo before `CommError`.
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

    def _wait(self, work: dist.Work | None, what: str) -> None:
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

    def _check(self) -> None:
        if self.broken is not None:
            raise CommError(f"this buffer's transport is broken ({self.broken}); destroy it and build a new one")

    def _start(
        self, issue: Callable[[], dist.Work | None], out: torch.Tensor, what: str
    ) -> Callable[[], torch.Tensor]:
        """Issue a collective now; the returned function waits for it (raising `CommError`) and returns ``out``."""
        try:
            work = issue()
        except RuntimeError as error:
            work = _Failed(error)

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
        self._check()
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
        self._check()
        if self.world_size == 1:
            out.copy_(inp)
            return lambda: out
        inp = inp.contiguous()
        return self._start(lambda: dist.all_to_all_single(out, inp, group=self.group, async_op=True), out, what)

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
