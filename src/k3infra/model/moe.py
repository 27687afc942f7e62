"""Stable LatentMoE of K3 with Quantile Balancing, local experts or expert parallel through MoonEP.

Forward, as steps (``K3_MODEL.md`` §1):
    1. router (fp32): ``s = σ(W_r x)``; top-(k+1) on ``s + b`` (``b`` only selects, never weighs); the first ``k``
       are the token's experts, ``p = s_topk / Σ s_topk`` (times ``routed_scaling_factor``);
    2. the (k+1)-th value is the token's cutoff ``α``; in training the margins ``s − α`` go into per-expert
       histograms (Quantile Balancing);
    3. ``h = W↓ x`` (latent ``ℓ``); routed SiTU-GLU experts on ``h``, gate-weighted sum ``u``;
    4. ``y = shared(x) + W↑ RMSNorm(u)`` (shared experts full width, replicated on every EP rank).

Quantile Balancing: `K3MoE.update_balancing` (the trainer calls it after each optimizer step) sums the
histograms over a process group, sets ``b_j = −quantile_{1−k/E}(s_{:,j} − α)`` so that expert ``j`` would have
been picked by a ``k/E`` share of the batch's tokens, centres ``b`` to mean zero and clears the histograms.

Shape suffixes: s tokens, D hidden, L latent, M expert width, E routed experts, K top-k, P local experts,
C dispatched slots, X bins.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from k3infra.model.fused_moe import slot_sum
from k3infra.model.fused_topk import biased_topk
from k3infra.model.layers import Linear, RMSNorm, SiTUGLU, situ_glu
from k3infra.model.weight_casts import compute_weight

__all__ = ["K3MoE", "Router", "grouped_situ"]

logger = logging.getLogger(__name__)


def _logits_dtype(x_sD: torch.Tensor, w_ED: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x_sD.dtype, w_ED.dtype), torch.float32)


def _bf16_parts(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` bf16 tensors whose fp32 sum is ``t`` (fp32) to about ``2^(−8·parts)`` relative: each takes
    what the previous ones left."""
    out, rest = [], t.float()
    for _ in range(parts):
        out.append(rest.to(torch.bfloat16))
        rest = rest - out[-1].float()
    return out


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 matrices with fp32 accumulation and an fp32 result (tensor cores on CUDA)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _splits_router_products(x_sD: torch.Tensor, w_ED: torch.Tensor) -> bool:
    # bf16 tokens against fp32 router weights on a GPU: the fp32 products would run on CUDA cores
    return x_sD.is_cuda and x_sD.dtype == torch.bfloat16 and w_ED.dtype == torch.float32


