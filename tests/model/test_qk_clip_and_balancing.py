"""MuonClip's QK-Clip on the MLA layers and Quantile Balancing of the MoE router."""

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM
from k3infra.model.mla import K3MLA
from k3infra.model.moe import Router
from k3infra.model.qk_clip import apply_qk_clip


def _true_max_logits(layer: K3MLA, captured: dict) -> torch.Tensor:
    x = captured["x"]
    B, T, _ = x.shape
    H, n, r = layer.num_heads, layer.n, layer.r
    q = layer.q_b_proj(layer.q_a_norm(layer.q_a_proj(x))).view(B, T, H, n + r)
    c, k_r = layer.kv_a_proj(x).split([layer.r_kv, r], -1)
    k_n = layer.kv_b_proj(layer.kv_a_norm(c)).view(B, T, H, -1)[..., :n]
    k = torch.cat([k_n, k_r[:, :, None].expand(B, T, H, r)], -1)
    logits = torch.einsum("bthe,bshe->bhts", q, k) * layer.scale
    logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def test_qk_clip_brings_forced_large_logit_to_tau():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug")).train()
    layer = model.model.layers[3].self_attn
    assert isinstance(layer, K3MLA)
    with torch.no_grad():
        layer.q_b_proj.weight.view(2, -1, layer.q_b_proj.weight.shape[1])[0] *= 400.0  # head 0 only
        layer.kv_b_proj.weight.mul_(20.0)
    captured = {}
    hook = layer.register_forward_pre_hook(lambda mod, args, kwargs: captured.update(x=args[0]), with_kwargs=True)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    model(ids)
    hook.remove()
    with torch.no_grad():
        before = _true_max_logits(layer, captured)
    torch.testing.assert_close(layer.max_logit, before.clamp(min=0), rtol=1e-5, atol=1e-4)
    tau = 30.0
    assert before[0] > tau and before[1] < tau
    w_head1 = layer.q_b_proj.weight.view(2, -1, layer.q_b_proj.weight.shape[1])[1].clone()
    clipped = apply_qk_clip(model, tau=tau)
    assert list(clipped) == ["model.layers.3.self_attn"]
    assert torch.equal(layer.max_logit, torch.zeros(2))
    with torch.no_grad():
        after = _true_max_logits(layer, captured)
    torch.testing.assert_close(after[0], torch.tensor(tau), rtol=1e-4, atol=1e-4)  # the same argmax, scaled by γ
    assert torch.equal(layer.q_b_proj.weight.view(2, -1, layer.q_b_proj.weight.shape[1])[1], w_head1)


def test_qk_clip_rejects_bad_tau():
    model = K3ForCausalLM(K3Config.from_preset("k3-debug"))
    with pytest.raises(ValueError, match="tau"):
        apply_qk_clip(model, tau=0)


def test_quantile_balancing_equalises_skewed_load():
    torch.manual_seed(0)
    E, K, D, s = 16, 2, 8, 4096
    router = Router(D, E, K, bins=2048, margin_range=2.0).train()
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    x = torch.randn(s, D) + 0.8 * torch.randn(1, D)  # a shared offset skews the scores
    load = lambda idx: torch.bincount(idx.flatten(), minlength=E).float()  # noqa: E731
    ideal = s * K / E
    max_load = []
    for _ in range(8):  # each update uses the cutoffs seen under the previous bias, so it converges over steps
        idx, _ = router(x)
        max_load.append(float(load(idx).max() / ideal))
        assert router.update_bias()
        assert abs(float(router.bias.mean())) < 1e-6
    router.eval()
    idx, weights = router(x)
    max_load.append(float(load(idx).max() / ideal))
    assert max_load[0] > 3.5 and max_load[1] < 1.7 and max_load[-1] < 1.25, max_load
    torch.testing.assert_close(weights.sum(1), torch.ones(s))  # the bias never enters the weights
    assert not router.update_bias()  # nothing recorded in eval mode


def test_model_update_balancing_touches_every_moe_layer():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug")).train()
    model(torch.randint(0, 512, (2, 16)))
    model.update_balancing()
    assert all(float(m.router.bias.abs().sum()) > 0 for m in model.moe_layers())
    assert all(float(m.router.qb_hist.sum()) == 0 for m in model.moe_layers())
