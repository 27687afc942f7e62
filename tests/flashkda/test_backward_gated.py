"""The gated-dot backward kernels (`flashkda.bwd.gated_dots`) against fp64 torch (`gated_dot`, `gated_dot_bwd`), with
mild gates and with the strongest bounded gate (-5 per token, -320 over a chunk), where naive exp(+-G) overflows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashkda.bwd.gated_dots import chunk_kda_gated_dots_bwd
from flashkda.bwd.local import gated_dot, gated_dot_bwd


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize(
    ("K", "gate"),
    [
        pytest.param(32, "logsigmoid", id="K32-logsigmoid"),
        pytest.param(128, "logsigmoid", id="K128-logsigmoid"),
        pytest.param(64, "floor", id="K64-gate-at-lower-bound"),
    ],
)
def test_gated_dots_backward_matches_fp64_torch(K: int, gate: str, device: str) -> None:
    torch.manual_seed(K)
    nb, C = 3, 64
    q, k = (F.normalize(torch.randn(nb, C, K, device=device), dim=-1) for _ in range(2))
    if gate == "floor":
        g = -5.0 * torch.sigmoid(4 + torch.randn(nb, C, K, device=device))  # close to -5 everywhere
    else:
        g = F.logsigmoid(torch.randn(nb, C, K, device=device))
    gam = g.cumsum(1)
    q64, k64, g64 = q.double(), k.double(), gam.double()
    dakk = torch.randn(nb, C, C, device=device).tril(-1)
    daqk = torch.randn(nb, C, C, device=device).tril()
    dq, dk, dgam = chunk_kda_gated_dots_bwd(q, k, gam, dakk, daqk, dot_precision="ieee")
    da, db = gated_dot_bwd(dakk.double(), k64, k64, g64)
    ra, rb = gated_dot_bwd(daqk.double(), q64, k64, g64)
    ref_dq, ref_dk = ra, da + db + rb
    ref_dgam = k64 * (da - db) + q64 * ra - k64 * rb
    for name, ours, ref in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dgam", dgam, ref_dgam)):
        assert torch.isfinite(ours).all(), name
        assert _rel(ours, ref) < 1e-5, f"{name}: {_rel(ours, ref):.2e}"



def test_gated_dots_backward_row_scale_and_aqk_scale_equal_prescaled_gradients(device: str) -> None:
    """``dakk_row_scale``/``daqk_scale`` give the same result as scaling full, unmasked gradients beforehand."""
    torch.manual_seed(5)
    nb, C, K = 2, 64, 32
    q, k = (F.normalize(torch.randn(nb, C, K, device=device), dim=-1) for _ in range(2))
    gam = F.logsigmoid(torch.randn(nb, C, K, device=device)).cumsum(1)
    p, s = torch.randn(nb, C, C, device=device), torch.randn(nb, C, C, device=device)  # full: masks are the kernel's
    rs = -torch.rand(nb, C, device=device)
    got = chunk_kda_gated_dots_bwd(q, k, gam, p, s, dot_precision="ieee", dakk_row_scale=rs, daqk_scale=0.3)
    ref = chunk_kda_gated_dots_bwd(q, k, gam, (rs[..., None] * p).tril(-1), (0.3 * s).tril(), dot_precision="ieee")
    for name, a, b in zip(("dq", "dk", "dgam"), got, ref):
        assert _rel(a, b.double()) < 1e-6, name


def test_ut_backward_pass_matches_torch(device: str) -> None:
    """`chunk_kda_bwd_ut` equals the torch expressions it replaces, for a V that is not a multiple of its tile."""
    from flashkda.bwd.wy import chunk_kda_bwd_ut

    torch.manual_seed(7)
    nb, C, K, V = 3, 64, 32, 48
    y_u, v = torch.randn(nb, C, V, device=device), torch.randn(nb, C, V, device=device)
    y_wn, kg = torch.randn(nb, C, K, device=device), torch.randn(nb, C, K, device=device)
    p, akk = torch.randn(nb, C, C, device=device), torch.randn(nb, C, C, device=device).tril(-1)
    beta = torch.rand(nb, C, device=device)
    h, dhe = torch.randn(nb, K, V, device=device), torch.randn(nb, K, V, device=device)
    dv, dkg, dbeta, ddec = chunk_kda_bwd_ut(y_u, y_wn, p, kg, v, akk + torch.randn_like(akk).triu(), beta, h, dhe)
    b = beta.double()[..., None]
    ref_dbeta = ((y_u * v).sum(-1) - (y_wn * kg).sum(-1) - (p * akk).sum(-1)).double()
    assert _rel(dv, b * y_u.double()) < 1e-6 and _rel(dkg, -b * y_wn.double()) < 1e-6
    assert _rel(dbeta, ref_dbeta) < 1e-5 and _rel(ddec, (h.double() * dhe.double()).sum(-1)) < 1e-6


@pytest.mark.parametrize("row_scale", [True, False], ids=["row-scale", "no-row-scale"])
def test_fused_gated_dots_and_gate_chain_match_the_two_passes(row_scale: bool, device: str) -> None:
    """`chunk_kda_gated_dots_gates_bwd` (one pass, qg/kend/dec rebuilt from q, k, G) equals the gated-product
    backward followed by the gate-chain kernel, at the strongest bounded gate (-5 per token), with or without the row
    scale of dAkk; K = 64 gives the kernel two 32-wide feature slices (two programs per chunk). The upper triangles
    of the dA inputs hold random values: both kernels must ignore them."""
    from flashkda.bwd.gated_dots import chunk_kda_gated_dots_gates_bwd
    from flashkda.bwd.gates import chunk_kda_bwd_gates

    torch.manual_seed(9)
    nb, C, K, scale = 2, 64, 64, 0.3
    q, k = (F.normalize(torch.randn(nb, C, K, device=device), dim=-1) for _ in range(2))
    gam = (-5.0 * torch.rand(nb, C, K, device=device)).cumsum(1)
    p, s = torch.randn(nb, C, C, device=device), torch.randn(nb, C, C, device=device)
    rs = -torch.rand(nb, C, device=device) if row_scale else None
    dqg, dkg, dkend = (torch.randn(nb, C, K, device=device) for _ in range(3))
    ddec = torch.randn(nb, K, device=device)
    got = chunk_kda_gated_dots_gates_bwd(q, k, gam, p, s, dqg, dkg, dkend, ddec, scale=scale, dot_precision="ieee",
                                         dakk_row_scale=rs)
    dq, dk, dgam = chunk_kda_gated_dots_bwd(q, k, gam, p, s, dot_precision="ieee", dakk_row_scale=rs,
                                            daqk_scale=scale)
    qg, kend = scale * q * gam.exp(), k * (gam[:, -1:] - gam).exp()
    ref = chunk_kda_bwd_gates(k, gam, qg, kend, gam[:, -1].exp(), dq, dk, dgam, dqg, dkg, dkend, ddec, scale)
    for name, a, b in zip(("dq", "dk", "dg"), got, ref):
        assert _rel(a, b.double()) < 1e-5, name


def test_torch_gated_dot_backward_matches_autograd(device: str) -> None:
    """The torch oracle's own backward (`gated_dot_bwd`) equals autograd through `gated_dot` in fp64."""
    torch.manual_seed(0)
    a, b = (torch.randn(2, 64, 32, device=device, dtype=torch.float64, requires_grad=True) for _ in range(2))
    gam = F.logsigmoid(torch.randn(2, 64, 32, device=device, dtype=torch.float64)).cumsum(1).requires_grad_()
    dA = torch.randn(2, 64, 64, device=device, dtype=torch.float64).tril()
    ga, gb, gg = torch.autograd.grad(gated_dot(a, b, gam, strict=False), (a, b, gam), dA)
    da, db = gated_dot_bwd(dA, a.detach(), b.detach(), gam.detach())
    torch.testing.assert_close(da, ga)
    torch.testing.assert_close(db, gb)
    torch.testing.assert_close(a.detach() * da - b.detach() * db, gg)