def router_logits_split(x_sD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """``x @ w.t()`` as fp32 ``[s, E]`` from bf16 products: ``x`` (bf16 ``[s, D]``) is exact in bf16 and ``w``
    (fp32 ``[E, D]``) is split into three bf16 parts, so one GEMM against the stacked parts with fp32 accumulation
    gives the fp32 product to fp32 rounding."""
    E = w_ED.shape[0]
    parts_sPE = _mm_fp32(x_sD, torch.cat(_bf16_parts(w_ED, 3)).t()).view(-1, 3, E)
    return parts_sPE[:, 2] + parts_sPE[:, 1] + parts_sPE[:, 0]


def router_logits_split_backward(grad_sE: torch.Tensor, x_sD: torch.Tensor, w_ED: torch.Tensor,
                                 needs: tuple[bool, bool] = (True, True)) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `router_logits_split` from the fp32 ``grad_sE`` (None where ``needs`` says so): ``grad_x``
    fp32 ``[s, D]``, ``g·w`` from the products of two-part splits down to ``2^−16`` (it is rounded to bf16 after),
    and ``grad_w`` fp32 ``[E, D]``, ``gᵀx`` with ``g`` in three parts (fp32 rounding, like ``w``)."""
    E = w_ED.shape[0]
    g1, g2, g3 = _bf16_parts(grad_sE, 3)
    grad_x = grad_w = None
    if needs[0]:
        w1, w2 = _bf16_parts(w_ED, 2)
        grad_x = _mm_fp32(torch.cat([g1, g1, g2], 1), torch.cat([w1, w2, w1]))
    if needs[1]:
        parts_PED = _mm_fp32(torch.cat([g1, g2, g3], 1).t(), x_sD).view(3, E, -1)
        grad_w = parts_PED[2] + parts_PED[1] + parts_PED[0]
    return grad_x, grad_w


class _RouterLogits(torch.autograd.Function):
    """``x_sD @ w_ED.t()`` in fp32 (fp64 for fp64 inputs) with autocast off, keeping ``x_sD`` in its own dtype for
    backward (not an fp32 copy): the backward casts it again instead of recomputing the product. bf16 tokens and
    fp32 weights on a GPU take split bf16 tensor-core products (`router_logits_split`) with fp32 results."""

    @staticmethod
    def forward(ctx, x_sD, w_ED):
        ctx.save_for_backward(x_sD, w_ED)
        with torch.autocast(x_sD.device.type, enabled=False):
            if _splits_router_products(x_sD, w_ED):
                return router_logits_split(x_sD, w_ED)
            dtype = _logits_dtype(x_sD, w_ED)
            return x_sD.to(dtype) @ w_ED.to(dtype).t()

    @staticmethod
    def backward(ctx, grad_sE):
        x_sD, w_ED = ctx.saved_tensors
        with torch.autocast(x_sD.device.type, enabled=False):
            if _splits_router_products(x_sD, w_ED):
                grad_x, grad_w = router_logits_split_backward(grad_sE, x_sD, w_ED, ctx.needs_input_grad[:2])
            else:
                dtype = _logits_dtype(x_sD, w_ED)
                grad_x = grad_sE.to(dtype) @ w_ED.to(dtype) if ctx.needs_input_grad[0] else None
                grad_w = grad_sE.to(dtype).t() @ x_sD.to(dtype) if ctx.needs_input_grad[1] else None
        return (None if grad_x is None else grad_x.to(x_sD.dtype),
                None if grad_w is None else grad_w.to(w_ED.dtype))


class Router(nn.Module):
    """Sigmoid router in fp32 with a selection-only bias and the Quantile Balancing statistics.

    Buffers: ``bias`` ``[E]`` (persistent; frozen unless `K3MoE.update_balancing` runs), ``qb_hist`` ``[E, X]``
    margin counts since the last update (not saved).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, bins: int, margin_range: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("bias", torch.zeros(num_experts))
        self.register_buffer("qb_hist", torch.zeros(num_experts, bins), persistent=False)
        self.top_k, self.num_experts, self.bins, self.margin_range = top_k, num_experts, bins, margin_range

    def forward(self, x_sD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(topk_idx_sK int64, topk_weights_sK fp32)`` (fp64 in an fp64 model); records QB margins in
        training."""
        # fp32 at least: sigmoid scores near 0/1 and their normalisation lose precision in bf16.
        scores_sE = torch.sigmoid(_RouterLogits.apply(x_sD, self.weight))
        # the (k+1)-th biased value is Quantile Balancing's cutoff: in training its margins go to qb_hist
        _, sel_indices = biased_topk(scores_sE.detach().float(), self.bias.float(), self.top_k + 1,
                                     hist_EX=self.qb_hist if self.training else None, margin_range=self.margin_range)
        idx_sK = sel_indices[:, : self.top_k]
        weights_sK = scores_sE.gather(1, idx_sK)
        return idx_sK, weights_sK / weights_sK.sum(1, keepdim=True).clamp(min=1e-20)

    @torch.no_grad()
    def update_bias(self, group: dist.ProcessGroup | None = None) -> bool:
        """Quantile Balancing step (see the module docstring); returns False if no margins were recorded.

        When torch.distributed is initialised the histograms are all-reduced over ``group`` (None: the default
        group, as in torch.distributed), so every rank must call it."""
        hist_EX = self.qb_hist.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(hist_EX, group=group)
        total = hist_EX[0].sum()
        if total <= 0:
            return False
        target = (1.0 - self.top_k / self.num_experts) * total
        cdf_EX = hist_EX.cumsum(1)
        below = cdf_EX - hist_EX  # counts strictly before each bin
        X, R = self.bins, self.margin_range
        j = torch.searchsorted(cdf_EX.contiguous(), torch.full((self.num_experts, 1), float(target),
                                                                device=cdf_EX.device)).clamp(max=X - 1)
        inside = ((target - below.gather(1, j)) / hist_EX.gather(1, j).clamp(min=1)).clamp(0, 1)
        quantile_E = ((j.float() + inside) / X * 2 * R - R).squeeze(1)
        bias = -quantile_E
        self.bias.copy_(bias - bias.mean())
        self.qb_hist.zero_()
        return True


def _grouped_mm_usable(x_CL: torch.Tensor, w_PML: torch.Tensor) -> bool:
    # torch._grouped_mm: bf16 on CUDA (and on the CPU in recent torch); rows must be 16-byte aligned.
    return (x_CL.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and x_CL.device.type in ("cuda", "cpu")
            and (x_CL.shape[1] * 2) % 16 == 0 and (w_PML.shape[1] * 2) % 16 == 0)


def grouped_situ(x_CL, counts_P, w1_PML, w3_PML, w2_PLM, gate_beta: float, up_beta: float,
                 scale_C: torch.Tensor | None = None, *, rows_all_counted: bool = False) -> torch.Tensor:
    """``W2[SiTU-GLU(W1 x, W3 x) · scale]`` per expert over its contiguous rows of ``x_CL``; rows past the counts
    give 0 (``rows_all_counted``: the caller knows the counts add up to ``C``, and no rows are selected). ``scale_C``
    ``[C]`` (the routing weights, or None) multiplies the ``M``-wide activation (in the fused SiTU-GLU kernel), so
    backward keeps ``[C, M]`` tensors and no weighted ``[C, L]`` output.

    Computes in ``x_CL``'s dtype: the weights are cast to it (fp32 master weights under bf16 autocast, which does
    not cover ``torch._grouped_mm``; gradients flow back to the weights in their own dtype), once per optimizer step
    inside `weight_casts.cast_once`. ``torch._grouped_mm`` for bf16 (no host sync), else a loop over experts (reads
    the counts on the host).

    Shapes: ``x_CL [C, L]``, ``counts_P [P]`` int, ``w1_PML / w3_PML [P, M, L]``, ``w2_PLM [P, L, M]`` →
    ``[C, L]`` in ``x_CL``'s dtype.
    """
    w1_PML, w3_PML, w2_PLM = (compute_weight(w, x_CL.dtype) for w in (w1_PML, w3_PML, w2_PLM))
    if _grouped_mm_usable(x_CL, w1_PML):
        offs = counts_P.cumsum(0).to(torch.int32)
        a = torch._grouped_mm(x_CL, w1_PML.transpose(1, 2), offs=offs)
        c = torch._grouped_mm(x_CL, w3_PML.transpose(1, 2), offs=offs)
        act = situ_glu(a, c, gate_beta, up_beta, scale_C)
        y = torch._grouped_mm(act, w2_PLM.transpose(1, 2), offs=offs)
        if rows_all_counted:
            return y
        used = torch.arange(x_CL.shape[0], device=x_CL.device) < offs[-1]
        # rows past the counts are never written by _grouped_mm (any bits, NaN included): select, never multiply
        return torch.where(used[:, None], y, y.new_zeros(()))
    return _grouped_situ_loop(x_CL, counts_P, w1_PML, w3_PML, w2_PLM, gate_beta, up_beta, scale_C)


@torch.compiler.disable
def _grouped_situ_loop(x_CL, counts_P, w1_PML, w3_PML, w2_PLM, gate_beta, up_beta, scale_C):
    """`grouped_situ` one expert at a time; opaque to ``torch.compile`` (the counts are read on the host)."""
    out, start = [], 0
    for p, count in enumerate(counts_P.tolist()):
        if count:
            xp = x_CL[start : start + count]
            scale = None if scale_C is None else scale_C[start : start + count]
            act = situ_glu(xp @ w1_PML[p].t(), xp @ w3_PML[p].t(), gate_beta, up_beta, scale)
            out.append(act @ w2_PLM[p].t())
        start += count
    if start < x_CL.shape[0]:
        out.append(x_CL.new_zeros(x_CL.shape[0] - start, w2_PLM.shape[1]))
    return torch.cat(out, 0) if out else x_CL.new_zeros(0, w2_PLM.shape[1])


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's home experts: a DTensor sharded over the EP mesh (torchtitan's layout) gives its local part."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


class _SortedCopies(torch.autograd.Function):
    """``h_sL[token_C]``: each token's row once per selected expert, in expert-sorted slot order (``token_C`` is the
    token of each slot, ``slots_sK`` the slots of each token). Backward sums each token's ``K`` slot gradients in
    fp32 (or wider) with `slot_sum`: no scatter. The transpose of `_SlotSums`."""

    @staticmethod
    def forward(ctx, h_sL, token_C, slots_sK):
        ctx.save_for_backward(slots_sK)
        ctx.dtype = h_sL.dtype
        return h_sL[token_C]

    @staticmethod
    def backward(ctx, grad_CL):
        (slots_sK,) = ctx.saved_tensors
        return slot_sum(grad_CL, slots_sK, ctx.dtype), None, None


class _SlotSums(torch.autograd.Function):
    """``u[t] = Σ_k y_CL[slots_sK[t, k]]`` in fp32 (fp64 for fp64 rows) with `slot_sum`: the experts' outputs back
    in token order, each token's ``K`` summed. Backward copies each token's gradient to its slots, ``grad[token_C]``
    in ``y_CL``'s dtype. The transpose of `_SortedCopies`."""

    @staticmethod
    def forward(ctx, y_CL, token_C, slots_sK):
        ctx.save_for_backward(token_C)
        ctx.dtype = y_CL.dtype
        return slot_sum(y_CL, slots_sK, torch.promote_types(y_CL.dtype, torch.float32))

    @staticmethod
    def backward(ctx, grad_sL):
        (token_C,) = ctx.saved_tensors
        return grad_sL.to(ctx.dtype)[token_C], None, None


