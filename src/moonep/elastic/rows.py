"""Moving routed experts between ranks: weights and their optimizer state, one row per physical expert.

A *row* is everything one physical expert slot holds for a list of ``[P, *W]`` expert parameters: the
parameter rows and the optimizer's per-row state (state tensors shaped like the parameter: AdamW's
``exp_avg``/``exp_avg_sq``, SGD's or Muon's ``momentum_buffer``), flattened and concatenated, so one
point-to-point message moves an expert with its optimizer state. Scalar state (AdamW's ``step``) is the
same on every row and stays with the parameter.

Shape suffixes: P slots on this rank, N the flattened width of one row.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def row_keys(param: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The optimizer state entries of ``param`` that are per-row (shaped like ``param``), sorted."""
    if optimizer is None:
        return []
    state = optimizer.state.get(param, {})
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == param.shape)


def scalar_state(param: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> dict[str, object]:
    """The optimizer state entries of ``param`` that are not per-row (e.g. ``step``), copied."""
    if optimizer is None:
        return {}
    keys = set(row_keys(param, optimizer))
    state = optimizer.state.get(param, {})
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items() if k not in keys}


def pack_rows(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None
) -> tuple[torch.Tensor, list[list[str]]]:
    """``[P, N]`` rows of ``params`` (each ``[P, *W]``) and their per-row optimizer state.

    Returns:
        The rows, and for each parameter the state keys packed after it (`row_keys`).
    """
    keys = [row_keys(p, optimizer) for p in params]
    parts = []
    for param, names in zip(params, keys, strict=True):
        P = param.shape[0]
        parts.append(param.detach().reshape(P, -1))
        parts += [optimizer.state[param][k].detach().reshape(P, -1) for k in names]
    return torch.cat(parts, dim=1), keys


def unpack_rows(
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    rows_PN: torch.Tensor,
    keys: list[list[str]],
    scalars: list[dict[str, object]] | None = None,
) -> None:
    """Write `pack_rows`'s layout back: parameter rows in place, optimizer state set or overwritten
    (``optimizer=None``: the weights only).

    Args:
        scalars: per parameter, scalar state to set where the optimizer has none yet (a fresh optimizer).
    """
    offset = 0
    for i, (param, names) in enumerate(zip(params, keys, strict=True)):
        width = param[0].numel() if param.shape[0] else 0
        with torch.no_grad():
            param.copy_(rows_PN[:, offset : offset + width].reshape(param.shape))
        offset += width
        if optimizer is None:  # weights only: skip the state columns
            offset += width * len(names)
            continue
        state = optimizer.state[param]
        for name in names:
            value = rows_PN[:, offset : offset + width].reshape(param.shape)
            if name in state:
                state[name].copy_(value)
            else:
                state[name] = value.clone()
            offset += width
        for name, value in (scalars[i] if scalars else {}).items():
            state.setdefault(name, value.clone() if torch.is_tensor(value) else value)
    if offset != rows_PN.shape[1]:
        raise ValueError(f"rows have {rows_PN.shape[1]} columns, the parameters and keys take {offset}")


def holders_of(logical_of_X: list[int], slots: int, rank_of: list[int | None]) -> dict[int, list[tuple[int, int]]]:
    """Who holds each logical expert: ``{e: [(rank, slot), ...]}`` from a layout of physical experts.

    Args:
        logical_of_X: logical expert of each physical expert of the old layout (``slots`` per old rank).
        rank_of: rank in the current group of each old rank, None for a rank that is gone.
    """
    holders: dict[int, list[tuple[int, int]]] = {}
    for x, e in enumerate(logical_of_X):
        rank = rank_of[x // slots]
        if rank is not None:
            holders.setdefault(e, []).append((rank, x % slots))
    return holders


def exchange_rows(
    rows_PN: torch.Tensor,
    holders: dict[int, list[tuple[int, int]]],
    new_logical_of_X: list[int],
    rank: int,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = 60.0,
) -> tuple[torch.Tensor, int, list[int]]:
    """Fill this rank's slots of a new layout from the experts' current holders (collective).

    Every rank computes the same transfer list: a slot whose expert this rank already holds is a local
    copy; otherwise one holder (spread over the copies) sends it with tag = the physical id.

    Args:
        rows_PN: this rank's current rows (`pack_rows`).
        holders: `holders_of` the current layout, in the current group's ranks.
        new_logical_of_X: logical expert of each physical expert of the new layout (equal slots per rank).
        rank: this rank in ``group``.

    Returns:
        ``([P', N] new rows, rows received from other ranks, local slots whose expert has no holder)``;
        the rows of those slots are zeros (fill them from a checkpoint).
    """
    world = dist.get_world_size(group)
    if len(new_logical_of_X) % world:
        raise ValueError(f"the new layout has {len(new_logical_of_X)} physical experts, not a multiple of {world}")
    P_new = len(new_logical_of_X) // world
    out = rows_PN.new_zeros(P_new, rows_PN.shape[1])
    works, received, missing = [], 0, []
    for x, e in enumerate(new_logical_of_X):
        dst, slot = divmod(x, P_new)
        held = holders.get(e, [])
        if not held:
            if dst == rank:
                missing.append(slot)
            continue
        mine = [s for r, s in held if r == dst]
        if mine:
            if dst == rank:
                out[slot] = rows_PN[mine[0]]
            continue
        src, src_slot = held[x % len(held)]
        if src == rank:
            works.append(dist.isend(rows_PN[src_slot].contiguous(), group=group, group_dst=dst, tag=x))
        elif dst == rank:
            works.append(dist.irecv(out[slot], group=group, group_src=src, tag=x))
            received += 1
    for work in works:
        work.wait(datetime.timedelta(seconds=timeout_s))
    return out, received, missing
