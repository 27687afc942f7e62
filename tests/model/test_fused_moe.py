"""The local expert path's kernels against fp64: `fused_moe.slot_sum` (each token's slot rows summed) and the
row-scaled SiTU-GLU of `fused.situ_glu` (the routing weights inside the activation, with their gradient). On CPU
the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py)."""

import os
import zlib

import pytest
import torch

from k3infra.model import fused, fused_moe, layers

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)",
)


def _slots(s, K, g, dtype=torch.int64):
    return torch.randperm(s * K, generator=g).view(s, K).to(dtype)


@pytest.mark.parametrize("src_dtype, out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("s, K, L", [(7, 3, 5), (9, 8, 600), (1, 1, 1), (0, 2, 4)])
def test_slot_sum_matches_fp64(fused_on, device, src_dtype, out_dtype, s, K, L):
    g = torch.Generator().manual_seed(zlib.crc32(repr((s, K, L, src_dtype, out_dtype)).encode()))
    src = torch.randn(s * K, L, generator=g).to(src_dtype)
    slots = _slots(s, K, g)
    got = fused_moe.slot_sum(src.to(device), slots.to(device), out_dtype)
    ref = src.double()[slots.flatten()].view(s, K, L).sum(1)
    assert got.shape == (s, L) and got.dtype == out_dtype
    # fp32 sums: summation order only; a bf16 result: one rounding of the fp32 sum
    tol = 1e-6 if out_dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.cpu().double(), ref, rtol=tol, atol=tol)


def test_slot_sum_takes_int32_slots_and_equals_the_torch_path(fused_on, device, monkeypatch):
    g = torch.Generator().manual_seed(4)
    src = torch.randn(30, 24, generator=g).bfloat16().to(device)
    slots = _slots(10, 3, g, torch.int32).to(device)
    got = fused_moe.slot_sum(src, slots, torch.float32)
    monkeypatch.setattr(fused, "MODE", "off")
    torch.testing.assert_close(got, fused_moe.slot_sum(src, slots, torch.float32), rtol=1e-6, atol=1e-6)


def test_slot_sum_names_bad_arguments():
    with pytest.raises(ValueError, match="src_CL must be"):
        fused_moe.slot_sum(torch.zeros(4), torch.zeros(2, 2, dtype=torch.int64), torch.float32)
    with pytest.raises(ValueError, match="slots_sK must be"):
        fused_moe.slot_sum(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64), torch.float32)
    with pytest.raises(ValueError, match="slots_sK must be"):
        fused_moe.slot_sum(torch.zeros(4, 3), torch.zeros(2, 2), torch.float32)


def _situ64(a, c, scale, b1=4.0, b2=25.0):
    return (b1 * torch.tanh(a / b1) * torch.sigmoid(a)) * (b2 * torch.tanh(c / b2)) * scale[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 77), (19, 300), (3, 2, 40)])
def test_scaled_situ_glu_matches_fp64(fused_on, device, dtype, shape):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, "scaled")).encode()))
    a = (torch.randn(shape, generator=g) * 6).to(dtype)
    c = (torch.randn(shape, generator=g) * 40).to(dtype)
    scale = torch.rand(shape[:-1], generator=g) + 0.1
    dy = torch.randn(shape, generator=g).to(dtype)
    args = [t.clone().to(device).requires_grad_() for t in (a, c, scale)]
    y = layers.situ_glu(args[0], args[1], 4.0, 25.0, args[2])
    node = y.grad_fn
    while "View" in node.name():
        node = node.next_functions[0][0]
    assert "scaled" in node.name().lower()
    y.backward(dy.to(device))
    ref_args = [t.double().requires_grad_() for t in (a, c, scale)]
    y_ref = _situ64(*ref_args)
    y_ref.backward(dy.double())
    assert y.dtype == dtype and args[2].grad.dtype == torch.float32
    # the product is bounded by β1·β2 = 100; fp32 kernels differ from fp64 in rounding only, bf16 by one (two in
    # the interpreter, which truncates) bf16 rounding of each output
    rel = 2e-6 if dtype == torch.float32 else 2 ** -7
    for got, ref, scale_of in zip((y, *(t.grad for t in args)), (y_ref, *(t.grad for t in ref_args)),
                                  (100, 100, 100, 100 * shape[-1])):
        torch.testing.assert_close(got.detach().cpu().double(), ref.detach(), rtol=rel, atol=rel * scale_of)


def test_scaled_situ_glu_equals_scaling_after_the_activation_in_fp32(fused_on, device):
    g = torch.Generator().manual_seed(6)
    a, c = (torch.randn(11, 33, generator=g) * 3).to(device), (torch.randn(11, 33, generator=g) * 30).to(device)
    scale = torch.rand(11, generator=g).to(device)
    torch.testing.assert_close(fused.situ_glu(a, c, 4.0, 25.0, scale),
                               fused.situ_glu(a, c, 4.0, 25.0) * scale[:, None], rtol=1e-6, atol=1e-6)


