"""QK-Clip on FSDP2-sharded weights (2 gloo ranks): the gathered weights equal the unsharded model's after the clip."""

from __future__ import annotations

import pytest
import torch

from k3infra.testing import run_ranks

pytestmark = pytest.mark.multiproc

TAU = 30.0


def _model():
    from k3infra.model import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug")).train()
    with torch.no_grad():
        model.model.layers[3].self_attn.q_b_proj.weight.mul_(400.0)
        model.model.layers[3].self_attn.kv_b_proj.weight.mul_(20.0)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))


def _sharded(rank: int, world: int) -> tuple[list[str], dict]:
    from torch.distributed.fsdp import fully_shard

    from k3infra.model.qk_clip import apply_qk_clip

    model = _model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model(_ids())  # every rank sees the same tokens, so the max-reduced records equal one process's
    clipped = apply_qk_clip(model, tau=TAU)
    # numpy arrays pickle by value (tensors would travel as shared memory owned by this exiting process)
    return list(clipped), {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters() if "_b_proj" in n}


def test_qk_clip_on_fsdp2_shards():
    from k3infra.model.qk_clip import apply_qk_clip

    reference = _model()
    reference(_ids())
    expected = apply_qk_clip(reference, tau=TAU)
    assert list(expected) == ["model.layers.3.self_attn"]
    ref_params = dict(reference.named_parameters())
    for clipped, weights in run_ranks(_sharded, 2, timeout_s=240):
        assert clipped == list(expected)
        for name, w in weights.items():
            torch.testing.assert_close(torch.from_numpy(w), ref_params[name].detach(), rtol=1e-6, atol=1e-6, msg=name)
