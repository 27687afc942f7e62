"""Optimizers and the learning-rate schedule.

Muon (`ShardedMuon`, a `torch.optim.Muon` whose step also takes FSDP2-sharded DTensors and stacked
``[E, n, m]`` expert weights, orthogonalising each expert's matrix on its own) updates the weight matrices of
attention, dense FFN and experts (``adjust_lr_fn="match_rms_adamw"``: the update is scaled by
``0.2·√max(n, m)``, K2's rule, so one learning rate serves both optimizers). `torch.optim.AdamW` updates
everything Muon should not: the input embedding and ``lm_head`` (their rows are per-token vectors, not a linear
map to orthogonalise), the router (fp32, zero weight decay), norms, biases, per-head scalars and any parameter
that is not a matrix. Weight decay 0.1 on matrices; norms, biases and the router get none. The schedule is a
linear warmup over 1% of the steps followed by a cosine decay to ``min_lr_ratio`` of the peak.

Per-head Muon (K3's refinement, ``K3_MODEL.md`` §4): the query, key and value projections are orthogonalised one
head at a time. A module that has them says how its weight rows split into heads (``muon_head_blocks()``, e.g.
``{"q_proj.weight": (128,)}``, or ``(n, d_v)`` for a matrix whose head holds a key then a value block); Muon then
runs Newton–Schulz on every ``[block rows, in]`` slice on its own, each with its own ``0.2·√max`` scale, so one
head's gradient never shapes another head's update.

Around Newton–Schulz, the momentum, the Nesterov update, the weight decay and the scaled subtraction run as two
fused passes (`muon_kernels`) wherever the fused element-wise kernels run (`k3infra.model.fused.use_fused`), and
as torch ops elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim._muon import _adjust_lr

from ..model.fused import use_fused
from ..plan import optimizer as update_plan
from .muon_kernels import decay_and_subtract, momentum_update
from .newton_schulz import newton_schulz

ADAMW_NAME_PARTS = ("embed_tokens", "lm_head", "router")
"""Parameters whose name contains one of these go to AdamW even when 2-D."""


def split_parameters(named: Iterable[tuple[str, nn.Parameter]]) -> tuple[list, list, list]:
    """Sort trainable parameters into ``(muon, adamw_decay, adamw_no_decay)`` lists of ``(name, param)``."""
    muon, decay, no_decay = [], [], []
    for name, param in named:
        if not param.requires_grad:
            continue
        if param.ndim in (2, 3) and not any(part in name for part in ADAMW_NAME_PARTS):
            muon.append((name, param))
        elif param.ndim >= 2:
            decay.append((name, param))
        else:
            no_decay.append((name, param))
    return muon, decay, no_decay


def head_blocks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """``{parameter name: per-head row pattern}`` from every module's ``muon_head_blocks()`` (names as in
    ``model.named_parameters()``, wrappers' prefixes included)."""
    out: dict[str, tuple[int, ...]] = {}
    for prefix, module in model.named_modules():
        blocks = getattr(module, "muon_head_blocks", None)
        if callable(blocks):
            for name, pattern in blocks().items():
                out[f"{prefix}.{name}" if prefix else name] = tuple(pattern)
    return out


