"""The fp64 oracles agree with each other, with fla's torch oracle and with autograd."""

import pytest
import torch
import torch.nn.functional as F

from flashkda import reference


def _inputs(B, T, H, HV, K, V, seed=0, N=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = reference.l2norm(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64))
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)) * 0.5
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    h0 = torch.randn(N or B, HV, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize(
    "B,T,H,HV,K,V,chunk",
    [
        pytest.param(2, 37, 2, 2, 8, 8, 16, id="B2-T37-H2-K8-C16"),
        pytest.param(1, 64, 1, 2, 16, 8, 32, id="B1-T64-GVA2-K16-V8-C32"),
        pytest.param(1, 5, 2, 4, 8, 16, 64, id="B1-T5-GVA2-C64"),
    ],
)
def test_chunk_oracle_matches_recurrent_oracle(B, T, H, HV, K, V, chunk):
    q, k, v, g, beta, h0 = _inputs(B, T, H, HV, K, V)
    o1, s1 = reference.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = reference.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk)
    torch.testing.assert_close(o1, o2, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s1, s2, rtol=1e-9, atol=1e-9)


def test_recurrent_oracle_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta, h0 = _inputs(2, 21, 2, 4, 8, 16)
    o1, s1 = reference.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o1, o2.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2.double(), rtol=1e-5, atol=1e-5)


def test_varlen_equals_separate_sequences_with_empty_and_v_first_state():
    lens = [7, 0, 19, 1]
    cu = torch.tensor([0, 7, 7, 26, 27])
    q, k, v, g, beta, h0 = _inputs(1, 27, 2, 2, 8, 8, N=4)
    h0_vf = h0.transpose(-1, -2).contiguous()
    o, s = reference.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0_vf, output_final_state=True,
                                         state_v_first=True, cu_seqlens=cu)
    oc, sc = reference.naive_chunk_kda(q, k, v, g, beta, initial_state=h0_vf, output_final_state=True,
                                       state_v_first=True, cu_seqlens=cu, chunk_size=16)
    torch.testing.assert_close(o, oc, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, sc, rtol=1e-9, atol=1e-9)
    start = 0
    for n, L in enumerate(lens):
        sl = slice(start, start + L)
        on, sn = reference.naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                               initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(o[:, sl], on)
        torch.testing.assert_close(s[n], sn[0].transpose(-1, -2))
        start += L
    assert torch.equal(s[1], h0_vf[1])  # the empty sequence passes its state through


@pytest.mark.parametrize("lower_bound,use_a", [(None, True), (-5.0, True), (-5.0, False)],
                         ids=["softplus", "bounded", "bounded-noA"])
def test_gate_matches_fla_formulas(lower_bound, use_a):
    gate = pytest.importorskip("fla.ops.kda.gate")
    g = torch.randn(1, 9, 3, 4, dtype=torch.float64) * 4
    A_log = torch.randn(3, dtype=torch.float64)
    dt_bias = torch.randn(12, dtype=torch.float64)
    ours = reference.kda_gate(g, A_log if use_a else None, dt_bias, lower_bound)
    if lower_bound is None:
        theirs = gate.naive_kda_gate(g, A_log, dt_bias, output_dtype=torch.float64)
    else:
        theirs = gate.naive_kda_lowerbound_gate(g, A_log if use_a else None, dt_bias, lower_bound,
                                                output_dtype=torch.float64)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)  # fla computes in fp32


def test_softplus_gate_without_a_log_is_rejected():
    with pytest.raises(ValueError, match="A_log"):
        reference.kda_gate(torch.zeros(1, 1, 1, 4), None, None, None)


def test_recurrent_oracle_is_differentiable():
    q, k, v, g, beta, h0 = _inputs(1, 6, 1, 1, 4, 4)
    for x in (q, k, v, g, beta, h0):
        x.requires_grad_(True)
    o, s = reference.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    (o.sum() + s.sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v, g, beta, h0))
    assert torch.autograd.gradcheck(
        lambda v_: reference.naive_recurrent_kda(q.detach(), k.detach(), v_, g.detach(), beta.detach())[0],
        (v.detach().clone().requires_grad_(True),),
    )
