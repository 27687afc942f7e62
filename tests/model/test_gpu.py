"""CUDA paths of the model: FlashKDA / fla KDA backends against the torch path, the grouped-GEMM experts against
the expert loop, decode through FlashKDA's recurrent kernel, and a bf16 k3-mini training step."""

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM
from k3infra.model.kda import K3KDA
from k3infra.model.moe import grouped_situ

pytestmark = pytest.mark.gpu

SMALL = dict(kda_num_heads=2, kda_head_dim=128, hidden_size=128, moe_latent_size=64, vocab_size=1024)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.parametrize("backend", ["flashkda", "fla"])
def test_kda_kernel_backend_matches_torch(backend):
    if backend == "fla":
        pytest.importorskip("fla.ops.kda")
    config = K3Config.from_preset("k3-debug", **SMALL)
    torch.manual_seed(0)
    layer = K3KDA(config, 0).cuda()
    layer.reset_kda_parameters()
    x = torch.randn(1, 300, 128, device="cuda", requires_grad=True)
    cu = torch.tensor([0, 100, 137, 300], dtype=torch.int32, device="cuda")
    outs, grads = {}, {}
    for name in ("torch", backend):
        layer.backend = name
        y = layer(x, cu_seqlens=cu)
        (g,) = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel(), device="cuda").view_as(y)).sum(), [x])
        outs[name], grads[name] = y, g
    assert _rel(outs[backend], outs["torch"]) < 2e-3
    assert _rel(grads[backend], grads["torch"]) < 5e-3


def test_grouped_gemm_equals_loop():
    torch.manual_seed(0)
    P, M, L, C = 4, 32, 64, 40
    x = torch.randn(C, L, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([10, 0, 17, 7], device="cuda")  # 34 of 40 rows used
    w1, w3 = (torch.randn(P, M, L, device="cuda", dtype=torch.bfloat16) * L**-0.5 for _ in range(2))
    w2 = torch.randn(P, L, M, device="cuda", dtype=torch.bfloat16) * M**-0.5
    fast = grouped_situ(x, counts, w1, w3, w2, 4.0, 25.0)
    loop = grouped_situ(x.float(), counts, w1.float(), w3.float(), w2.float(), 4.0, 25.0)
    assert _rel(fast, loop) < 2e-2
    assert float(fast[34:].abs().max()) == 0


def test_generate_on_cuda_equals_full_forward_argmax():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug", **SMALL)).cuda().eval()
    prompt = torch.randint(0, 1024, (2, 9), device="cuda")
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        seq = prompt
        for _ in range(5):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(generated, seq)


def test_k3_mini_bf16_training_step():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-mini")).cuda().to(torch.bfloat16).train()
    ids = torch.randint(0, 32768, (1, 4096), device="cuda")
    cu = torch.tensor([0, 1000, 4096], dtype=torch.int32, device="cuda")
    loss = model(ids, labels=ids, cu_seqlens=cu).loss
    loss.backward()
    assert abs(float(loss) - 10.4) < 1.0  # ln(32768) = 10.4 at init
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
