"""The fused short-convolution kernel (`k3infra.model.fused_conv.conv_silu`) against the eager
``F.silu(causal_depthwise_conv(...))``: forward and backward (``u`` and the taps), packed sequences and batched rows,
fp32 and bf16, widths that are not a multiple of the block, and a KDA layer through both paths. On CPU the kernels
run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before triton is imported)."""

import os

import pytest
import torch
import torch.nn.functional as F

from k3infra.model import K3Config, fused
from k3infra.model.fused_conv import conv_silu
from k3infra.model.kda import K3KDA, causal_depthwise_conv, positions_in_sequence

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _eager(u, w, pos):
    return F.silu(causal_depthwise_conv(u, w, None, pos))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, D, W, cu", [(1, 150, 96, 4, [0, 1, 70, 73, 150]), (3, 37, 200, 3, None),
                                            (1, 9, 64, 4, [0, 9])])
def test_conv_silu_matches_eager(dtype, B, T, D, W, cu):
    g = torch.Generator().manual_seed(T * D + W)
    u = torch.randn(B, T, D, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(D, W, generator=g) / W**0.5).to(DEVICE).requires_grad_()
    dy = torch.randn(B, T, D, generator=g).to(DEVICE, dtype)
    pos = positions_in_sequence(T, None if cu is None else torch.tensor(cu), torch.device(DEVICE))
    y = conv_silu(u, w, pos)
    du, dw = torch.autograd.grad(y, (u, w), dy)
    uf, wf = (x.detach().double().requires_grad_() for x in (u, w))
    ref = _eager(uf, wf, pos)
    du_ref, dw_ref = torch.autograd.grad(ref, (uf, wf), dy.double())
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    for name, got, want in (("y", y, ref), ("du", du, du_ref), ("dw", dw, dw_ref)):
        err = float((got.detach().double() - want.detach()).norm() / want.detach().norm())
        assert err < tol, f"{name}: relative error {err:.2e}"
    assert y.dtype == dtype and du.dtype == dtype and dw.dtype == w.dtype


