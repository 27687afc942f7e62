"""Process group, device mesh, FSDP2 and expert parallelism for the trainer.

Layout: every rank is a data-parallel rank (it reads its own share of the batch). Non-expert parameters are
sharded over all ranks with `fully_shard` (FSDP2). With ``ep > 1`` the world is a ``(dp, ep)`` mesh: the model's
routed experts are split over the ``ep`` ranks of a row by ``model.enable_expert_parallel(ep_group)`` (MoonEP),
are left out of FSDP (``ignored_params``), and their gradients are summed over the ``dp`` column of replicas.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

EXPERT_WEIGHTS = ("w1", "w2", "w3")
"""Names of the stacked ``[E, ·, ·]`` routed-expert parameters in an MoE layer."""


@dataclass
class ParallelState:
    """Where this process sits.

    Attributes:
        rank, world_size: global position.
        ep: expert-parallel size; ``ep_rank`` its index in the ep group.
        device: this rank's device.
        ep_group: process group of the ``ep`` ranks sharing one set of experts (None when ``ep == 1``).
        replica_group: process group of the ranks holding the same expert shard (None when ``ep == 1``).
        owns_group: whether `init_parallel` created the default process group (and `close` destroys it).
    """

    rank: int
    world_size: int
    ep: int
    ep_rank: int
    device: torch.device
    ep_group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup | None
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Destroy the process group if this object created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(ep: int, device: str = "auto") -> ParallelState:
    """Join (torchrun: ``WORLD_SIZE`` set) or create (single process) the default process group.

    nccl on CUDA, gloo on the CPU. A single process still gets a one-rank group so checkpoints and collectives take
    one code path.

    Args:
        ep: expert-parallel size; must divide the world size.
        device: ``"auto"`` (CUDA if available), ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: ``ep`` < 1, the world size is not divisible by ``ep``, or ``device`` is unknown/unavailable.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is visible")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be a positive int, got {ep!r}")
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if use_cuda else "gloo"
        if "WORLD_SIZE" in os.environ:
            world = int(os.environ["WORLD_SIZE"])
            if world % ep:
                raise ValueError(f"--ep {ep} must divide the world size {world}")
            dist.init_process_group(backend)
        else:
            if ep != 1:
                raise ValueError(f"--ep {ep} needs {ep} processes or a multiple (run under torchrun); one process "
                                 "supports only --ep 1")
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % ep:
        raise ValueError(f"--ep {ep} must divide the world size {world}")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    ep_group = replica_group = None
    if ep > 1:
        # rows of the (dp, ep) grid share experts; columns hold the same expert shard
        for row in range(world // ep):
            ranks = list(range(row * ep, (row + 1) * ep))
            group = dist.new_group(ranks)
            if rank in ranks:
                ep_group = group
        for col in range(ep):
            ranks = list(range(col, world, ep))
            group = dist.new_group(ranks)
            if rank in ranks:
                replica_group = group
    return ParallelState(rank, world, ep, rank % ep, dev, ep_group, replica_group, owns)


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters that expert parallelism sharded: the stacked routed-expert weights (``w1``, ``w2``, ``w3``) of
    every MoE layer whose ``ep_size`` is above 1; they differ between the ranks of an ep group."""
    out: dict[str, nn.Parameter] = {}
    for name, module in model.named_modules():
        if getattr(module, "ep_size", 1) > 1:
            for pname in EXPERT_WEIGHTS:
                param = getattr(module, pname, None)
                if isinstance(param, nn.Parameter):
                    out[f"{name}.{pname}" if name else pname] = param
    return out


def apply_fsdp(model: nn.Module, state: ParallelState, *, ignored: set[nn.Parameter],
               param_dtype: torch.dtype | None = None) -> None:
    """`fully_shard` every decoder layer, then the root, over all ranks; ``ignored`` stay local.

    With ``param_dtype`` (bf16 on CUDA, as torchtitan's ``mixed_precision_param``) FSDP all-gathers the parameters in
    that dtype for forward and backward and reduce-scatters the gradients in fp32 into the fp32 shards; forward
    inputs are not cast (the AttnRes sources keep their dtypes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(state.device.type, (state.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                              cast_forward_inputs=False)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, ignored_params=ignored or None, mp_policy=mp)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None, mp_policy=mp)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """``model.model.layers`` (a transformers causal LM), also through a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    return list(layers) if layers is not None else []


def reduce_expert_gradients(params: list[nn.Parameter], state: ParallelState) -> None:
    """Sum EP-sharded expert gradients over their replicas and divide by the world size.

    Every rank back-propagates ``world_size ×`` its share of the global-mean loss (FSDP averages over the world),
    so the gradient arriving at an expert shard through MoonEP's combine is ``world_size ×`` its contribution from
    that ep group; summing over the replica groups and dividing by ``world_size`` gives the global-mean gradient.
    """
    for param in params:
        if param.grad is None:
            continue
        if state.replica_group is not None and dist.get_world_size(state.replica_group) > 1:
            dist.all_reduce(param.grad, group=state.replica_group)
        param.grad.div_(state.world_size)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, experts: list[nn.Parameter], state: ParallelState, max_norm: float) -> float:
    """Scale every gradient so the global L2 norm is at most ``max_norm``; returns the norm before clipping.

    Collective when distributed: FSDP2 shards (DTensor gradients) are summed over all ranks, EP-sharded expert
    gradients (already reduced over their replicas by `reduce_expert_gradients`) over the EP group; plain
    replicated gradients count once. Every rank gets the same norm and the same scale.
    """
    from torch.distributed.tensor import DTensor

    expert_ids = {id(p) for p in experts}
    device = state.device
    sharded, expert, replicated = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(3))
    grads = []
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        grads.append(grad)
        if isinstance(grad, DTensor):
            sharded += grad.to_local().float().pow(2).sum()
        elif id(param) in expert_ids:
            expert += grad.float().pow(2).sum()
        else:
            replicated += grad.float().pow(2).sum()
    if state.world_size > 1:
        dist.all_reduce(sharded)
        if state.ep_group is not None:
            dist.all_reduce(expert, group=state.ep_group)
    norm = (sharded + expert + replicated).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
    return float(norm)