@pytest.mark.gpu
def test_state_passes_with_bf16_operands_track_fp32_products(device: str) -> None:
    """The bf16-operand mode of the state passes (used for bf16 callers on GPUs) stays within bf16 accuracy.

    GPU only: Triton's CPU interpreter has no bf16 matrix product (numpy has no bf16 type).
    """
    from flashkda.bwd.state import chunk_kda_bwd_dh, chunk_kda_recompute_h

    torch.manual_seed(4)
    NC, HV, C, K, V = 4, 2, 64, 32, 32
    w, qg, kend = (0.1 * torch.randn(NC, HV, C, K, device=device) for _ in range(3))
    u, do = (torch.randn(NC, HV, C, V, device=device) for _ in range(2))
    aqk = 0.1 * torch.randn(NC, HV, C, C, device=device).tril()
    dec = torch.rand(NC, HV, K, device=device)
    h0, dht = (torch.randn(2, HV, K, V, device=device) for _ in range(2))
    offsets = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
    out = {}
    for mode in ("ieee", "tf32"):
        fwd = chunk_kda_recompute_h(w, u, kend, dec, h0, offsets, store_h=True, store_final_state=True,
                                    dot_precision=mode)
        bwd = chunk_kda_bwd_dh(qg, aqk, kend, dec, w, do, dht, offsets, store_dh0=True, dot_precision=mode)
        out[mode] = (*fwd, *bwd)
    for name, exact, approx in zip(("ht", "h", "v_new", "dv_new", "dhe", "dh0"), out["ieee"], out["tf32"]):
        assert _rel(approx, exact.double()) < 2e-2, name


