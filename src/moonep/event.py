"""`EventOverlap`: what an `async_finish=True` call returns, usable as a context manager.

Work issued inside ``with event:`` overlaps the communication; on exit the current stream waits for it.
On the CPU (gloo) collectives complete before the call returns, so the event is already done.
"""

from __future__ import annotations

from typing import Any

import torch


class EventOverlap:
    """A CUDA event recorded on the communication stream, or nothing on the CPU.

    Args:
        event: the `torch.cuda.Event` to wait on, or None when the work already finished.
        extra_tensors: tensors kept alive until the event is waited on (their memory belongs to the
            communication stream until then).

    Examples::

        x_slots, w_slots, counts, handle, event = buffer.dispatch(x, idx, w, async_finish=True)
        with event:
            shared = shared_expert(x)   # runs while the dispatch moves tokens
        # here the current stream has waited for the dispatch
    """

    def __init__(self, event: Any | None = None, extra_tensors: tuple[torch.Tensor, ...] = ()) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (no host synchronisation)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        self.extra_tensors = ()

    def synchronize(self) -> None:
        """Block the host until the event completed."""
        if self.event is not None:
            self.event.synchronize()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait()
