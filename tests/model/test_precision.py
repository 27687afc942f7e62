"""Mixed precision as the trainer runs it: fp32 master parameters under bf16 autocast. CPU autocast reaches the
same grouped-GEMM expert path as CUDA (``torch._grouped_mm`` is not covered by autocast)."""

import torch

from k3infra.model import K3Config, K3ForCausalLM
from k3infra.model.moe import grouped_situ


def test_grouped_experts_take_bf16_activations_with_fp32_weights():
    torch.manual_seed(0)
    P, M, L, C = 4, 16, 32, 40
    x = torch.randn(C, L).to(torch.bfloat16)
    counts = torch.tensor([10, 0, 17, 7])
    w1, w3 = (torch.randn(P, M, L).mul_(L**-0.5).requires_grad_() for _ in range(2))
    w2 = torch.randn(P, L, M).mul_(M**-0.5).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_situ(x, counts, w1, w3, w2, 4.0, 25.0)
    assert y.dtype == torch.bfloat16
    with torch.no_grad():
        ref = grouped_situ(x.float(), counts, w1, w3, w2, 4.0, 25.0)
    assert float((y.float() - ref).norm() / ref.norm()) < 2e-2
    assert float(y[34:].abs().max()) == 0
    y.float().mul(torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    assert w1.grad.dtype == torch.float32 and torch.isfinite(w1.grad).all() and w1.grad[0].abs().sum() > 0
    assert float(w2.grad[1].abs().max()) == 0  # expert 1 got no rows


def test_k3_debug_fp32_params_under_bf16_autocast_trains():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug", kda_backend="torch")).train()
    ids = torch.randint(0, 512, (1, 64))
    cu = torch.tensor([0, 40, 64], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids, cu_seqlens=cu).loss
    loss.backward()
    ref = K3ForCausalLM(K3Config.from_preset("k3-debug", kda_backend="torch")).train()
    ref.load_state_dict(model.state_dict())
    assert abs(float(loss) - float(ref(ids, labels=ids, cu_seqlens=cu).loss)) < 0.05
    moe = model.moe_layers()[0]
    assert moe.w1.dtype == torch.float32 and moe.w1.grad is not None and torch.isfinite(moe.w1.grad).all()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_grouped_experts_rows_past_the_counts_are_zero_in_reused_memory():
    # torch._grouped_mm leaves rows past the last offset unwritten: freed NaN-filled blocks of the same sizes come
    # back from the allocator, so masking by multiplication (NaN * 0) would leak NaN into those rows.
    torch.manual_seed(0)
    P, M, L, C = 4, 16, 32, 40
    x = torch.randn(C, L).to(torch.bfloat16)
    counts = torch.tensor([10, 0, 17, 7])
    w1, w3 = (torch.randn(P, M, L).mul_(L**-0.5) for _ in range(2))
    w2 = torch.randn(P, L, M).mul_(M**-0.5)
    for _ in range(20):
        poison = [torch.full((C, n), float("nan"), dtype=torch.bfloat16) for n in (L, M, M, L)]
        del poison
        y = grouped_situ(x, counts, w1, w3, w2, 4.0, 25.0)
        assert torch.isfinite(y).all() and float(y[34:].abs().max()) == 0


def test_residual_sources_stay_in_the_autocast_dtype():
    # an fp32 embedding source would make every AttnRes output, norm and projection input fp32 under autocast
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug"))
    dtypes = {}
    for name, module in model.named_modules():
        if name.endswith(("attn_res", "ffn_res", "input_layernorm", "post_attention_layernorm", "final_res", "norm")):
            module.register_forward_hook(lambda m, args, out, name=name: dtypes.__setitem__(name, out.dtype))
    ids = torch.randint(0, 512, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}, dtypes
    assert model.model.embed_tokens.weight.grad.dtype == torch.float32
    assert torch.isfinite(model.model.embed_tokens.weight.grad).all()
    model(ids)  # without autocast nothing is cast: fp32 throughout
    assert set(dtypes.values()) == {torch.float32}
