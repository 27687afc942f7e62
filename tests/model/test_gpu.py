"""CUDA paths of the model at small shapes (each test well under 30 s on an H200, Triton compilation included):
FlashKDA / fla KDA backends against the torch path, the grouped-GEMM experts against the expert loop (bf16
activations with fp32 master weights, as under autocast), decode through FlashKDA's recurrent kernel, and a
small-model training step as the trainer runs it (fp32 parameters, bf16 autocast, activation checkpointing).

Each test runs under a wall-clock guard (`GPU_TEST_BUDGET_S`, SIGALRM; no pytest-timeout needed) so one slow
compilation fails its test instead of stalling the whole device call."""

import os
import signal
import time

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM
from k3infra.model.kda import K3KDA
from k3infra.model.moe import grouped_situ

pytestmark = pytest.mark.gpu

SMALL = dict(kda_num_heads=2, kda_head_dim=128, hidden_size=128, moe_latent_size=64, vocab_size=1024)
GPU_TEST_BUDGET_S = float(os.environ.get("K3_GPU_TEST_BUDGET_S", "60"))


@pytest.fixture(autouse=True)
def wall_clock_guard():
    """Fail a test that runs longer than `GPU_TEST_BUDGET_S` (main thread, POSIX)."""

    def expire(signum, frame):
        raise TimeoutError(f"GPU test exceeded its {GPU_TEST_BUDGET_S:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, GPU_TEST_BUDGET_S)
    begin = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    print(f"[{time.perf_counter() - begin:.1f} s]")


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
    x = torch.randn(1, 160, 128, device="cuda", requires_grad=True)
    cu = torch.tensor([0, 64, 97, 160], dtype=torch.int32, device="cuda")
    outs, grads = {}, {}
    for name in ("torch", backend):
        layer.backend = name
        y = layer(x, cu_seqlens=cu)
        (g,) = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel(), device="cuda").view_as(y)).sum(), [x])
        outs[name], grads[name] = y, g
    assert _rel(outs[backend], outs["torch"]) < 2e-3
    assert _rel(grads[backend], grads["torch"]) < 5e-3


def test_grouped_gemm_equals_loop_with_fp32_weights():
    torch.manual_seed(0)
    P, M, L, C = 4, 32, 64, 40
    x = torch.randn(C, L, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([10, 0, 17, 7], device="cuda")  # 34 of 40 rows used
    w1, w3 = (torch.randn(P, M, L, device="cuda").mul_(L**-0.5).requires_grad_() for _ in range(2))
    w2 = torch.randn(P, L, M, device="cuda").mul_(M**-0.5).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = grouped_situ(x, counts, w1, w3, w2, 4.0, 25.0)
    with torch.no_grad():
        loop = grouped_situ(x.float(), counts, w1, w3, w2, 4.0, 25.0)
    assert fast.dtype == torch.bfloat16 and _rel(fast, loop) < 2e-2
    assert float(fast[34:].abs().max()) == 0
    fast.float().mul(torch.randn_like(fast, dtype=torch.float32)).sum().backward()
    assert w1.grad.dtype == torch.float32 and torch.isfinite(w1.grad).all()


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


@pytest.mark.parametrize("checkpointing", [False, True])
def test_autocast_training_step_fp32_params(checkpointing):
    """The trainer's precision: fp32 parameters, bf16 autocast, packed input, chunked loss; with and without
    activation checkpointing (FlashKDA's backward under non-reentrant checkpointing)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-debug", **SMALL, loss_chunk_size=256)).cuda().train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 1024, (1, 1024), device="cuda")
    cu = torch.tensor([0, 300, 1024], dtype=torch.int32, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(ids, labels=ids, cu_seqlens=cu)
    out.loss.backward()
    assert out.logits is None  # chunked loss: no [T, V] logits kept
    assert abs(float(out.loss) - 6.93) < 1.0  # ln(1024) at init
    assert model.moe_layers()[0].w1.grad is not None
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("lengths", [(300, 1, 723), (1024,)])
def test_packed_causal_flash_matches_per_sequence_sdpa(lengths):
    from k3infra.model.mla import packed_causal_flash, uses_varlen_flash

    torch.manual_seed(0)
    T, H, E, V = sum(lengths), 4, 192, 128
    q, k = (torch.randn(1, H, T, E, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, H, T, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    assert uses_varlen_flash(q)
    do = torch.randn(1, H, T, V, device="cuda", dtype=torch.bfloat16)
    o = packed_causal_flash(q, k, v, cu, bounds, E**-0.5)
    grads = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(qf[:, :, a:b], kf[:, :, a:b], vf[:, :, a:b],
                                                                      is_causal=True, scale=E**-0.5)
                     for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.double())
    for name, x, y in (("o", o, ref), *zip(("dq", "dk", "dv"), grads, ref_grads)):
        err = ((x.double() - y).norm() / y.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"