def build_optimizers(
    model: nn.Module, *, lr: float, weight_decay: float = 0.1, use_muon: bool = True, router_lr_scale: float = 1.0,
    per_head_muon: bool = True, replicated: Iterable[nn.Parameter] = (), replica_group: dist.ProcessGroup | None = None,
) -> list[torch.optim.Optimizer]:
    """Muon for matrices (when ``use_muon``) and AdamW for the rest.

    Args:
        model: the (possibly FSDP-sharded) model; only parameters with ``requires_grad`` are optimised.
        lr: peak learning rate of both optimizers.
        weight_decay: decoupled weight decay for matrices (norm weights and biases get none).
        use_muon: False puts every parameter on AdamW (LoRA fine-tuning, where adapters are low-rank).
        router_lr_scale: the router's learning rate is ``lr · router_lr_scale``.
        per_head_muon: orthogonalise query/key/value projections per head (`head_blocks`); False: whole matrices.
        replicated, replica_group: parameters held whole and alike by every rank of ``replica_group`` (EP-sharded
            experts over their data-parallel replicas); Muon splits the Newton–Schulz of their expert slices over
            that group (`ShardedMuon`).

    Returns:
        ``[muon, adamw]`` or ``[adamw]``; an optimizer without parameters is left out.

    Raises:
        ValueError: ``lr`` or ``weight_decay`` is negative, or nothing is trainable.
    """
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    muon, decay, no_decay = split_parameters(model.named_parameters())
    if not use_muon:
        decay, muon = decay + muon, []
    if not (muon or decay or no_decay):
        raise ValueError("the model has no trainable parameter")
    optimizers: list[torch.optim.Optimizer] = []
    if muon:
        patterns = head_blocks(model) if per_head_muon else {}
        replicated_ids = {id(p) for p in replicated}
        by_kind: dict[tuple, list[nn.Parameter]] = {}
        for name, param in muon:
            by_kind.setdefault((patterns.get(name), id(param) in replicated_ids), []).append(param)
        optimizers.append(ShardedMuon([{"params": params, "head_rows": pattern, "replicated": copies}
                                       for (pattern, copies), params in by_kind.items()],
                                      lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw",
                                      replica_group=replica_group))
    router = [p for n, p in decay + no_decay if "router" in n]
    router_ids = {id(p) for p in router}
    groups = [g for g in ({"params": [p for _, p in decay if id(p) not in router_ids], "weight_decay": weight_decay},
                          {"params": [p for _, p in no_decay if id(p) not in router_ids], "weight_decay": 0.0},
                          {"params": router, "weight_decay": 0.0, "lr": lr * router_lr_scale}) if g["params"]]
    if groups:
        optimizers.append(torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8))
    return optimizers


