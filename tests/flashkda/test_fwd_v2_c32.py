"""FlashKDA forward v2 with 32-token chunks: the layout, the block inverse and the chunk-32 emulation against the
fp64 oracle and the chunk-16 emulation (CPU)."""

import pytest
import torch

from flashkda import reference
from flashkda.fwd.v2.emulate import emulate_chunk_kda
from flashkda.fwd.v2.emulate32 import block_inverse32, emulate_chunk_kda32, emulate_prepare32
from flashkda.fwd.v2.workspace import build_chunk_layout
from flashkda.fwd.v2.workspace32 import CHUNK32, build_chunk_layout32
from tests.flashkda.kda_cases import assert_close
from tests.flashkda.test_fwd_v2 import make_inputs

K = 128
CPU = torch.device("cpu")


def _reference(q, k, v, g, beta, h0, lb, cu_t, A_log, dt_bias):
    return reference.chunk_kda_reference(
        q, k, v, g, beta, K**-0.5, h0, True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lb, cu_seqlens=cu_t, A_log=A_log, dt_bias=dt_bias)


@pytest.mark.parametrize("lengths", [(70,), (32, 0, 1, 33, 65), (5, 0, 0, 64)], ids=str)
def test_layout32_matches_python(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    layout = build_chunk_layout32(1, int(cu[-1]), cu, CPU)
    rows, starts, first = [], [0], 0
    for n, length in enumerate(lengths):
        rows += [[n, first + c * CHUNK32, min(CHUNK32, length - c * CHUNK32)] for c in range(-(-length // CHUNK32))]
        starts.append(len(rows))
        first += length
    assert layout.chunk_index[: len(rows)].tolist() == rows
    assert layout.chunk_index[len(rows):].tolist() == [[-1, 0, 0]] * (layout.num_chunks - len(rows))
    assert layout.seq_chunks.tolist() == starts
    fixed = build_chunk_layout32(2, 40, None, CPU)
    assert fixed.chunk_index.tolist() == [[0, 0, 32], [0, 32, 8], [1, 40, 32], [1, 72, 8]]


def test_block_inverse_inverts_unit_lower_triangular():
    gen = torch.Generator().manual_seed(2)
    L = torch.tril(torch.rand(32, CHUNK32, CHUNK32, generator=gen) * 0.4 - 0.2, -1)
    inv = block_inverse32(L[:, :16, :16], L[:, 16:, :16], L[:, 16:, 16:]).double()
    exact = torch.linalg.inv(torch.eye(CHUNK32, dtype=torch.float64) + L.double())
    assert torch.equal(torch.triu(inv, 1), torch.zeros_like(inv))
    assert ((inv - exact).norm() / exact.norm()).item() < 2e-3


def test_workspace32_factors_stay_in_range_at_the_gate_floor():
    # every gate at lower_bound = -5: 2^G from the chunk start would reach 2^-231, 2^-G past fp32
    B, T, H = 1, 64, 2
    q, k, v, g, beta, _, dt_bias, _ = make_inputs(B, T, H, B, seed=4)
    ws = emulate_prepare32(q, k, torch.full_like(g, 30.0), beta, K**-0.5, build_chunk_layout32(B, T, None, CPU),
                           -5.0, None, None)
    for name in ("kd", "qd", "kr", "inv", "mqk", "glast"):
        assert torch.isfinite(getattr(ws, name).float()).all(), name
    assert ws.inv.shape == (2, H, 32, 32) and ws.glast.max() < 1e-30 and ws.kr.float().abs().max() <= 1.0
    # INV of a fully decayed chunk is the identity plus the first sub-diagonal's small terms
    assert ws.inv.float().diagonal(dim1=-2, dim2=-1).eq(1).all()


@pytest.mark.parametrize("lower_bound", [-5.0, -3.0, -1.0, -0.1])
@pytest.mark.parametrize("B, T, cu", [(2, 80, None), (1, 150, (0, 0, 1, 70, 101, 150))], ids=["fixed", "varlen"])
def test_emulation32_matches_fp64_like_chunk16(B, T, cu, lower_bound):
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    N = B if cu is None else len(cu) - 1
    q, k, v, g, beta, A_log, dt_bias, h0 = make_inputs(B, T, 2, N, seed=11)
    ro, rs = _reference(q, k, v, g, beta, h0, lower_bound, cu_t, A_log, dt_bias)
    o, s = emulate_chunk_kda32(q, k, v, g, beta, K**-0.5, build_chunk_layout32(B, T, cu_t, CPU), lower_bound,
                               A_log, dt_bias, h0, True)
    assert_close("o", ro, o, 5e-3 if cu is None else 6e-3)
    assert_close("final_state", rs, s, 1e-2)
    # no worse than the chunk-16 emulation beyond rounding noise
    o16, s16 = emulate_chunk_kda(q, k, v, g, beta, K**-0.5, build_chunk_layout(B, T, cu_t, CPU), lower_bound,
                                 A_log, dt_bias, h0, True)
    assert_close("o vs chunk 16", ro, o, 1.1 * ((o16.double() - ro.double()).norm() / ro.double().norm()).item())


def test_emulation32_saturated_gates_and_gva_stay_finite_and_accurate():
    B, T, H = 1, 96, 1
    q, k, v, g, beta, _, dt_bias, h0 = make_inputs(B, T, H, 2, seed=4, HV=2)
    A_log = torch.full((2,), 6.0)  # saturated sigmoids: the gate sits at 0 or lower_bound
    cu_t = torch.tensor([0, 45, 96])
    o, s = emulate_chunk_kda32(q, k, v, g * 50, beta * 50, K**-0.5, build_chunk_layout32(B, T, cu_t, CPU), -5.0,
                               A_log, dt_bias, h0, True)
    ro, rs = _reference(q, k, v, g * 50, beta * 50, h0, -5.0, cu_t, A_log, dt_bias)
    assert_close("o", ro, o, 6e-3)
    assert_close("final_state", rs, s, 1e-2)


def test_emulation32_earlier_outputs_ignore_future_gates():
    B, T, H = 1, 80, 1
    q, k, v, g, beta, A_log, dt_bias, _ = make_inputs(B, T, H, B, seed=5)
    layout = build_chunk_layout32(B, T, None, CPU)
    o1, _ = emulate_chunk_kda32(q, k, v, g, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
    for cut in (37, 70):  # in the first half of a chunk (before its reference token) and in the second
        g2 = g.clone()
        g2[:, cut:] = torch.randn(B, T - cut, H, K).to(torch.bfloat16) * 4
        o2, _ = emulate_chunk_kda32(q, k, v, g2, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
        assert torch.equal(o1[:, :cut], o2[:, :cut])
        assert not torch.equal(o1[:, cut:], o2[:, cut:])
