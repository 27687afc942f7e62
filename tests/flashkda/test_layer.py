"""`flashkda.KimiDeltaAttention`: an fp64 composition oracle, decode == prefill, padding, options, bad input, and
(on a GPU with fla's layers installed) equality with ``fla.layers.KimiDeltaAttention`` under copied weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from flashkda.layer import KDACache, KimiDeltaAttention
from flashkda.reference import chunk_kda_reference

HAS_FLA_LAYERS = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("fla.layers") is not None

CONFIGS = [
    pytest.param(dict(hidden_size=64, head_dim=32, num_heads=2), id="H2-D32-softplus-gate"),
    pytest.param(dict(hidden_size=48, head_dim=32, num_heads=1, num_v_heads=2, lower_bound=-5.0, safe_gate=True),
                 id="GVA-lower-bound"),
    pytest.param(dict(hidden_size=64, head_dim=32, num_heads=2, expand_v=2, full_rank_gate=True,
                      full_rank_output_gate=True, allow_neg_eigval=True, conv_bias=True), id="full-rank-expand-v2"),
    pytest.param(dict(hidden_size=64, head_dim=32, num_heads=2, use_short_conv=False), id="no-short-conv"),
]


def _reference_layer(layer: KimiDeltaAttention, x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's math in float64 from parameters ``p`` (float64, by name): torch Conv1d, the fp64 recurrent KDA
    oracle, RMSNorm and the sigmoid output gate. ``layer`` only supplies the configuration."""
    x = x.double()
    B, T, _ = x.shape

    def proj(name: str, inp: torch.Tensor) -> torch.Tensor:
        return F.linear(inp, p[f"{name}.weight"], p.get(f"{name}.bias"))

    def seq(name: str, inp: torch.Tensor) -> torch.Tensor:
        if f"{name}.weight" in p:
            return proj(name, inp)
        return proj(f"{name}.1", proj(f"{name}.0", inp))

    def conv(name: str, inp: torch.Tensor) -> torch.Tensor:
        if not layer.use_short_conv:
            return F.silu(inp)
        w = p[f"{name}.weight"]
        y = F.conv1d(inp.transpose(1, 2), w, p.get(f"{name}.bias"), padding=w.shape[-1] - 1, groups=w.shape[0])
        return F.silu(y[..., :T].transpose(1, 2))

    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    q = conv("q_conv1d", proj("q_proj", x)).reshape(B, T, H, K)
    k = conv("k_conv1d", proj("k_proj", x)).reshape(B, T, H, K)
    v = conv("v_conv1d", proj("v_proj", x)).reshape(B, T, HV, V)
    g = seq("f_proj", x).reshape(B, T, HV, K)
    beta = proj("b_proj", x)
    o, _ = chunk_kda_reference(q, k, v, g, beta, scale=K**-0.5, use_qk_l2norm_in_kernel=True,
                               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                               allow_neg_eigval=layer.allow_neg_eigval, lower_bound=layer.lower_bound,
                               A_log=p["A_log"], dt_bias=p["dt_bias"])
    gate = seq("g_proj", x).reshape(B, T, HV, V)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * p["o_norm.weight"]
    o = (o * torch.sigmoid(gate)).reshape(B, T, HV * V)
    return proj("o_proj", o)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("config", CONFIGS)
def test_layer_matches_fp64_composition_and_its_gradients(config: dict, device: str) -> None:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(layer_idx=0, **config).to(device)
    x = torch.randn(2, 70, config["hidden_size"], device=device, requires_grad=True)
    y, attn, cache = layer(x)
    assert attn is None and cache is None and y.shape == x.shape

    params = dict(layer.named_parameters())
    ref_params = {name: t.detach().double().requires_grad_() for name, t in params.items()}
    x64 = x.detach().double().requires_grad_()
    ref = _reference_layer(layer, x64, ref_params)
    assert _rel_rms(y, ref) <= 1e-4

    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *params.values()], dy)
    ref_grads = torch.autograd.grad(ref, [x64, *ref_params.values()], dy.double())
    for name, ours, want in zip(["x", *params], grads, ref_grads):
        assert _rel_rms(ours, want) <= 1e-4, name


@pytest.mark.parametrize("config", CONFIGS[:3])
def test_prefill_then_decode_equals_full_forward(config: dict, device: str) -> None:
    torch.manual_seed(1)
    layer = KimiDeltaAttention(layer_idx=0, **config).to(device).eval()
    x = torch.randn(2, 40, config["hidden_size"], device=device)
    with torch.no_grad():
        full, _, _ = layer(x)
        cache = KDACache()
        outs = [layer(x[:, :29], past_key_values=cache, use_cache=True)[0]]
        for t in range(29, 40):
            outs.append(layer(x[:, t : t + 1], past_key_values=cache, use_cache=True)[0])
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-4, atol=1e-5)
    state = cache[0]
    HV, K, V = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    assert state["recurrent_state"].shape == (2, HV, V, K) and state["recurrent_state"].dtype == torch.float32
    assert [c.shape for c in state["conv_state"]] == [(2, layer.key_dim, 4), (2, layer.key_dim, 4),
                                                     (2, layer.value_dim, 4)]
    assert cache.seen_tokens == 40


