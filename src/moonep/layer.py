"""A reference MoE layer on top of `Buffer`: sigmoid router with aux-loss-free bias, shared experts on every
rank (overlapped with dispatch), routed SiLU-MLP experts by grouped GEMM over local (home + redundant) experts.

Shape suffixes: s tokens on this rank, H hidden, F expert width, E routed experts, P home experts per rank,
L local expert slots (P + num_redundant_slots), K top-k, C slots on this rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moonep.buffer import Buffer, PlannedDispatch

logger = logging.getLogger(__name__)


class Router(torch.nn.Module):
    """Sigmoid scores; top-k chosen on ``score + bias`` (the bias steers load, never the weights).

    Runs in fp32: sigmoid scores near 0/1 and the normalisation lose precision in bf16.

    Args:
        hidden: ``H``.
        num_experts: ``E``.
        top_k: ``K``.
        route_scale: multiplies the normalised gate weights.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, route_scale: float = 1.0) -> None:
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
        self.weight_EH = torch.nn.Parameter(torch.empty(num_experts, hidden))
        torch.nn.init.normal_(self.weight_EH, std=hidden**-0.5)
        self.register_buffer("bias_E", torch.zeros(num_experts))
        self.top_k, self.route_scale = top_k, route_scale

    def forward(self, x_sH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(topk_idx_sK int64, topk_weights_sK fp32)``."""
        scores_sE = torch.sigmoid(x_sH.float() @ self.weight_EH.float().t())
        idx_sK = (scores_sE.detach() + self.bias_E).topk(self.top_k, dim=1).indices
        weights_sK = scores_sE.gather(1, idx_sK)
        weights_sK = weights_sK / weights_sK.sum(1, keepdim=True).clamp(min=1e-20) * self.route_scale
        return idx_sK, weights_sK

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
        load = tokens_per_expert_E.float()
        self.bias_E += rate * torch.sign(load.mean() - load)


@dataclass(frozen=True, kw_only=True)
class MoEOutput:
    out_sH: torch.Tensor
    """``[s, H]`` shared + routed output."""
    tokens_per_expert_E: torch.Tensor
    """``[E]`` hits per expert over the whole group this step (for `Router.update_bias`)."""
    redundant_per_rank: torch.Tensor
    """``[R]`` redundant experts each rank held this step."""


def grouped_mlp(x_CH: torch.Tensor, counts_L: torch.Tensor, w1_LFH: torch.Tensor, w2_LHF: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w1[l]^T) @ w2[l]^T`` for each local expert's contiguous rows; rows past the counts are zero.

    Uses ``torch._grouped_mm`` on CUDA for bf16 (no host sync); otherwise a loop over experts, which reads
    the counts on the host.
    """
    if x_CH.is_cuda and x_CH.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offs = counts_L.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x_CH, w1_LFH.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(h), w2_LHF.transpose(1, 2), offs=offs)
        used = torch.arange(x_CH.shape[0], device=x_CH.device) < offs[-1]
        return torch.where(used[:, None], y, y.new_zeros(()))  # rows past offs[-1] are never written
    out = []
    start = 0
    for l, n in enumerate(counts_L.tolist()):
        if n:
            out.append(F.silu(x_CH[start : start + n] @ w1_LFH[l].t()) @ w2_LHF[l].t())
        start += n
    out.append(x_CH.new_zeros(x_CH.shape[0] - start, w2_LHF.shape[1]))
    return torch.cat(out)