class _PermutedRows(torch.autograd.Function):
    """``x[perm]`` (rows, or the elements of a vector) for a permutation ``perm`` with inverse ``inverse``; backward
    is the gather ``grad[inverse]``."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x[perm]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


class K3MoE(nn.Module):
    """Stable LatentMoE FFN (parameters exactly those counted by `count_parameters`).

    Routed expert weights are stacked: ``w1``/``w3`` ``[E, m, ℓ]`` and ``w2`` ``[E, ℓ, m]``; after
    `enable_expert_parallel` only this rank's ``E / R`` home experts are kept.
    """

    def __init__(self, config) -> None:
        super().__init__()
        d, E, m, lat = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size, config.moe_latent_size
        self.num_experts, self.top_k, self.scale = E, config.num_experts_per_tok, config.routed_scaling_factor
        self.gate_beta, self.up_beta = config.situ_gate_beta, config.situ_up_beta
        self.router = Router(d, E, self.top_k, config.qb_bins, config.qb_margin_range)
        self.latent_down = Linear(d, lat, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, m, lat))
        self.w3 = nn.Parameter(torch.empty(E, m, lat))
        self.w2 = nn.Parameter(torch.empty(E, lat, m))
        self.latent_norm = RMSNorm(lat, config.rms_norm_eps)
        self.latent_up = Linear(lat, d, bias=False)
        self.shared_experts = (SiTUGLU(d, config.n_shared_experts * m, self.gate_beta, self.up_beta)
                               if config.n_shared_experts else None)
        self.ep_buffer = None
        self.ep_rank, self.ep_size = 0, 1

    # -- expert parallel -------------------------------------------------------------------------------------

    def shard_experts(self, buffer, rank: int, size: int) -> None:
        """Keep only home experts ``[rank·E/size, (rank+1)·E/size)`` and route through ``buffer`` (a
        `moonep.Buffer` over the EP group with ``hidden = ℓ``)."""
        P = self.num_experts // size
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                full = getattr(self, name)
                setattr(self, name, nn.Parameter(full[rank * P : (rank + 1) * P].clone(),
                                                 requires_grad=full.requires_grad))
        self.ep_buffer, self.ep_rank, self.ep_size = buffer, rank, size

    # -- forward ---------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., D]`` → ``[..., D]``."""
        shape = x.shape
        x_sD = x.reshape(-1, shape[-1])
        idx_sK, weights_sK = self.router(x_sD)
        weights_sK = weights_sK * self.scale
        h_sL = self.latent_down(x_sD)
        if self.ep_buffer is None:
            u_sL = self._local(h_sL, idx_sK, weights_sK)
        else:
            u_sL = self._expert_parallel(h_sL, idx_sK, weights_sK)
        y = self.latent_up(self.latent_norm(u_sL.to(x.dtype)))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_sD)
        return y.view(shape)

    def _local(self, h_sL, idx_sK, weights_sK):
        s, K = idx_sK.shape
        flat = idx_sK.flatten()
        order = flat.argsort(stable=True)
        # (not bincount: its output length depends on the data, which torch.compile cannot trace)
        counts_E = flat.new_zeros(self.num_experts).index_add_(0, flat, torch.ones_like(flat))
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        w_C = _PermutedRows.apply(weights_sK.flatten(), order, unsort)  # a gather backward, not a scatter
        token_C, slots_sK = order // K, unsort.view(s, K)
        y_CL = grouped_situ(_SortedCopies.apply(h_sL, token_C, slots_sK), counts_E, self.w1, self.w3, self.w2,
                            self.gate_beta, self.up_beta, w_C, rows_all_counted=True)
        # back to token order, the k outputs of a token summed in fp32 (an index_add would keep an fp32 copy of y
        # for backward; the slot sums keep nothing of that size)
        return _SlotSums.apply(y_CL, token_C, slots_sK)

    @torch.compiler.disable
    def _expert_parallel(self, h_sL, idx_sK, weights_sK):
        """MoonEP dispatch, the home experts, combine; opaque to ``torch.compile`` (host-side plans, collectives)."""
        buf = self.ep_buffer
        h_in = h_sL.to(buf.dtype)
        out = buf.dispatch(h_in, idx_sK, weights_sK)
        plan = out.handle.plan
        w1, w3, w2 = (buf.prefetch_weight(plan, _local(w)) for w in (self.w1, self.w3, self.w2))
        counts = out.counts_L[: w1.shape[0]]
        y_CL = grouped_situ(out.x_CH, counts, w1, w3, w2, self.gate_beta, self.up_beta)
        u_sL, _ = buf.combine(y_CL.to(buf.dtype), out.handle)
        return u_sL.float()

    def update_balancing(self, group: dist.ProcessGroup | None = None) -> bool:
        """Apply Quantile Balancing from the margins recorded since the last call (with torch.distributed
        initialised, histograms are summed over ``group``, None = the default group: collective)."""
        return self.router.update_bias(group)