@pytest.mark.gpu
def test_fused_chain_rule_matches_the_exact_one_on_the_gpu(device: str) -> None:
    """bf16 gradients of a GPU's default backward (``dot_precision="tf32"``: the fused gate chain, bf16 state-pass
    operands) against the exact-product one (``"ieee"``: separate passes, dG in fp64), at K = V = 128 with the
    bounded in-kernel gate and varlen."""
    from flashkda.chunk import chunk_kda_autograd

    torch.manual_seed(12)
    T, H, K = 700, 4, 128
    x = dict(q=torch.randn(1, T, H, K), k=torch.randn(1, T, H, K), v=torch.randn(1, T, H, K),
             g=torch.randn(1, T, H, K), beta=torch.randn(1, T, H))
    x = {n: t.to(device, torch.bfloat16).requires_grad_() for n, t in x.items()}
    A_log = torch.log(torch.empty(H, device=device).uniform_(1, 4)).requires_grad_()
    dt_bias = (0.5 * torch.randn(H * K, device=device)).requires_grad_()
    cu = torch.tensor([0, 300, 301, 700], device=device)
    do = torch.randn(1, T, H, K, device=device, dtype=torch.bfloat16)
    grads = {}
    for precision in ("tf32", "ieee"):
        o, _ = chunk_kda_autograd(*x.values(), scale=K**-0.5, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                  dot_precision=precision)
        grads[precision] = torch.autograd.grad((o.float() * do.float()).sum(), [*x.values(), A_log, dt_bias])
    for name, a, b in zip([*x, "A_log", "dt_bias"], grads["tf32"], grads["ieee"]):
        assert torch.isfinite(a).all() and _rel(a, b.double()) < 1e-2, name


def test_saved_inverse_widens_and_scales_columns(device: str) -> None:
    """`saved_inverse_fp32` gives ``M`` and ``M Diag(beta)`` in fp32 from a bf16 copy, exactly."""
    from flashkda.bwd.saved import saved_inverse_fp32

    torch.manual_seed(4)
    m = torch.randn(3, 2, 64, 64, device=device).to(torch.bfloat16)
    beta = torch.rand(3, 2, 64, device=device)
    assert torch.equal(saved_inverse_fp32(m), m.float())
    torch.testing.assert_close(saved_inverse_fp32(m, beta), m.float() * beta[..., None, :], rtol=0, atol=0)