class ShardedMuon(torch.optim.Muon):
    """`torch.optim.Muon` (same hyper-parameters, same ``momentum_buffer`` state) for FSDP2 and stacked experts.

    Newton–Schulz needs whole matrices, and each runs on one rank of a data-parallel group (`_update_batch`): a
    DTensor update's blocks on the rank whose shard holds them whole, else on one owner rank that gathers the update
    and scatters the step back; each rank keeps its own shard. A 3-D ``[E, n, m]`` parameter is orthogonalised per
    ``[n, m]`` slice with the learning-rate scale of one slice. A group with ``head_rows`` (a row pattern such as
    ``(128,)`` or ``(n, d_v)``, repeated down the matrix) orthogonalises every row block on its own (per-head
    Muon), each scaled for its own shape. Momentum stays sharded like the parameter. A group with ``replicated``
    holds 3-D stacks that every rank of ``replica_group`` keeps whole and alike (EP-sharded experts over their
    data-parallel replicas): each of those ranks orthogonalises its share of the slices and they gather the
    results.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 replica_group: dist.ProcessGroup | None = None) -> None:
        # the parent accepts only 2-D parameters; 3-D stacked experts are handled per slice in `step`
        probe = [torch.empty(1, 1)]
        super().__init__(probe, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self.param_groups.clear()
        self.replica_group = replica_group
        for group in params if isinstance(params, list) and params and isinstance(params[0], dict) else [
                {"params": list(params)}]:
            group = {**group, "head_rows": tuple(group["head_rows"]) if group.get("head_rows") else None,
                     "replicated": bool(group.get("replicated"))}
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes 2-D matrices or 3-D stacked experts, got a {tuple(p.shape)} tensor")
                period = sum(group["head_rows"] or ())
                if period and (p.ndim != 2 or any(r < 1 for r in group["head_rows"]) or p.shape[0] % period):
                    raise ValueError(f"head_rows {group['head_rows']} must be positive and tile the rows of a 2-D "
                                     f"matrix, got a {tuple(p.shape)} parameter")
            self.add_param_group(group)

    def newton_schulz_flops(self) -> int:
        """FLOPs of one step's Newton–Schulz iterations over every block (``[a, b]``, a ≤ b: the Gram product
        2a²b, the quintic term 2a³ and the update product 2a²b per iteration), as plain products (the symmetric
        kernel skips about half the tiles of the first two); the element-wise passes are not counted."""
        return sum(_newton_schulz_flops(param.shape, group["head_rows"], group["ns_steps"])
                   for group in self.param_groups for param in group["params"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            batch, batch_bytes = [], 0
            for i, (param, grad, buf) in enumerate(zip(params, grads, bufs)):
                batch.append((param, _momentum_step(grad, buf, momentum, group["nesterov"])))
                batch_bytes += param.numel() * 2
                if batch_bytes >= MUON_BATCH_BYTES or i == len(params) - 1:
                    replicas = self.replica_group if group.get("replicated") else None
                    _update_batch(batch, group, lr, 1 - lr * wd, replicas)
                    batch, batch_bytes = [], 0
        return loss


#: Muon orthogonalises the updates of consecutive parameters together (all of their blocks of one shape in one
#: batched Newton–Schulz) until their full (gathered) updates reach this many bf16 bytes: fewer, larger batched
#: matmuls, and at most this much gathered at once under FSDP.
MUON_BATCH_BYTES = 1 << 30


def _update_batch(batch: list[tuple[torch.Tensor, torch.Tensor]], group: dict, lr: float, decay: float,
                  replicas: dist.ProcessGroup | None = None) -> None:
    """Orthogonalise and apply the updates of ``batch`` (``(param, update)`` pairs), each Newton–Schulz computed
    once over a data-parallel group instead of on every rank. How depends on the update (`_placement`):

    - ``local``: a plain tensor, or a DTensor sharded on rows at block boundaries (stacked experts, or per-head
      blocks that the shards hold whole): each rank orthogonalises the blocks it holds; no communication;
    - ``owner``: any other row-sharded matrix on a 1-D mesh: one rank of the mesh (`_owners`: the least loaded by
      Newton–Schulz FLOPs) gathers the update, orthogonalises it and scatters each rank its rows of the step;
    - ``gather``: any other DTensor: every rank gathers the whole update and orthogonalises it;
    - ``spread``: a plain 3-D stack that every rank of ``replicas`` holds alike: each orthogonalises its share of
      the slices (torch.chunk's split) and all gather the whole orthogonalised stack.
    """
    head_rows = group["head_rows"]
    spread = replicas is not None and dist.get_world_size(replicas) > 1
    placements = ["spread" if spread and not isinstance(u, DTensor) and u.ndim == 3 else _placement(u, head_rows)
                  for _, u in batch]
    owners = _owners([u for (_, u), how in zip(batch, placements) if how == "owner"], group)
    fulls, pending, owned = {}, [], iter(owners)
    for k, ((_, update), how) in enumerate(zip(batch, placements)):
        if how == "local":
            fulls[k] = update.to_local() if isinstance(update, DTensor) else update
        elif how == "spread":
            counts = _row_counts(update.shape[0], dist.get_world_size(replicas))
            me = dist.get_rank(replicas)
            fulls[k] = update[sum(counts[:me]): sum(counts[: me + 1])]
        elif how == "gather":
            fulls[k] = update.full_tensor()
        else:
            owner = next(owned)
            pending.append((k, owner, _gather_rows(update.to_local(), update.shape[0], update.device_mesh.get_group(),
                                                   owner)))
    for k, owner, (work, finish) in pending:
        work.wait()
        if owner == dist.get_rank(batch[k][1].device_mesh.get_group()):
            fulls[k] = finish()
    mine = [k for k in fulls if fulls[k].numel()]
    steps = dict(zip(mine, _orthogonalised_steps([fulls[k] for k in mine], group, lr)))
    gathers = []
    for k, ((_, update), how) in enumerate(zip(batch, placements)):
        if how == "spread":
            share = steps[k][0][0] if k in steps else None
            gathers.append((k, _all_gather_rows(share, update, replicas)))
    for k, (work, finish) in gathers:
        work.wait()
        fulls[k] = update = batch[k][1]
        steps[k] = [(finish(), _adjust_lr(lr, group["adjust_lr_fn"], update.shape[1:]))]
        placements[k] = "local"
    scatters = []
    for k, ((param, update), how) in enumerate(zip(batch, placements)):
        if how == "owner":
            continue
        if how == "local" and isinstance(param, DTensor):
            param, update = param.to_local(), fulls[k]
        if k in steps:
            _subtract_step(param, update, fulls[k], steps[k], head_rows, decay)
    for k, owner, _ in pending:
        param, update = batch[k]
        step = None
        if k in steps:
            step = torch.cat([piece.to(param.dtype) * scale for piece, scale in steps[k]], dim=1).reshape(param.shape)
        scatters.append((param.to_local(), _scatter_rows(step, param.to_local(), param.shape[0],
                                                         update.device_mesh.get_group(), owner)))
    for local, (work, rows) in scatters:
        work.wait()
        local.mul_(decay).sub_(rows())


def _placement(update: torch.Tensor, head_rows: tuple[int, ...] | None) -> str:
    """``local``, ``owner`` or ``gather`` (see `_update_batch`) for one parameter's update."""
    if not isinstance(update, DTensor):
        return "local"
    if update.device_mesh.ndim != 1 or tuple(update.placements) != (Shard(0),):
        return "gather"
    world = update.device_mesh.size()
    if world == 1 or update.ndim == 3:
        return "local"
    period = sum(head_rows or ())
    chunk = -(-update.shape[0] // world)  # torch.chunk's row count per rank, the last ranks fewer or none
    return "local" if period and chunk % period == 0 else "owner"


def _owners(updates: list[DTensor], group: dict) -> list[int]:
    """The rank (within its mesh) that orthogonalises each update: largest first, each to the least loaded rank
    by Newton–Schulz FLOPs (ties to the lower rank); the same answer on every rank."""
    cost = [_newton_schulz_flops(u.shape, group["head_rows"], group["ns_steps"]) for u in updates]
    owners = [0] * len(updates)
    load: dict[tuple[int, ...], list[int]] = {}
    for k in sorted(range(len(updates)), key=lambda k: -cost[k]):
        ranks = load.setdefault(tuple(dist.get_process_group_ranks(updates[k].device_mesh.get_group())),
                                [0] * updates[k].device_mesh.size())
        owners[k] = min(range(len(ranks)), key=lambda r: ranks[r])
        ranks[owners[k]] += cost[k]
    return owners


def _row_counts(rows: int, world: int) -> list[int]:
    """Rows of each rank under ``Shard(0)`` (torch.chunk's split, ranks past the last chunk empty)."""
    counts = [len(c) for c in torch.empty(rows, device="meta").chunk(world)]
    return counts + [0] * (world - len(counts))


def _gather_rows(local: torch.Tensor, rows: int, pg, owner: int):
    """Start gathering every rank's rows of a ``[rows, ...]`` tensor on rank ``owner`` of ``pg``. Returns the
    work and a function that assembles the whole tensor (call it on the owner after the wait)."""
    counts = _row_counts(rows, pg.size())
    padded = local.new_zeros(counts[0], *local.shape[1:])
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts] if dist.get_rank(pg) == owner else None
    work = dist.gather(padded, parts, group=pg, group_dst=owner, async_op=True)
    return work, lambda: torch.cat([part[:n] for part, n in zip(parts, counts)])


def _all_gather_rows(share: torch.Tensor | None, like: torch.Tensor, pg):
    """Start gathering every rank's ``share`` (its torch.chunk rows of a tensor shaped like ``like``, in bf16; None:
    no rows) on every rank of ``pg``. Returns the work and a function assembling the whole (after the wait)."""
    counts = _row_counts(like.shape[0], dist.get_world_size(pg))
    padded = torch.zeros(counts[0], *like.shape[1:], dtype=torch.bfloat16, device=like.device)
    if share is not None:
        padded[: share.shape[0]] = share
    parts = [torch.empty_like(padded) for _ in counts]
    work = dist.all_gather(parts, padded, group=pg, async_op=True)
    return work, lambda: torch.cat([part[:n] for part, n in zip(parts, counts)])


def _scatter_rows(whole: torch.Tensor | None, local: torch.Tensor, rows: int, pg, owner: int):
    """Start scattering ``whole`` (``[rows, ...]``, on rank ``owner`` of ``pg``; None elsewhere) by rows like
    ``local``. Returns the work and a function giving this rank's rows (after the wait)."""
    counts = _row_counts(rows, pg.size())
    out = local.new_empty(counts[0], *local.shape[1:])
    parts = None
    if whole is not None:
        parts = [out.new_zeros(counts[0], *local.shape[1:]) for _ in counts]
        for part, piece in zip(parts, whole.split(counts)):
            part[: piece.shape[0]] = piece
    work = dist.scatter(out, parts, group=pg, group_src=owner, async_op=True)
    return work, lambda: out[: local.shape[0]]


def _newton_schulz_flops(shape: torch.Size, head_rows: tuple[int, ...] | None, ns_steps: int) -> int:
    """Newton–Schulz FLOPs of one step over a parameter of ``shape`` (see `ShardedMuon.newton_schulz_flops`)."""
    total = 0
    for block in _blocks(torch.empty(shape, device="meta"), head_rows):
        a, b = sorted(block.shape[1:])
        total += block.shape[0] * ns_steps * (4 * a * a * b + 2 * a ** 3)
    return total


def _orthogonalised_steps(fulls: list[torch.Tensor], group: dict, lr: float) -> list[list[tuple[torch.Tensor, float]]]:
    """Muon's updates for several parameters: every row block (``head_rows``) or expert slice orthogonalised on
    its own, the blocks of one shape (over all the parameters) in a single batched Newton–Schulz, each scaled for
    its own shape. Per parameter, per block (`_blocks` order): the bf16 orthogonalised block and its scale."""
    blocks = [_blocks(full, group["head_rows"]) for full in fulls]
    by_shape: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for i, param_blocks in enumerate(blocks):
        for j, b in enumerate(param_blocks):
            by_shape.setdefault(tuple(b.shape[1:]), []).append((i, j))
    done: list[list] = [[None] * len(param_blocks) for param_blocks in blocks]
    for shape, members in by_shape.items():
        sizes = [blocks[i][j].shape[0] for i, j in members]
        # one bf16 copy of the blocks, which Newton-Schulz reads as is (no fp32 stack, then a bf16 cast of it)
        stacked = torch.empty(sum(sizes), *shape, dtype=torch.bfloat16, device=fulls[0].device)
        for (i, j), piece in zip(members, stacked.split(sizes)):
            piece.copy_(blocks[i][j])
        ortho = zeropower_batched(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"])
        scale = _adjust_lr(lr, group["adjust_lr_fn"], shape)
        for (i, j), piece in zip(members, ortho.split(sizes)):
            done[i][j] = (piece, scale)
    return done


def _blocks(full: torch.Tensor, head_rows: tuple[int, ...] | None) -> list[torch.Tensor]:
    """The ``[B, n, m]`` views of ``full`` Newton–Schulz takes one slice at a time: its ``head_rows`` row blocks
    (``[heads, rows, in]`` each), its expert slices, or the matrix itself as ``[1, n, m]``."""
    if head_rows:
        period = sum(head_rows)
        return list(full.reshape(full.shape[0] // period, period, full.shape[1]).split(list(head_rows), 1))
    return [full if full.ndim == 3 else full[None]]


def _momentum_step(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the momentum ``buf`` in place and return Muon's update (Nesterov or the momentum itself): one fused
    pass writing a bf16 update where the element-wise kernels run (a DTensor's local shards; the update is then a
    DTensor of the same placements), torch's ``lerp`` ops (an fp32 update) elsewhere."""
    sharded = isinstance(grad, DTensor)
    local_grad, local_buf = (grad.to_local(), buf.to_local()) if sharded else (grad, buf)
    if (use_fused(local_grad) and local_grad.is_contiguous() and local_buf.is_contiguous()
            and local_buf.shape == local_grad.shape and (not sharded or buf.placements == grad.placements)):
        update = momentum_update(local_grad, local_buf, momentum, nesterov)
        if sharded:
            update = DTensor.from_local(update, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape,
                                        stride=grad.stride())
        return update
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def _subtract_step(param: torch.Tensor, update: torch.Tensor, full: torch.Tensor,
                   blocks: list[tuple[torch.Tensor, float]], head_rows: tuple[int, ...] | None, decay: float) -> None:
    """``param ← decay·param − scale·block`` for every orthogonalised block, in place. A plain contiguous parameter
    takes each bf16 block through its matching view (one fused pass per block where the element-wise kernels run,
    no fp32 copy of the step); a DTensor gets the full step assembled and sharded like ``update``."""
    if not isinstance(param, DTensor) and param.is_contiguous() and param.shape == full.shape:
        fused = use_fused(param)
        for view, (piece, scale) in zip(_blocks(param, head_rows), blocks):
            if fused:
                decay_and_subtract(view, piece, decay, scale)
            else:
                view.mul_(decay).add_(piece, alpha=-scale)
        return
    param.mul_(decay)
    step = torch.cat([piece.to(param.dtype) * scale for piece, scale in blocks], dim=1).reshape(full.shape)
    if isinstance(update, DTensor):
        step = distribute_tensor(step, update.device_mesh, update.placements, src_data_rank=None)
    param.sub_(step)


def takes_symmetric_products(shape: torch.Size) -> bool:
    """Whether a ``[B, N, M]`` Newton–Schulz batch is large enough for the symmetric products to pay
    (`k3infra.plan.optimizer.takes_symmetric_products`: the planner counts the same rule)."""
    return update_plan.takes_symmetric_products(*shape)


def zeropower_batched(g_BNM: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                      eps: float) -> torch.Tensor:
    """`torch.optim.Muon`'s quintic Newton–Schulz orthogonalisation of every ``[N, M]`` slice of ``g_BNM`` at
    once (batched matmuls instead of a Python loop over slices), in bf16 like torch's. ``[B, N, M]`` →
    ``[B, N, M]`` bf16. Where the fused kernels run, a batch that `takes_symmetric_products` takes the two symmetric
    products from `newton_schulz.symmetric_product`."""
    symmetric = use_fused(g_BNM) and takes_symmetric_products(g_BNM.shape)
    return newton_schulz(g_BNM, ns_coefficients, ns_steps, eps, symmetric=symmetric)


def cosine_with_warmup(total_steps: int, *, warmup_fraction: float = 0.01, min_lr_ratio: float = 0.1):
    """The LR multiplier ``f(step)``: linear warmup to 1 over ``ceil(warmup_fraction·total_steps)`` steps, then
    cosine from 1 to ``min_lr_ratio`` at ``total_steps``."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup = max(1, math.ceil(warmup_fraction * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_schedulers(optimizers: list[torch.optim.Optimizer], total_steps: int) -> list:
    """One `LambdaLR` per optimizer with `cosine_with_warmup`."""
    factor = cosine_with_warmup(total_steps)
    return [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in optimizers]