def test_padding_mask_equals_separate_sequences(device: str) -> None:
    torch.manual_seed(2)
    layer = KimiDeltaAttention(hidden_size=64, head_dim=32, num_heads=2, layer_idx=0).to(device)
    a, b = torch.randn(1, 30, 64, device=device), torch.randn(1, 17, 64, device=device)
    x = torch.zeros(2, 30, 64, device=device)
    x[0], x[1, 13:] = a[0], b[0]
    mask = torch.zeros(2, 30, dtype=torch.long, device=device)
    mask[0], mask[1, 13:] = 1, 1
    y, _, _ = layer(x, attention_mask=mask)
    torch.testing.assert_close(y[0], layer(a)[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y[1, 13:], layer(b)[0][0], rtol=1e-4, atol=1e-5)
    assert not y[1, :13].any()
    packed = torch.cat([a, b], 1)
    yp, _, _ = layer(packed, cu_seqlens=torch.tensor([0, 30, 47], device=device))
    torch.testing.assert_close(yp[0, 30:], y[1, 13:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        pytest.param(dict(num_heads=0), "num_heads", id="num_heads"),
        pytest.param(dict(head_dim=-1), "head_dim", id="head_dim"),
        pytest.param(dict(num_v_heads=3, num_heads=2), "num_v_heads", id="num_v_heads"),
        pytest.param(dict(expand_v=0.3), "expand_v", id="expand_v"),
        pytest.param(dict(mode="parallel"), "mode", id="mode"),
        pytest.param(dict(lower_bound=-7.0), "lower_bound", id="lower_bound"),
        pytest.param(dict(safe_gate=True), "safe_gate", id="safe_gate"),
        pytest.param(dict(conv_size=0), "conv_size", id="conv_size"),
    ],
)
def test_invalid_constructor_arguments_name_the_argument(kwargs: dict, needle: str) -> None:
    base = dict(hidden_size=64, head_dim=32, num_heads=2)
    with pytest.raises(ValueError, match=needle):
        KimiDeltaAttention(**{**base, **kwargs})


def test_invalid_forward_inputs_raise(device: str) -> None:
    layer = KimiDeltaAttention(hidden_size=64, head_dim=32, num_heads=2).to(device)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(2, 5, 32, device=device))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 5, 64, device=device), attention_mask=torch.ones(2, 4, device=device))
    with pytest.raises(ValueError, match="layer_idx"):
        layer(torch.randn(1, 5, 64, device=device), past_key_values=KDACache(), use_cache=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(2, 5, 64, device=device), cu_seqlens=torch.tensor([0, 5], device=device))


@pytest.mark.skipif(not HAS_FLA_LAYERS, reason="flash-linear-attention (fla.layers) not installed")
def test_parameter_names_match_fla_layer() -> None:
    from fla.layers import KimiDeltaAttention as FlaKDA

    kw = dict(hidden_size=64, head_dim=32, num_heads=2, num_v_heads=4, lower_bound=-5.0, safe_gate=True)
    ours, theirs = KimiDeltaAttention(**kw), FlaKDA(**kw)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLA_LAYERS, reason="flash-linear-attention (fla.layers) not installed")
@pytest.mark.parametrize("config", CONFIGS[:2])
def test_layer_matches_fla_layer_with_copied_weights(config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from fla.layers import KimiDeltaAttention as FlaKDA

    monkeypatch.setenv("FLASHKDA_DISABLE", "1")  # fla's layer must run fla's kernels, not ours via the backend

    torch.manual_seed(3)
    ours = KimiDeltaAttention(layer_idx=0, **config).cuda()
    theirs = FlaKDA(layer_idx=0, **config).cuda()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 300, config["hidden_size"], device="cuda", requires_grad=True)
    y, _, _ = ours(x)
    yr, _, _ = theirs(x)
    assert _rel_rms(y, yr) <= 2e-3
    dy = torch.randn_like(y)
    g = torch.autograd.grad(y, [x, *ours.parameters()], dy)
    gr = torch.autograd.grad(yr, [x, *theirs.parameters()], dy)
    for name, a, b in zip(["x", *dict(ours.named_parameters())], g, gr):
        assert _rel_rms(a, b) <= 5e-3, name


@pytest.mark.parametrize("steps", [1, 4])
def test_decode_steps_launch_the_recurrent_kernel(steps: int, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-4 token no-grad step through the layer reaches the Triton recurrent kernel, not a Python loop, and its
    state continues the chunk path's state (same layout)."""
    import flashkda.decode as decode

    launches = []
    launch = decode.fused_recurrent_kda_fwd

    def spy(*args, **kwargs):
        launches.append(args[0].shape)
        return launch(*args, **kwargs)

    monkeypatch.setattr(decode, "fused_recurrent_kda_fwd", spy)
    torch.manual_seed(2)
    layer = KimiDeltaAttention(layer_idx=0, hidden_size=64, head_dim=32, num_heads=2, lower_bound=-5.0,
                               safe_gate=True).to(device).eval()
    x = torch.randn(2, 20 + steps, 64, device=device)
    with torch.no_grad():
        full, _, _ = layer(x)
        cache = KDACache()
        prefix, _, _ = layer(x[:, :20], past_key_values=cache, use_cache=True)
        assert launches == []  # prefill runs the chunk path
        step, _, _ = layer(x[:, 20:], past_key_values=cache, use_cache=True)
    assert launches == [torch.Size([2, steps, 2, 32])]
    torch.testing.assert_close(torch.cat([prefix, step], 1), full, rtol=1e-4, atol=1e-5)
