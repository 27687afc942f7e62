"""The fused RMSNorm and SiTU-GLU kernels of `k3infra.model.fused` against the eager autograd Functions of
`k3infra.model.layers` (the reference): forward and backward, fp32 and bf16 inputs, odd row counts and widths that
are not a power of two, and a k3-debug forward/backward through both paths. On CPU the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before triton is imported)."""

import os
import zlib

import pytest
import torch

from k3infra.model import K3Config, K3ForCausalLM, fused, layers

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)",
)

# fp32: kernels and eager differ only in summation order and the tanh formula. bf16: both round the same fp32
# value once, but the interpreter truncates where torch rounds to nearest, so up to 2 bf16 ulps (2^-7 relative).
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def _close(got, ref, dtype, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol["atol"] * scale, rtol=tol["rtol"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 33), (1, 1000)])
def test_rms_norm_matches_eager(device, dtype, shape):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype)).encode()))
    x = (torch.randn(shape, generator=g) * 3).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(device)
    dy = torch.randn(shape, generator=g).to(device, dtype)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    x_f, w_f = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = layers._RMSNormFunction.apply(x_ref, w_ref, 1e-5)
    y = fused.rms_norm(x_f, w_f, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, y_ref, dtype)
    y_ref.backward(dy)
    y.backward(dy)
    assert x_f.grad.dtype == dtype and w_f.grad.dtype == torch.float32
    _close(x_f.grad, x_ref.grad, dtype)
    # dw sums dy·xhat over the rows, so its error grows with sqrt(rows) in bf16 (per-row products rounded alike).
    torch.testing.assert_close(w_f.grad, w_ref.grad, atol=1e-4, rtol=1e-4)


def test_rms_norm_bf16_weight_and_no_weight_grad(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 80, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(80, generator=g).to(device, torch.bfloat16)
    y = fused.rms_norm(x, w, 1e-6)
    y.float().sum().backward()
    assert w.grad is None and x.grad is not None
    x_ref = x.detach().clone().requires_grad_()
    layers._RMSNormFunction.apply(x_ref, w, 1e-6).float().sum().backward()
    _close(y, layers._RMSNormFunction.apply(x.detach(), w, 1e-6), torch.bfloat16)
    _close(x.grad, x_ref.grad, torch.bfloat16, scale=2)
    with pytest.raises(ValueError, match="weight must have shape"):
        fused.rms_norm(x, w[:-1], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 77), (2, 3, 1029), (1, 3)])
def test_situ_glu_matches_eager(device, dtype, shape):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, "situ")).encode()))
    # a and c spread over the bounded and the saturated parts of both tanh factors.
    a = (torch.randn(shape, generator=g) * 6).to(device, dtype)
    c = (torch.randn(shape, generator=g) * 40).to(device, dtype)
    dy = torch.randn(shape, generator=g).to(device, dtype)
    args = [t.clone().requires_grad_() for t in (a, c)]
    ref_args = [t.clone().requires_grad_() for t in (a, c)]
    y = fused.situ_glu(*args, 4.0, 25.0)
    flat = [t.reshape(-1, shape[-1]) for t in ref_args]
    y_ref = layers._SiTUGLUFunction.apply(*flat, 4.0, 25.0).view(shape)
    assert y.dtype == dtype and y.shape == a.shape
    scale = 100.0  # the product is bounded by β1·β2 = 100: tolerances relative to that scale
    _close(y, y_ref, dtype, scale)
    y.backward(dy)
    y_ref.backward(dy)
    for got, ref in zip(args, ref_args):
        assert got.grad.dtype == dtype
        _close(got.grad, ref.grad, dtype, scale)


def test_situ_glu_rejects_mismatched_inputs(device):
    a = torch.zeros(4, 6, device=device)
    with pytest.raises(ValueError, match="a and c must match"):
        fused.situ_glu(a, torch.zeros(4, 7, device=device), 4.0, 25.0)
    with pytest.raises(ValueError, match="a and c must match"):
        fused.situ_glu(a, a.to(torch.bfloat16), 4.0, 25.0)


def test_mode_switch_routes_layers(device, monkeypatch):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    w = torch.ones(8, device=device, requires_grad=True)
    monkeypatch.setattr(fused, "MODE", "off")
    assert layers.rms_norm(x, w, 1e-5).grad_fn.name() == "_RMSNormFunctionBackward"
    monkeypatch.setattr(fused, "MODE", "on")
    assert layers.rms_norm(x, w, 1e-5).grad_fn.name() == "_FusedRMSNormFunctionBackward"
    assert "situ_glu" in layers.situ_glu(x, x, 4.0, 25.0).grad_fn.name().lower()
    assert "Fused" in layers.attn_res_mix([x, x * 2], w, w, 1e-5).grad_fn.name()
    assert layers.rms_norm(x.double(), w, 1e-5).grad_fn.name() != "_FusedRMSNormFunctionBackward"
    monkeypatch.setattr(fused, "MODE", "fast")
    with pytest.raises(ValueError, match="fused.MODE must be one of"):
        layers.rms_norm(x, w, 1e-5)


