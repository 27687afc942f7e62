"""The K3 spec's ``parallelize_fn`` and ``post_optimizer_build_fn`` for torchtitan's trainer.

`parallelize_k3` applies, on the meta-device model torchtitan built:
    1. MoonEP expert parallel over torchtitan's ``ep`` mesh (``parallelism.expert_parallel_degree``): each EP rank
       keeps its ``E / ep`` home experts, dispatched through one `moonep.Buffer` per MoE layer; the kept expert
       stacks become DTensors ``Shard(0)`` on the ``ep`` mesh, the layout torchtitan's EP-aware gradient clipping
       expects;
    2. activation checkpointing (torchtitan's ``activation_checkpoint`` policy) per decoder layer;
    3. FSDP2 (HSDP with ``data_parallel_replicate_degree > 1``) per decoder layer and the root, torchtitan's
       mixed-precision policy, gradient division off (torchtitan's loss is already divided by the global token
       count); with EP the routed experts are sharded over the ``efsdp`` mesh (the ranks holding the same experts)
       and everything else over the dense data-parallel mesh, as torchtitan does for its own MoE models.

`register_k3_hooks` (the ``post_optimizer_build_fn``) runs MuonClip's QK-Clip and the Quantile Balancing bias
update after every optimizer step, as ``k3infra train`` does.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from k3infra.model.moe import K3MoE
from k3infra.model.qk_clip import apply_qk_clip

logger = logging.getLogger(__name__)

__all__ = ["parallelize_k3", "register_k3_hooks"]

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def _device() -> torch.device:
    from torchtitan.tools import utils

    if utils.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(utils.device_type, utils.device_module.current_device())


def _shard_experts_over_ep(lm: nn.Module, parallel_dims, tokens_per_rank: int, dtype: torch.dtype) -> None:
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = parallel_dims.get_mesh("ep")
    lm.enable_expert_parallel(ep_mesh.get_group(), max_tokens_per_rank=tokens_per_rank, dtype=dtype,
                              device=_device())
    for moe in lm.moe_layers():
        for name in EXPERT_WEIGHTS:
            local = getattr(moe, name)
            setattr(moe, name, nn.Parameter(DTensor.from_local(local.data, ep_mesh, [Shard(0)], run_check=False),
                                            requires_grad=local.requires_grad))


def _apply_fsdp(model: nn.Module, parallel_dims, training, parallelism) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division, get_fsdp_reshard_after_forward_policy

    replicate = parallel_dims.dp_replicate_enabled
    dp_mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if replicate else ["fsdp"])
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                              reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce], cast_forward_inputs=False)
    reshard = get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward, False)
    placement_fn = None
    if parallel_dims.ep_enabled:
        # torch's per-parameter mesh hook, the one torchtitan's own MoE models use: experts over efsdp
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
            from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
        except ImportError as e:
            raise RuntimeError(
                f"parallelism.expert_parallel_degree > 1 under torchtitan needs FSDP's per-parameter mesh "
                f"(ShardPlacementResult), which torch {torch.__version__} lacks (torch 2.13 has it); run expert "
                f"parallel with `k3infra train --ep N` on this torch, or torchtitan with EP 1") from e

        edp_mesh = parallel_dims.get_mesh(["dp_replicate", "efsdp"] if replicate else ["efsdp"])
        edp_info, dp_info = _get_mesh_info(edp_mesh, None), _get_mesh_info(dp_mesh, None)
        experts = {id(getattr(m, n)) for m in model.lm.moe_layers() for n in EXPERT_WEIGHTS}

        def placement_fn(param: nn.Parameter) -> ShardPlacementResult:
            return ShardPlacementResult(placement=Shard(0), mesh_info=edp_info if id(param) in experts else dp_info)

    for layer in model.lm.model.layers:
        has_experts = any(isinstance(m, K3MoE) for m in layer.modules())
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard,
                    shard_placement_fn=placement_fn if has_experts else None)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    disable_fsdp_gradient_division(model)
    if dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM, the op FSDP picks for a divide factor of 1
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def parallelize_k3(model: nn.Module, *, parallel_dims, training, parallelism, compile_config, ac_config,
                   dump_folder: str, **kwargs) -> nn.Module:
    """torchtitan ``parallelize_fn`` for `K3TitanModel` (see the module docstring). Returns the model.

    Raises:
        ValueError: tensor, context or pipeline parallelism is asked for (not provided by this spec: the KDA/MLA
            layers carry no TP plan and the Block Attention Residuals pass block sums between layers, which
            torchtitan's pipeline splitter does not carry).

    ``compile.enable`` with ``model`` in ``compile.components`` compiles each decoder layer
    (`k3infra.train.compile.apply_compile`, ``compile.backend``) after activation checkpointing and before FSDP.
    """
    for name, enabled in (("tensor", parallel_dims.tp_enabled), ("context", parallel_dims.cp_enabled),
                          ("pipeline", parallel_dims.pp_enabled)):
        if enabled:
            raise ValueError(f"the K3 spec does not provide {name} parallelism; set its degree to 1")
    lm = model.lm
    if parallel_dims.ep_enabled:
        from torchtitan.config import TORCH_DTYPE_MAP

        _shard_experts_over_ep(lm, parallel_dims, training.local_batch_size * training.seq_len,
                               TORCH_DTYPE_MAP[training.mixed_precision_param])
    if ac_config is not None:
        policy = ac_config.build(dump_folder=dump_folder)
        layers = lm.model.layers
        for i in range(len(layers)):
            layers[i] = policy._wrap_block(layers[i], base_fqn=f"lm.model.layers.{i}")
    if compile_config.enable and "model" in compile_config.components:
        from k3infra.train.compile import apply_compile

        apply_compile(list(lm.model.layers), backend=compile_config.backend)  # after AC, before FSDP
    _apply_fsdp(model, parallel_dims, training, parallelism)
    logger.info("K3: FSDP over %d ranks, expert parallel %d, activation checkpointing %s",
                parallel_dims.world_size, parallel_dims.ep, type(ac_config).__qualname__ if ac_config else "off")
    return model


def register_k3_hooks(optimizers, model_parts: list[nn.Module], parallel_dims, *, qk_clip_tau: float = 100.0) -> None:
    """torchtitan ``post_optimizer_build_fn``: after each optimizer step, QK-Clip the MLA heads (``τ``;
    0 disables) and update every MoE layer's Quantile Balancing bias (a collective over all ranks)."""

    def after_step(optimizer, args, kwargs) -> None:
        for part in model_parts:
            lm = part.lm
            if qk_clip_tau > 0:
                with torch.no_grad():
                    apply_qk_clip(lm, qk_clip_tau)
            lm.update_balancing()

    optimizers.register_step_post_hook(after_step)