def test_scaled_situ_glu_names_a_bad_scale(device):
    a = torch.zeros(4, 6, device=device)
    with pytest.raises(ValueError, match="scale must be a floating-point tensor of shape"):
        fused.situ_glu(a, a, 4.0, 25.0, torch.zeros(6, device=device))
    with pytest.raises(ValueError, match="scale must be a floating-point tensor of shape"):
        fused.situ_glu(a, a, 4.0, 25.0, torch.zeros(4, dtype=torch.int64, device=device))


def test_operators_pass_opcheck(device):
    """Fake (meta) kernels agree with the real ones in shapes, strides and dtypes, which compiled graphs assert."""
    g = torch.Generator().manual_seed(7)
    src = torch.randn(12, 20, generator=g).bfloat16().to(device)
    slots = _slots(4, 3, g).to(device)
    torch.library.opcheck(fused_moe._slot_sum_op, (src, slots, torch.float32),
                          test_utils=("test_schema", "test_faketensor"))
    a, c, dy = (torch.randn(6, 20, generator=g).to(device) for _ in range(3))
    scale = torch.rand(6, generator=g).to(device)
    torch.library.opcheck(fused._situ_glu_scaled_op, (a, c, scale, 4.0, 25.0),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(fused._situ_glu_scaled_bwd_op, (a, c, scale, dy, 4.0, 25.0),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_local_moe_kernels_at_k3_mini_widths_on_cuda():
    """k3-mini's local path on the GPU: 32,768 tokens × top-8 slots of the 512-wide latent, 128-wide experts."""
    g = torch.Generator().manual_seed(8)
    s, K, L, M = 32768, 8, 512, 128
    src = torch.randn(s * K, L, generator=g).bfloat16()
    slots = _slots(s, K, g)
    got = fused_moe.slot_sum(src.cuda(), slots.cuda(), torch.float32)
    ref = src.double()[slots.flatten()].view(s, K, L).sum(1)
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-6, atol=1e-5)
    a, c = (torch.randn(s * K, M, generator=g) * 4).bfloat16(), (torch.randn(s * K, M, generator=g) * 30).bfloat16()
    scale = torch.rand(s * K, generator=g)
    args = [t.cuda().requires_grad_() for t in (a, c, scale)]
    y = fused.situ_glu(args[0], args[1], 4.0, 25.0, args[2])
    dy = torch.randn(s * K, M, generator=g).bfloat16()
    y.backward(dy.cuda())
    ref_args = [t.double().requires_grad_() for t in (a, c, scale)]
    y_ref = _situ64(*ref_args)
    y_ref.backward(dy.double())
    for got, ref, scale_of in zip((y, *(t.grad for t in args)), (y_ref, *(t.grad for t in ref_args)),
                                  (100, 100, 100, 100 * M)):
        torch.testing.assert_close(got.detach().cpu().double(), ref.detach(), rtol=2 ** -8, atol=2 ** -8 * scale_of)


def test_compiled_local_moe_calls_both_operators(fused_on, device):
    """A bf16 MoE layer (grouped GEMMs, local experts) compiled whole: its graphs call ``k3infra::slot_sum`` (forward
    combine, and the sorted copies' backward) and the row-scaled SiTU-GLU, with the eager layer's results."""
    import torch._dynamo.testing

    from k3infra.model import K3Config, moe

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = moe.K3MoE(K3Config.from_preset("k3-debug")).to(device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x0 = torch.randn(2, 24, layer.latent_down.in_features, device=device)
    results = []
    for compiled in (False, True):
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        counts = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        fn = torch.compile(layer, backend=counts) if compiled else layer
        with torch.autocast(device, dtype=torch.bfloat16):
            y = fn(x)
        y.float().square().sum().backward()
        results.append((y.detach().float(), x.grad, layer.w1.grad.clone(), layer.router.weight.grad.clone()))
        if compiled:
            # the autograd Functions' forward and backward bodies are submodules of the graph
            graphs = "\n".join(str(m.graph) for gm in counts.graphs for m in gm.modules() if hasattr(m, "graph"))
            assert "k3infra.slot_sum" in graphs and "k3infra.fused_situ_glu_scaled" in graphs
    for got, ref in zip(results[1], results[0]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_moe_benchmark_dry_run_and_bad_arguments():
    """`benchmarks.train.moe --dry-run`: both variants of a k3-debug layer on the CPU, ours within twice torch's
    error against fp64; bad arguments are named."""
    from benchmarks.train import moe as bench

    assert bench.main(["--dry-run"]) == 0
    with pytest.raises(SystemExit, match="--model"):
        bench.main(["--dry-run", "--model", "[1]"])
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--tokens", "0"])
