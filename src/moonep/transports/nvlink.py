"""Intra-node NVLink path: ranks copy straight into their peers' buffers (torch symmetric memory).

Each rank allocates one symmetric buffer of ``nbytes``; `torch.distributed._symmetric_memory.rendezvous`
maps every peer's buffer into this process, so a copy into ``peer_view[r]`` is a store over NVLink (P2P,
no NCCL, and no NVLink multicast: nothing here touches multicast objects or multimem instructions).
A collective is: barrier (peers finished reading the previous contents) → copy my chunk into each peer
→ barrier (every chunk landed) → read my own buffer. Barriers are device-side signals, stream ordered,
with ``timeout_s`` as their device timeout. Payloads larger than the buffer, and the small metadata
exchanges, go through the wrapped `TorchDistTransport`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from moonep.transports.torch_dist import TorchDistTransport

logger = logging.getLogger(__name__)


class NVLinkTransport(TorchDistTransport):
    """`TorchDistTransport` whose large all-gathers and all-to-alls are P2P copies into symmetric memory.

    Args:
        group: process group whose ranks share one node (all GPUs P2P-reachable).
        timeout_s: collective timeout in seconds (also the device barrier's timeout).
        nbytes: symmetric buffer size per rank; payloads up to this size take the NVLink path.
        device: this rank's CUDA device.
    """

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float, nbytes: int, device: torch.device) -> None:
        super().__init__(group, timeout_s)
        import torch.distributed._symmetric_memory as symm_mem

        self.nbytes = nbytes
        self.buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buf, group or dist.group.WORLD)
        self.peer_bufs = [self.handle.get_buffer(r, (nbytes,), torch.uint8, 0) for r in range(self.world_size)]
        self.timeout_ms = int(timeout_s * 1000)
        self.min_bytes = 1 << 20  # below this, NCCL's latency is as good and metadata stays on one path

    def close(self) -> None:
        super().close()
        self.peer_bufs = []

    def _view(self, buf: torch.Tensor, offset_elems: int, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        start = offset_elems * like.element_size()
        return buf[start : start + nbytes].view(like.dtype).view(like.shape)

    def _exchange(self, chunks: list[torch.Tensor], chunk_elems: int) -> torch.Tensor:
        """Copy ``chunks[d]`` into rank d's buffer at slot ``self.rank``; returns my buffer's R slots."""
        self.check()
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        for offset in range(self.world_size):
            d = (self.rank + offset) % self.world_size  # stagger peers so links are used evenly
            self._view(self.peer_bufs[d], self.rank * chunk_elems, chunks[d]).copy_(chunks[d])
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        first = chunks[0]
        return self.buf[: self.world_size * chunk_elems * first.element_size()].view(first.dtype)

    def _fits(self, out: torch.Tensor) -> bool:
        nbytes = out.numel() * out.element_size()
        return self.min_bytes <= nbytes <= self.nbytes and out.is_cuda

    def start_all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_gather"
    ) -> Callable[[], torch.Tensor]:
        if not self._fits(out) or self.world_size == 1:
            return super().start_all_gather(out, inp, what)
        inp = inp.contiguous()
        mine = self._exchange([inp] * self.world_size, inp.numel())
        out.copy_(mine.view(out.shape))
        return lambda: out

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_to_all") -> torch.Tensor:
        if not self._fits(out) or self.world_size == 1:
            return super().all_to_all(out, inp, what)
        chunks = list(inp.contiguous().chunk(self.world_size))
        mine = self._exchange(chunks, chunks[0].numel())
        return out.copy_(mine.view(out.shape))

    def start_all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_to_all"
    ) -> Callable[[], torch.Tensor]:
        if not self._fits(out) or self.world_size == 1:
            return super().start_all_to_all(out, inp, what)
        done = self.all_to_all(out, inp, what)
        return lambda: done