def test_k3_debug_forward_backward_fused_matches_eager(monkeypatch):
    torch.manual_seed(0)
    # Few experts: on the CPU the fp32 MoE loops over experts, one interpreted launch per expert and direction.
    cfg = K3Config.from_preset("k3-debug", kda_backend="torch", n_routed_experts=4, num_experts_per_tok=2)
    model = K3ForCausalLM(cfg).train()
    ref = K3ForCausalLM(cfg).train()
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (1, 48))
    cu = torch.tensor([0, 29, 48], dtype=torch.int32)
    monkeypatch.setattr(fused, "MODE", "off")
    loss_ref = ref(ids, labels=ids, cu_seqlens=cu).loss
    loss_ref.backward()
    monkeypatch.setattr(fused, "MODE", "on")
    loss = model(ids, labels=ids, cu_seqlens=cu).loss
    loss.backward()
    assert abs(loss.item() - loss_ref.item()) < 1e-4
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert len(grads) > 10
    for name, p in model.named_parameters():
        if name in grads:
            err = float((p.grad - grads[name]).norm() / grads[name].norm().clamp_min(1e-12))
            assert err < 1e-3, (name, err)


@pytest.mark.gpu
def test_fused_kernels_on_cuda_bf16_k3_mini_widths():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 1024, generator=g).cuda().bfloat16().requires_grad_()
    w = torch.randn(1024, generator=g).cuda().requires_grad_()
    y = fused.rms_norm(x, w, 1e-5)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = layers._RMSNormFunction.apply(x_ref, w_ref, 1e-5)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=1e-2)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-2, rtol=1e-3)
    a = (torch.randn(2048, 4864, generator=g) * 6).cuda().bfloat16().requires_grad_()
    c = (torch.randn(2048, 4864, generator=g) * 40).cuda().bfloat16().requires_grad_()
    out = fused.situ_glu(a, c, 4.0, 25.0)
    a_ref, c_ref = a.detach().clone().requires_grad_(), c.detach().clone().requires_grad_()
    out_ref = layers._SiTUGLUFunction.apply(a_ref, c_ref, 4.0, 25.0)
    torch.testing.assert_close(out.float(), out_ref.float(), atol=1.0, rtol=1e-2)
    d = torch.randn_like(out)
    out.backward(d)
    out_ref.backward(d)
    torch.testing.assert_close(a.grad.float(), a_ref.grad.float(), atol=1.0, rtol=1e-2)
    torch.testing.assert_close(c.grad.float(), c_ref.grad.float(), atol=1.0, rtol=1e-2)


def test_elementwise_benchmark_dry_run(caplog):
    from benchmarks.train import elementwise

    before = fused.MODE
    caplog.set_level("INFO")
    assert elementwise.main(["--dry-run", "--rep", "1"]) == 0
    assert "fused matches eager" in caplog.text
    assert fused.MODE == before  # the benchmark restores the switch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,shape", [(2, (5, 48)), (3, (2, 7, 40)), (5, (1, 13, 100))])
def test_attn_res_mix_matches_eager(device, dtype, S, shape):
    g = torch.Generator().manual_seed(zlib.crc32(repr((S, shape, dtype)).encode()))
    D = shape[-1]
    sources = [(torch.randn(shape, generator=g) * (1 + i)).to(device, dtype) for i in range(S)]
    query = torch.randn(D, generator=g).to(device)  # non-zero: a fresh site's zero query gives uniform weights
    nw = (1 + 0.3 * torch.randn(D, generator=g)).to(device)
    dh = torch.randn(shape, generator=g).to(device, dtype)
    leaves = [t.clone().requires_grad_() for t in (query, nw, *sources)]
    ref_leaves = [t.clone().requires_grad_() for t in (query, nw, *sources)]
    out = fused.attn_res_mix(leaves[2:], leaves[0], leaves[1], 1e-5)
    out_ref = layers._AttnResFunction.apply(ref_leaves[0], ref_leaves[1], 1e-5, *ref_leaves[2:])
    assert out.dtype == dtype and out.shape == shape
    _close(out, out_ref, dtype, scale=S)
    out.backward(dh)
    out_ref.backward(dh)
    for i, (got, ref) in enumerate(zip(leaves, ref_leaves)):
        if i < 2:  # query and norm weight: fp32, summed over all rows
            torch.testing.assert_close(got.grad, ref.grad, atol=1e-3, rtol=1e-3)
        else:
            assert got.grad.dtype == dtype
            _close(got.grad, ref.grad, dtype, scale=4)