@pytest.mark.parametrize("W", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("seg, rows, pad", [pytest.param(4, 2, 0, id="SEG4-ROWS2-contiguous"),
                                            pytest.param(8, 4, 3, id="SEG8-ROWS4-stride163")])
def test_conv_silu_across_segments(monkeypatch, W, seg, rows, pad):
    """Both kernels walk segments of SEG rows (set small here, so most rows sit near a segment edge and
    W - 1 > SEG for W = 6) against fp64 autograd: N = 61 not a multiple of SEG, sequences ending inside a segment
    (5, 19, 20: a one-token sequence, 33) and on its edge (16 for both SEG), the last one long enough for unmasked
    groups at every W, D = 80 over 32-channel blocks, ``u`` a column slice with an odd row stride. A wrong window
    before or after a segment shows in ``y`` and ``du`` of its edge rows and in ``dw``."""
    from k3infra.model import fused_conv

    for kernel in ("FWD", "BWD"):
        monkeypatch.setattr(fused_conv, f"_{kernel}_SEG", seg)
        monkeypatch.setattr(fused_conv, f"_{kernel}_ROWS", rows)
        monkeypatch.setattr(fused_conv, f"_{kernel}_BLOCK_D", 32)
    g = torch.Generator().manual_seed(W * 100 + seg)
    N, D = 61, 80
    wide = torch.randn(1, N, 2 * D + pad, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(D, W, generator=g) / W**0.5).to(DEVICE).requires_grad_()
    dy = torch.randn(1, N, D, generator=g).to(DEVICE)
    pos = positions_in_sequence(N, torch.tensor([0, 5, 16, 19, 20, 33, 61]), torch.device(DEVICE))
    y = conv_silu(wide[..., pad:pad + D], w, pos)
    du, dw = torch.autograd.grad(y, (wide, w), dy)
    uf, wf = (x.detach().double().requires_grad_() for x in (wide[..., pad:pad + D], w))
    y_ref = _eager(uf, wf, pos)
    du_ref, dw_ref = torch.autograd.grad(y_ref, (uf, wf), dy.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(du[..., pad:pad + D].double(), du_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_conv_silu_at_a_k3_mini_micro_batch_matches_fp64():
    """The shipped kernel configuration on CUDA at one k3-mini micro-batch (32,768 tokens in packed sequences, 1,024
    channels read as the column slice of a ``[32768, 3208]`` projection output, bf16, W = 4): ``y``, ``du`` and
    ``dw`` within bf16 rounding of fp64 autograd, the same bound the eager bf16 chain meets."""
    g = torch.Generator().manual_seed(0)
    N, D, W = 32768, 1024, 4
    full = torch.randn(N, 3208, generator=g).to("cuda", torch.bfloat16)
    u = full[:, D:2 * D]
    w = (torch.randn(D, W, generator=g) / W**0.5).to("cuda", torch.bfloat16)
    dy = torch.randn(1, N, D, generator=g).to("cuda", torch.bfloat16)
    pos = positions_in_sequence(N, torch.tensor([0, 8192, 16384, 20480, N]), torch.device("cuda"))
    u_leaf, w_leaf = u.detach().requires_grad_(), w.detach().requires_grad_()
    y = conv_silu(u_leaf[None], w_leaf, pos)
    du, dw = torch.autograd.grad(y, (u_leaf, w_leaf), dy)
    uf, wf = u.double().requires_grad_(), w.double().requires_grad_()
    y_ref = _eager(uf[None], wf, pos)
    du_ref, dw_ref = torch.autograd.grad(y_ref, (uf, wf), dy.double())
    for got, want in ((y, y_ref), (du, du_ref), (dw, dw_ref)):
        assert torch.isfinite(got).all()
        assert float((got.detach().double() - want.detach()).norm() / want.detach().norm()) < 5e-3


def test_conv_silu_rejects_bad_shapes():
    u = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="weight must be"):
        conv_silu(u, torch.randn(16, 9), torch.arange(8))
    with pytest.raises(ValueError, match="pos_T must be"):
        conv_silu(u, torch.randn(16, 4), torch.arange(7))


def test_kda_layer_fused_conv_matches_eager(monkeypatch):
    torch.manual_seed(0)
    layer = K3KDA(K3Config.from_preset("k3-debug", kda_backend="torch"), 0).to(DEVICE)
    layer.reset_kda_parameters()
    x = torch.randn(1, 30, 64, device=DEVICE, requires_grad=True)
    cu = torch.tensor([0, 11, 30], dtype=torch.int32, device=DEVICE)
    results = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(fused, "MODE", mode)
        y = layer(x, cu_seqlens=cu)
        results[mode] = (y, torch.autograd.grad(y.square().sum(), [x, layer.q_conv, layer.v_conv]))
    torch.testing.assert_close(results["on"][0], results["off"][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results["on"][1], results["off"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fused_conv_without_norm_is_not_run_again_in_backward(monkeypatch):
    # q and k are L2-normalised on the torch path (recomputed in backward); v's fused conv keeps only its input
    from k3infra.model import kda

    monkeypatch.setattr(fused, "MODE", "on")
    calls = []
    monkeypatch.setattr(kda, "conv_silu", lambda *a: calls.append(a[0].shape) or conv_silu(*a))
    torch.manual_seed(0)
    layer = K3KDA(K3Config.from_preset("k3-debug", kda_backend="torch"), 0).to(DEVICE)
    x = torch.randn(1, 30, 64, device=DEVICE, requires_grad=True)
    layer(x, cu_seqlens=torch.tensor([0, 11, 30], dtype=torch.int32, device=DEVICE)).square().sum().backward()
    assert len(calls) == 5  # q, k: forward + recompute; v: forward only


@pytest.mark.parametrize("B", [1, 2])
def test_conv_silu_reads_a_column_slice_in_place(B):
    """A column slice of a wider projection output (the KDA layer's q, k, v) is read with its row stride: the same
    outputs and gradients as its contiguous copy, bit for bit."""
    g = torch.Generator().manual_seed(5)
    T, D, W = 70, 96, 4
    wide = torch.randn(B, T, 3 * D + 8, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(D, W, generator=g) / W**0.5).to(DEVICE)
    dy = torch.randn(B, T, D, generator=g).to(DEVICE)
    pos = positions_in_sequence(T, torch.tensor([0, 30, 70]) if B == 1 else None, torch.device(DEVICE))
    part = wide[..., D:2 * D]
    assert not part.is_contiguous()
    y = conv_silu(part, w, pos)
    (grad,) = torch.autograd.grad(y, wide, dy)
    copy = part.detach().contiguous().requires_grad_()
    y_ref = conv_silu(copy, w, pos)
    (grad_ref,) = torch.autograd.grad(y_ref, copy, dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(grad[..., D:2 * D], grad_ref)
    assert grad[..., :D].eq(0).all() and grad[..., 2 * D:].eq(0).all()


def test_compiled_graph_calls_the_conv_operator(monkeypatch):
    """Under ``torch.compile`` the KDA layer's convolution is the operator (forward and backward kernels), equal to
    eager bit for bit."""
    import torch._dynamo.testing

    from k3infra.model import kda

    monkeypatch.setattr(fused, "MODE", "on")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    T, D, W = 40, 64, 4
    wide = torch.randn(1, T, 2 * D + 8, generator=g).to(DEVICE)
    w = (torch.randn(D, W, generator=g) / W**0.5).to(DEVICE)
    dy = torch.randn(1, T, 2, D // 2, generator=g).to(DEVICE)
    pos = positions_in_sequence(T, torch.tensor([0, 15, 40]), torch.device(DEVICE))

    def step(x, w):
        return kda._conv_act_kept_input(x[..., D:2 * D], w, None, pos, 2, normalize=False) * 2

    results = []
    for compiled in (False, True):
        x, wl = wide.clone().requires_grad_(), w.clone().requires_grad_()
        counts = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        fn = torch.compile(step, backend=counts, fullgraph=True) if compiled else step
        out = fn(x, wl)
        out.backward(dy)
        results.append((out.detach(), x.grad, wl.grad))
        if compiled:
            assert counts.frame_count == 1
            graphs = "\n".join(str(gm.graph) for gm in counts.graphs)
            assert "k3infra.fused_conv_silu" in graphs
    for got, ref in zip(results[1], results[0]):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_conv_operators_pass_opcheck():
    """Fake (meta) kernels agree with the real ones in shapes, strides and dtypes, which compiled graphs assert."""
    from k3infra.model import fused_conv

    g = torch.Generator().manual_seed(1)
    u = torch.randn(40, 3 * 32 + 8, generator=g).to(DEVICE)[:, 32:64]
    w = torch.randn(32, 4, generator=g).to(DEVICE)
    pos = positions_in_sequence(40, torch.tensor([0, 13, 40]), torch.device(DEVICE)).to(torch.int32)
    dy = torch.randn(40, 32, generator=g).to(DEVICE)
    torch.library.opcheck(fused_conv._conv_silu_op, (u, w, pos), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(fused_conv._conv_silu_bwd_op, (u, w, pos, dy),
                          test_utils=("test_schema", "test_faketensor"))
