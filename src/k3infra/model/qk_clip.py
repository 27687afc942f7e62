"""QK-Clip (Kimi K2's MuonClip): after an optimizer step, heads whose largest pre-softmax logit ``S`` exceeded
``τ`` get their query/key weights rescaled so the logit returns to ``τ``.

Per MLA head ``h`` with ``γ = τ / S_h < 1``: the no-rope query rows and the no-rope key rows are scaled by
``√γ`` each, the rope-part query rows by ``γ``; the rope key is shared by all heads and is left alone
(``K3_MODEL.md`` §4). KDA needs no clip: its q and k are L2-normalised.

Example::

    >>> loss.backward(); optimizer.step()
    >>> apply_qk_clip(model, tau=100.0)        # reads and resets each MLA layer's max_logit
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k3infra.model.mla import K3MLA

__all__ = ["apply_qk_clip"]


def _scale_rows(weight: torch.Tensor, scale_rows: torch.Tensor) -> None:
    """``weight[i, :] *= scale_rows[i]`` in place; a DTensor (FSDP2) scales only the rows of its local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = weight.to_local()
        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        if local.numel():
            if len(shape) != 2 or shape[1] != weight.shape[1]:
                raise ValueError(f"QK-Clip needs row-sharded weights (Shard(0)), got placements {weight.placements}")
            rows = scale_rows[offset[0] : offset[0] + shape[0]]
            local.mul_(rows[:, None].to(device=local.device, dtype=local.dtype))
        return
    weight.mul_(scale_rows[:, None].to(device=weight.device, dtype=weight.dtype))


@torch.no_grad()
def apply_qk_clip(
    model: torch.nn.Module, tau: float = 100.0, group: dist.ProcessGroup | None = None
) -> dict[str, list]:
    """Rescale every MLA layer's heads whose recorded max logit exceeds ``tau``; reset the records.

    Args:
        model: a module containing `K3MLA` layers (they record ``max_logit`` in training forwards).
        tau: the logit threshold (K2: 100).
        group: with torch.distributed initialised, the records are max-reduced over this group first (None:
            the default group); every rank must call this then. FSDP2-sharded (DTensor, ``Shard(0)``) weights
            are scaled shard by shard.

    Returns:
        ``{module name: [γ per head]}`` for the layers where at least one head was clipped.

    Raises:
        ValueError: ``tau`` is not a positive number.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau must be a positive number, got {tau!r}")
    clipped = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, K3MLA):
            continue
        S_H = layer.max_logit.clone().float()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(S_H, op=dist.ReduceOp.MAX, group=group)
        layer.max_logit.zero_()
        gamma_H = torch.where(S_H > tau, tau / S_H.clamp(min=1e-30), torch.ones_like(S_H))
        if not bool((gamma_H < 1).any()):
            continue
        H, n, r, dv = layer.num_heads, layer.n, layer.r, layer.dv
        root = gamma_H.sqrt()
        q_scale = torch.cat([root[:, None].expand(H, n), gamma_H[:, None].expand(H, r)], 1).reshape(-1)
        _scale_rows(layer.q_b_proj.weight, q_scale)
        kv_scale = torch.cat([root[:, None].expand(H, n), torch.ones(H, dv, device=root.device)], 1).reshape(-1)
        _scale_rows(layer.kv_b_proj.weight, kv_scale)
        clipped[name] = gamma_H.tolist()
    return clipped