def test_attn_res_mix_mixed_source_dtypes(device):
    """Autocast leaves an fp32 embedding block beside bf16 layer outputs: each gradient keeps its source's dtype."""
    g = torch.Generator().manual_seed(7)
    shape, D = (2, 9, 40), 40
    sources = [torch.randn(shape, generator=g).to(device, dt) for dt in (torch.float32, torch.bfloat16, torch.bfloat16)]
    query, nw = torch.randn(D, generator=g).to(device), (1 + 0.3 * torch.randn(D, generator=g)).to(device)
    dh = torch.randn(shape, generator=g).to(device)
    leaves = [t.clone().requires_grad_() for t in (query, nw, *sources)]
    ref_leaves = [t.clone().requires_grad_() for t in (query, nw, *sources)]
    out = fused.attn_res_mix(leaves[2:], leaves[0], leaves[1], 1e-5)
    out_ref = layers._AttnResFunction.apply(ref_leaves[0], ref_leaves[1], 1e-5, *ref_leaves[2:])
    assert out.dtype == torch.float32
    _close(out, out_ref, torch.bfloat16, scale=3)
    out.backward(dh)
    out_ref.backward(dh)
    for got, ref in zip(leaves[2:], ref_leaves[2:]):
        assert got.grad.dtype == got.dtype
        _close(got.grad, ref.grad, got.dtype, scale=4)


def test_attn_res_mix_rejects_bad_inputs(device):
    v = torch.zeros(2, 3, 8, device=device)
    q = torch.zeros(8, device=device)
    with pytest.raises(ValueError, match="one shape"):
        fused.attn_res_mix([v, v[:, :2]], q, q, 1e-5)
    with pytest.raises(ValueError, match="query and norm_weight"):
        fused.attn_res_mix([v, v], q[:4], q, 1e-5)


@pytest.mark.gpu
def test_fused_attn_res_on_cuda_bf16_k3_mini_width():
    g = torch.Generator().manual_seed(4)
    leaves = [(0.1 * torch.randn(1024, generator=g)).cuda(), (1 + 0.1 * torch.randn(1024, generator=g)).cuda()]
    leaves += [torch.randn(2, 2048, 1024, generator=g).cuda().bfloat16() for _ in range(8)]
    got = [t.clone().requires_grad_() for t in leaves]
    ref = [t.clone().requires_grad_() for t in leaves]
    out = fused.attn_res_mix(got[2:], got[0], got[1], 1e-5)
    out_ref = layers._AttnResFunction.apply(ref[0], ref[1], 1e-5, *ref[2:])
    torch.testing.assert_close(out.float(), out_ref.float(), atol=2e-2, rtol=1e-2)
    dh = torch.randn_like(out)
    out.backward(dh)
    out_ref.backward(dh)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=2e-2, rtol=1e-2)


def test_mode_starts_from_the_environment():
    import subprocess
    import sys

    code = "from k3infra.model import fused; print(fused.MODE)"
    unset = {k: v for k, v in os.environ.items() if k != "K3_FUSED_ELEMENTWISE"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for env in ({**unset, "K3_FUSED_ELEMENTWISE": "off"}, unset)]
    assert [p.communicate(timeout=300)[0].strip() for p in procs] == ["off", "auto"]


@pytest.mark.gpu
def test_k3_debug_autocast_step_fused_matches_eager(monkeypatch):
    """The training step's real mix of dtypes (bf16 autocast layer outputs): the fused kernels' loss and gradients
    are no further from the fp32 step (autocast off, eager) than the eager bf16 step's. The two bf16 steps are not
    compared with each other: each rounds differently, and top-k routing turns a rounding into another expert."""
    torch.manual_seed(0)
    cfg = K3Config.from_preset("k3-debug", kda_backend="flashkda")
    model = K3ForCausalLM(cfg).cuda().train()
    ids = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    losses, grads = [], []
    for mode, bf16 in (("off", False), ("off", True), ("auto", True)):
        monkeypatch.setattr(fused, "MODE", mode)
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]))
    (loss_fp32, loss_eager, loss_fused), (fp32, eager, fused_grads) = losses, grads
    assert abs(loss_fused - loss_fp32) <= 1.1 * abs(loss_eager - loss_fp32) + 1e-3
    eager_err, fused_err = (eager - fp32).norm() / fp32.norm(), (fused_grads - fp32).norm() / fp32.norm()
    assert eager_err < 0.1, f"the eager bf16 step is {eager_err:.3f} from fp32: the reference itself is off"
    assert fused_err <= 1.1 * eager_err, f"fused {fused_err:.4f} vs eager {eager_err:.4f} from the fp32 step"


def test_compiled_graph_calls_the_situ_glu_operators(fused_on, device):
    import torch._dynamo.testing

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    a0 = (torch.randn(37, 24, generator=g) * 6).to(device)
    c0 = (torch.randn(37, 24, generator=g) * 40).to(device)
    dy = torch.randn(37, 24, generator=g).to(device)

    def step(a, c):
        return (layers.situ_glu(a, c, 4.0, 25.0) * 2).sum(0)

    results = []
    for compiled in (False, True):
        a, c = a0.clone().requires_grad_(), c0.clone().requires_grad_()
        counts = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        fn = torch.compile(step, backend=counts, fullgraph=True) if compiled else step
        out = fn(a, c)
        out.backward(dy.sum(0))
        results.append((out.detach(), a.grad, c.grad))
        if compiled:
            assert counts.frame_count == 1
            assert "k3infra.fused_situ_glu" in "\n".join(str(gm.graph) for gm in counts.graphs)
    for got, ref in zip(results[1], results[0]):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
