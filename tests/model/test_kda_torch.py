"""The pure-torch KDA (chunked and recurrent) against flashkda's fp64 recurrent oracle: outputs, final states and
every gradient, equal length and varlen (awkward lengths, an empty sequence)."""

import pytest
import torch

from flashkda.reference import naive_recurrent_kda
from k3infra.model.kda_torch import chunk_kda_torch, recurrent_kda_torch


def _inputs(B, T, H, K, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    g = -5.0 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)  # K3's bounded gate range
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, beta, h0)]


def _grads(o, s, inputs, seed):
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (
        s * torch.randn(s.shape, generator=gen, dtype=s.dtype)
    ).sum()
    return torch.autograd.grad(loss, inputs)


CASES = [
    pytest.param(2, 63, 2, 8, 16, id="B2-T63-H2-K8-C16"),
    pytest.param(1, 16, 1, 12, 16, id="B1-T16-H1-K12-C16"),
    pytest.param(1, 37, 3, 8, 8, id="B1-T37-H3-K8-C8"),
]


@pytest.mark.parametrize("B,T,H,K,C", CASES)
def test_chunk_equals_recurrent_oracle(B, T, H, K, C):
    q, k, v, g, beta, h0 = _inputs(B, T, H, K, seed=T)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, ref_o, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s.double(), ref_s, rtol=1e-9, atol=1e-9)
    ref_grads = _grads(ref_o, ref_s, [q, k, v, g, beta, h0], seed=1)
    grads = _grads(o, s.double(), [q, k, v, g, beta, h0], seed=1)
    for name, a, b in zip("q k v g beta h0".split(), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=f"d{name}")


def test_chunk_varlen_equals_oracle():
    lens = [15, 0, 33, 1, 20]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    q, k, v, g, beta, _ = _inputs(1, T, 2, 8, seed=5)
    h0 = torch.randn(len(lens), 2, 8, 8, dtype=torch.float64, requires_grad=True)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o, ref_o, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s.double(), ref_s, rtol=1e-9, atol=1e-9)
    ref_grads = _grads(ref_o, ref_s, [q, k, v, g, beta, h0], seed=2)
    grads = _grads(o, s.double(), [q, k, v, g, beta, h0], seed=2)
    for name, a, b in zip("q k v g beta h0".split(), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=f"d{name}")


def test_recurrent_step_equals_oracle():
    q, k, v, g, beta, h0 = _inputs(2, 5, 2, 8, seed=7)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = recurrent_kda_torch(q, k, v, g, beta, initial_state=h0)
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, ref_s, rtol=1e-10, atol=1e-10)


def test_bad_shapes_and_varlen_batch():
    q, k, v, g, beta, _ = _inputs(2, 8, 1, 4, seed=0)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_torch(q, k, v, g, beta[:, :4])
    with pytest.raises(ValueError, match="B == 1"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
