"""`weight_casts.cast_once`: one bf16 copy of each fp32 weight per optimizer step (experts, `layers.Linear`, the
KDA layer's concatenated projections), gradients added straight into ``.grad``; bitwise equal to the plain path (a
cast per micro-batch, autograd's cast and accumulation)."""

import contextlib

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM, moe, weight_casts
from k3infra.model.layers import Linear, shared_input_linears
from k3infra.model.weight_casts import cast_once, compute_weight, compute_weights_cat


def _layer(device="cpu"):
    torch.manual_seed(0)
    layer = moe.K3MoE(K3Config.from_preset("k3-debug")).to(device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _micro_batches(layer, device, n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 16, layer.latent_down.in_features, generator=g).to(device) for _ in range(n)]


def _accumulate(layer, xs, device, once):
    layer.zero_grad(set_to_none=True)
    x_grads = []
    with cast_once() if once else contextlib.nullcontext():
        for x in xs:
            x = x.clone().requires_grad_()
            with torch.autocast(device, dtype=torch.bfloat16):
                y = layer(x)
            (y.float() * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
            x_grads.append(x.grad)
        # the block did take the expert weights (one cast each), not the plain path
        assert not once or {(id(layer.w1),), (id(layer.w2),), (id(layer.w3),)} <= weight_casts._casts.keys()
    return x_grads, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _assert_bitwise_equal(layer, device):
    xs = _micro_batches(layer, device)
    plain = _accumulate(layer, xs, device, once=False)
    ours = _accumulate(layer, xs, device, once=True)
    assert {"w1", "w2", "w3"} <= plain[1].keys() and ours[1].keys() == plain[1].keys()
    for a, b in zip(ours[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, grad in plain[1].items():
        assert ours[1][name].dtype == torch.float32 and ours[1][name].stride() == grad.stride(), name
        torch.testing.assert_close(ours[1][name], grad, rtol=0, atol=0, msg=name)


def test_expert_gradients_over_micro_batches_equal_the_plain_path_bitwise():
    _assert_bitwise_equal(_layer(), "cpu")


@pytest.mark.gpu
def test_expert_gradients_equal_the_plain_path_bitwise_on_cuda():
    _assert_bitwise_equal(_layer("cuda"), "cuda")


def _model_grads(model, batches, device, once):
    model.zero_grad(set_to_none=True)
    with cast_once() if once else contextlib.nullcontext():
        for ids in batches:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        cached = set() if weight_casts._casts is None else {k for keys in weight_casts._casts for k in keys}
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, cached


def _assert_model_bitwise_equal(device, **overrides):
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug", **overrides)).to(device).train()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, model.config.vocab_size, (2, 32), generator=g).to(device) for _ in range(3)]
    plain, _ = _model_grads(model, batches, device, once=False)
    ours, cached = _model_grads(model, batches, device, once=True)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and {id(m.weight) for m in linears} <= cached  # every projection went through the block
    assert ours.keys() == plain.keys()
    for name, grad in plain.items():
        assert ours[name].stride() == grad.stride(), name
        torch.testing.assert_close(ours[name], grad, rtol=0, atol=0, msg=name)


def test_whole_model_gradients_over_micro_batches_equal_the_plain_path_bitwise():
    _assert_model_bitwise_equal("cpu", kda_backend="torch")


@pytest.mark.gpu
def test_whole_model_gradients_equal_the_plain_path_bitwise_on_cuda():
    _assert_model_bitwise_equal("cuda")


def test_concatenated_weights_are_cast_once_and_split_their_gradients():
    mods = (Linear(8, 5, bias=False), Linear(8, 3, bias=False))
    x = torch.randn(4, 8)
    with cast_once():
        first = compute_weights_cat([m.weight for m in mods], torch.bfloat16)
        again = compute_weights_cat([m.weight for m in mods], torch.bfloat16)
        assert first.shape == (8, 8) and again.data_ptr() == first.data_ptr()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = shared_input_linears(x, mods)
        sum(o.float().sum() for o in outs).backward()
    for m, o in zip(mods, outs):
        torch.testing.assert_close(o.float(), (x.bfloat16() @ m.weight.bfloat16().t()).float(), rtol=0, atol=0)
        expected = x.bfloat16().sum(0).float().expand_as(m.weight)
        torch.testing.assert_close(m.weight.grad, expected, rtol=0, atol=0)


def test_each_weight_is_cast_once_per_block_and_dropped_after():
    w = torch.nn.Parameter(torch.randn(4, 8))
    with cast_once():
        a = compute_weight(w, torch.bfloat16)
        b = compute_weight(w, torch.bfloat16)
        assert a.data_ptr() == b.data_ptr() and a.dtype == torch.bfloat16
        assert len(weight_casts._casts) == 1
        with cast_once():  # nested blocks share the outer one's casts
            assert compute_weight(w, torch.bfloat16).data_ptr() == a.data_ptr()
        assert weight_casts._casts is not None
        (a.float().sum() + 2 * b.float().sum()).backward()
    assert weight_casts._casts is None
    torch.testing.assert_close(w.grad, torch.full_like(w, 3.0), rtol=0, atol=0)
    with torch.no_grad():
        w.add_(1.0)
    with cast_once():
        torch.testing.assert_close(compute_weight(w, torch.bfloat16), w.detach().bfloat16(), rtol=0, atol=0)


def test_the_block_ends_on_an_exception():
    w = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(RuntimeError, match="boom"), cast_once():
        compute_weight(w, torch.bfloat16)
        raise RuntimeError("boom")
    assert weight_casts._casts is None


def test_non_leaf_frozen_and_same_dtype_weights_take_the_plain_cast():
    base = torch.randn(4, 8, requires_grad=True)
    frozen = torch.randn(4, 8)
    same = torch.nn.Parameter(torch.randn(4, 8).bfloat16())
    with cast_once():
        view = compute_weight(base * 2, torch.bfloat16)
        assert view.grad_fn is not None and weight_casts._casts == {}
        compute_weight(frozen, torch.bfloat16)
        assert compute_weight(same, torch.bfloat16) is not None and weight_casts._casts == {}
        view.float().sum().backward()
    torch.testing.assert_close(base.grad, torch.full_like(base, 2.0), rtol=0, atol=0)


def test_no_grad_reads_return_the_cast_without_a_graph():
    w = torch.nn.Parameter(torch.randn(4, 8))
    with cast_once(), torch.no_grad():
        out = compute_weight(w, torch.bfloat16)
    assert out.grad_fn is None and not out.requires_grad
