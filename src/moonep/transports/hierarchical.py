"""Hierarchical intra-/inter-node transport: a token crosses each node boundary once, not once per rank.

Ranks are ``node * G + local`` (``G = ranks_per_node``); a *rail* is the ranks with one local index across
nodes. Shape suffixes: R ranks, M nodes, G ranks per node, S rows per rank, H hidden.

- all-gather (token rows): rail all-gather (inter-node: ``(M-1)*S`` rows in), then node all-gather of the
  rail blocks (intra-node), then reorder to rank order. Inter-node bytes per rank: ``(M-1)*S*H`` instead
  of the flat ``(R-G)*S*H`` (each token once per node instead of once per remote rank).
- combine (`sum_partials`): node all-to-all sends each local peer the partials of the sources on its rail;
  they are summed in fp32 inside the node, then one rail all-to-all carries one row per (token, node)
  across nodes, and the per-node sums are added in fp32. Partials travel in the wire dtype both times.
Small exchanges (layout, metadata, weights) use the flat group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from moonep.transports.torch_dist import TorchDistTransport

logger = logging.getLogger(__name__)


class HierarchicalTransport(TorchDistTransport):
    """Two-level collectives over node groups and rail groups (built collectively here).

    Args:
        group: the whole expert-parallel group (None: default group); its ranks are numbered node-major.
        timeout_s: collective timeout in seconds.
        ranks_per_node: ``G``; must divide the group size.
    """

    chunked_combine = False  # combine goes through the two-stage `sum_partials`

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float, ranks_per_node: int) -> None:
        super().__init__(group, timeout_s)
        R, G = self.world_size, ranks_per_node
        if G < 1 or R % G:
            raise ValueError(f"ranks_per_node must divide the group size {R}, got {ranks_per_node}")
        self.G, self.M = G, R // G
        self.node, self.local = divmod(self.rank, G)
        global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(R))
        # new_group is collective over the default group: every process creates every subgroup, in order.
        for m in range(self.M):
            ranks = [global_ranks[m * G + j] for j in range(G)]
            created = dist.new_group(ranks, timeout=self.timeout)
            if m == self.node:
                self.node_group = created
        for j in range(G):
            ranks = [global_ranks[m * G + j] for m in range(self.M)]
            created = dist.new_group(ranks, timeout=self.timeout)
            if j == self.local:
                self.rail_group = created
        self.node_t = TorchDistTransport(self.node_group, timeout_s)
        self.rail_t = TorchDistTransport(self.rail_group, timeout_s)

    def check(self) -> None:
        super().check()
        self.node_t.check()
        self.rail_t.check()

    def close(self) -> None:
        super().close()
        self.node_t.close()
        self.rail_t.close()

    def start_all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, what: str = "all_gather"
    ) -> Callable[[], torch.Tensor]:
        if self.M == 1 or self.G == 1:
            return super().start_all_gather(out, inp, what)
        inp = inp.contiguous()
        rail = inp.new_empty((self.M, *inp.shape))
        self.rail_t.all_gather(rail.view(-1, *inp.shape[1:]), inp, f"{what} (inter-node rail)")
        node = inp.new_empty((self.G, self.M, *inp.shape))
        self.node_t.all_gather(node.view(-1, *inp.shape[1:]), rail.view(-1, *inp.shape[1:]), f"{what} (intra-node)")
        # node[j, m] came from rank m*G + j: reorder to rank order.
        out.view(self.M, self.G, *inp.shape).copy_(node.transpose(0, 1))
        return lambda: out

    def sum_partials(self, partial_TH: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if self.M == 1 or self.G == 1:
            return super().sum_partials(partial_TH, num_tokens)
        H = partial_TH.shape[1]
        p_MGSH = partial_TH.view(self.M, self.G, -1, H)
        S = p_MGSH.shape[2]
        # Chunk j of the node exchange: partials of the sources on rail j (every node), [M, S, H].
        send = p_MGSH.transpose(0, 1).contiguous()
        recv = self.node_t.all_to_all(torch.empty_like(send), send, "combine all_to_all (intra-node)")
        node_sum = torch.sum(recv.view(self.G, self.M, S, H), dim=0, dtype=torch.float32).to(partial_TH.dtype)
        back = self.rail_t.all_to_all(torch.empty_like(node_sum), node_sum, "combine all_to_all (inter-node rail)")
        return torch.sum(back.view(self.M, S, H)[:, :num_tokens], dim=0, dtype=torch.float32)