class MoELayer(torch.nn.Module):
    """Router → dispatch (async) ∥ shared experts → prefetch redundant weights → grouped GEMM → combine.

    Forward, as steps:
        1. the router (fp32) picks ``K`` experts per token and their gate weights;
        2. `Buffer.dispatch` runs with ``async_finish=True``; the shared experts compute meanwhile;
        3. `Buffer.prefetch_weight` fetches the plan's redundant experts (its backward reduces their
           gradients home);
        4. the routed experts run as one grouped GEMM over the local slots;
        5. `Buffer.combine` sums each token's ``K`` outputs in fp32; the shared output is added.
    With ``forward(x, planned=layer.plan_ahead(x))`` step 1 and the planning of step 2 happen ahead (e.g.
    for micro-batch n+1 while micro-batch n's experts run) and dispatch only moves token rows.

    Router and shared experts are replicated: their gradients need the usual data-parallel all-reduce.

    Args:
        buffer: the expert-parallel buffer (its sizes define ``H``, ``E``, ``K``).
        intermediate: ``F``, routed expert width.
        num_shared: shared experts (each a SiLU MLP of width ``intermediate``), 0 for none.
        route_scale: gate weight multiplier.
        dtype: parameter dtype (default: the buffer's).
    """

    def __init__(
        self,
        buffer: Buffer,
        intermediate: int,
        *,
        num_shared: int = 2,
        route_scale: float = 1.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if intermediate < 1 or num_shared < 0:
            raise ValueError(f"intermediate must be >= 1 and num_shared >= 0, got {intermediate}, {num_shared}")
        self.buffer = buffer
        H, P, Fi = buffer.H, buffer.P, intermediate
        dtype = dtype or buffer.dtype
        kw = {"device": buffer.device, "dtype": dtype}
        self.router = Router(H, buffer.E, buffer.K, route_scale).to(buffer.device)
        self.w1_PFH = torch.nn.Parameter(torch.randn(P, Fi, H, **kw) * H**-0.5)
        self.w2_PHF = torch.nn.Parameter(torch.randn(P, H, Fi, **kw) * Fi**-0.5)
        self.shared_w1_FH = torch.nn.Parameter(torch.randn(num_shared * Fi, H, **kw) * H**-0.5)
        self.shared_w2_HF = torch.nn.Parameter(torch.randn(H, num_shared * Fi, **kw) * Fi**-0.5)

    def plan_ahead(self, x_sH: torch.Tensor) -> PlannedDispatch:
        """Route ``x_sH`` ([s, H]) and plan its dispatch on the communication stream (collective), e.g. for the
        next micro-batch while this one's experts run; pass the result to ``forward(x_sH, planned=...)``."""
        idx_sK, weights_sK = self.router(x_sH)
        return self.buffer.plan(idx_sK, weights_sK, async_finish=True)

    def forward(self, x_sH: torch.Tensor, planned: PlannedDispatch | None = None) -> MoEOutput:
        """Run the layer on this rank's tokens.

        Args:
            x_sH: ``[s, H]`` tokens.
            planned: from `plan_ahead` on the same ``x_sH`` (its routing and plan are used), or None.

        Returns:
            `MoEOutput` with ``out_sH`` ``[s, H]``.
        """
        if planned is None:
            idx_sK, weights_sK = self.router(x_sH)
        else:
            idx_sK, weights_sK = planned.topk_idx, planned.topk_weights
        dispatched = self.buffer.dispatch(x_sH, idx_sK, weights_sK, async_finish=True, plan=planned)
        with dispatched.event:
            shared_sH = F.silu(x_sH @ self.shared_w1_FH.t()) @ self.shared_w2_HF.t()
        plan = dispatched.handle.plan
        w1_LFH = self.buffer.prefetch_weight(plan, self.w1_PFH)
        w2_LHF = self.buffer.prefetch_weight(plan, self.w2_PHF)
        # Local experts past the prefetched ones have no slots (prefetch_weight validated the plan).
        counts_L = dispatched.counts_L[: w1_LFH.shape[0]]
        y_CH = grouped_mlp(dispatched.x_CH, counts_L, w1_LFH, w2_LHF)
        routed_sH, _ = self.buffer.combine(y_CH, dispatched.handle)
        return MoEOutput(
            out_sH=shared_sH + routed_sH,
            tokens_per_expert_E=plan.counts_RE.sum(0),
            redundant_per_rank=plan.num_redundant_R,
        )
