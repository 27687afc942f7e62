"""FlashKDA forward v2 with 32-token chunks: the layout, the block inverse and the chunk-32 emulation against the
fp64 oracle and the chunk-16 emulation (CPU)."""

import pytest
import torch

from flashkda import reference
from flashkda.fwd.v2.emulate import LOG2E, emulate_chunk_kda, gate_log2, l2norm_fp32
from flashkda.fwd.v2.emulate32 import block_inverse32, emulate_chunk_kda32, emulate_prepare32
from flashkda.fwd.v2.workspace import build_chunk_layout
from flashkda.fwd.v2.workspace32 import CHUNK32, build_chunk_layout32
from tests.flashkda.kda_cases import assert_close
from tests.flashkda.test_fwd_v2 import GPU_CASES as V2_GPU_CASES
from tests.flashkda.test_fwd_v2 import assert_workspace_close, gpu_inputs, make_inputs

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


def _kernel_gate_log2(g, A_log, dt_bias, lower_bound):
    """K1 c32's gate (`prepare32_kernel._elementwise32`): ``t = g a + dt_bias a`` with ``a = -exp(A_log) log2(e)``,
    then ``lower_bound log2(e) / (1 + 2^t)``, fp32."""
    H = g.shape[-2]
    a = torch.full((H, 1), -LOG2E) if A_log is None else -torch.exp2(A_log.float().reshape(H, 1) * LOG2E) * LOG2E
    t = g.float() * a
    if dt_bias is not None:
        t = t + dt_bias.float().reshape(H, K) * a
    return (lower_bound * LOG2E) * (1.0 / (1.0 + torch.exp2(t)))


def _kernel_tokens(q, k, g, scale, lower_bound, A_log, dt_bias):
    """``kd, qd, kr, glast`` as K1 c32 forms them (fixed length, T a multiple of 32): its gate, per-half cumsums,
    ``2^-G = 1 / 2^G`` and the half-B / chunk-end factors as products of per-channel powers
    (`prepare32_kernel._elementwise32`)."""
    B, T, H, _ = g.shape

    def halves(x):
        return x.reshape(B, T // 32, 2, 16, H, K)

    qn, kn = halves(l2norm_fp32(q) * scale), halves(l2norm_fp32(k))
    G = halves(_kernel_gate_log2(g, A_log, dt_bias, lower_bound)).cumsum(3)  # G_A, G_B'
    r, b_end = G[:, :, 0, 15], G[:, :, 1, 15]
    e_r, e_end = torch.exp2(r)[:, :, None, None], torch.exp2(b_end)[:, :, None, None]
    kd_op, qd_op = kn * torch.exp2(G), qn * torch.exp2(G)
    ki_op = kn * (1.0 / torch.exp2(G))
    half_b = torch.tensor([False, True])[None, None, :, None, None, None]
    kd = torch.where(half_b, kd_op * e_r, kd_op)
    qd = torch.where(half_b, qd_op * e_r, qd_op)
    kr = torch.where(half_b, ki_op, ki_op * e_r) * e_end
    return [x.reshape(B * T, H, K).to(torch.bfloat16) for x in (kd, qd, kr)] + [torch.exp2(r + b_end).reshape(-1, H, K)]


@pytest.mark.parametrize("lower_bound, saturate, a_log",
                         [(-5.0, False, True), (-5.0, True, True), (-0.5, False, True), (-5.0, False, False)],
                         ids=["-5", "-5-saturated", "-0.5", "-5-no-A_log"])
def test_kernel_factor_products_match_the_emulation(lower_bound, saturate, a_log):
    # K1 c32 replaces 2^(r - G), 2^(r + G_B') and 2^(Glast - G) by products of per-channel powers, forms the gate
    # as g a + dt_bias a and 2^-G as 1 / 2^G: each factor stays within 2^+-115, and the result is the emulation's
    # up to fp32 rounding (then bf16)
    B, T, H = 2, 64, 2
    q, k, _, g, beta, A_log, dt_bias, _ = make_inputs(B, T, H, B, seed=8, a_log=a_log)
    if saturate:
        g = torch.full_like(g, 30.0)
    ws = emulate_prepare32(q, k, g, beta, K**-0.5, build_chunk_layout32(B, T, None, CPU), lower_bound, A_log,
                           dt_bias)
    kd, qd, kr, glast = _kernel_tokens(q, k, g, K**-0.5, lower_bound, A_log, dt_bias)
    for name, ours in (("kd", kd), ("qd", qd), ("kr", kr), ("glast", glast)):
        ref = getattr(ws, name).float()
        assert torch.isfinite(ours.float()).all(), name
        scale = ref.norm().clamp_min(1e-30)
        assert (ours.float() - ref).norm() / scale < 2e-3, name


@pytest.mark.parametrize("a_log", [True, False], ids=["A_log", "no-A_log"])
def test_kernel_gate_is_exactly_zero_past_the_chunk_end(a_log):
    # K1 c32 loads the gate of a token past the chunk's end as -inf instead of selecting 0 afterwards
    _, _, _, g, _, A_log, dt_bias, _ = make_inputs(1, 32, 2, 1, seed=3, a_log=a_log)
    for bias in (dt_bias, None):
        gate = _kernel_gate_log2(torch.full_like(g, float("-inf")), A_log, bias, -5.0)
        assert torch.equal(gate, torch.zeros_like(gate))
    ref = gate_log2(g, A_log, dt_bias, -5.0)
    assert ((_kernel_gate_log2(g, A_log, dt_bias, -5.0) - ref).norm() / ref.norm()).item() < 1e-6


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


# ----------------------------------------------------------------------------- the chunk-32 recurrence kernel (gpu)

#: Kernel vs emulation on the same workspace: only the fp32 summation order differs.
TOL_EMULATE = 3e-3
GPU_CASES = [
    dict(B=1, T=64, H=1, lengths=None),
    dict(B=2, T=100, H=3, lengths=None),
    dict(B=1, T=1 + 32 + 0 + 47 + 300 + 5, H=2, lengths=(1, 32, 0, 47, 300, 5)),
    dict(B=1, T=700, H=4, lengths=(700,), init=False),
]


def _gpu_workspace32(B, T, H, lengths, lower_bound=-5.0, seed=0, init=True, extra_rows=0):
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                   dtype=torch.int64, device="cuda")
    N = B if lengths is None else len(lengths)
    q, k, v, g, beta, A_log, dt_bias, h0 = (x.cuda() if x is not None else None
                                            for x in make_inputs(B, T + extra_rows, H, N, seed, init))
    layout = build_chunk_layout32(B, T + extra_rows, cu, torch.device("cuda"))
    ws = emulate_prepare32(q, k, g, beta, K**-0.5, layout, lower_bound, A_log, dt_bias)
    return ws, (q, k, v, g, beta, A_log, dt_bias, h0), cu


def test_c32_entry_rejects_what_v2_does_not_serve_and_imports_no_kernel():
    import subprocess
    import sys

    from flashkda.fwd.v2.chunk_fwd import chunk_kda_fwd_v2

    q = torch.zeros(1, 4, 2, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Hopper"):
        chunk_kda_fwd_v2(q, q, q, q, q[..., 0], 1.0, lower_bound=-5.0, chunk_size=32)
    code = ("import sys, flashkda.fwd.v2.chunk_fwd32, flashkda.fwd.v2.prepare32, flashkda.fwd.v2.recurrence32; "
            "sys.exit(any(m.endswith(('_kernel',)) or m.startswith('triton.experimental.gluon') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_recurrence32_rejects_bad_arguments():
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    ws = emulate_prepare32(*(torch.zeros(1, 32, 1, K) for _ in range(3)), torch.zeros(1, 32, 1), K**-0.5,
                           build_chunk_layout32(1, 32, None, CPU), -5.0)
    with pytest.raises(ValueError, match="CUDA"):
        recurrence32_fwd(ws, torch.zeros(1, 32, 1, K, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("case, stages", [(c, 2) for c in GPU_CASES] + [(GPU_CASES[2], 3)],
                         ids=lambda x: f"B{x['B']}-T{x['T']}-H{x['H']}-{x['lengths']}" if isinstance(x, dict) else
                         f"stages{x}")
def test_recurrence32_kernel_matches_emulation(case, stages):
    from flashkda.fwd.v2.emulate import emulate_recurrence
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    ws, x, _ = _gpu_workspace32(case["B"], case["T"], case["H"], case["lengths"], init=case.get("init", True))
    v, h0 = x[2], x[7]
    with torch.inference_mode():
        ro, rs = emulate_recurrence(ws, v, h0, True)
        o, s = recurrence32_fwd(ws, v, h0, True, stages=stages)
    torch.cuda.synchronize()
    assert_close("o", ro.float(), o.float(), TOL_EMULATE)
    assert_close("final_state", rs, s, TOL_EMULATE)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, -0.1])
def test_recurrence32_kernel_matches_fp64(lower_bound):
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    lengths = (1000, 37, 500)
    ws, x, cu = _gpu_workspace32(1, sum(lengths), 2, lengths, lower_bound=lower_bound, seed=7)
    q, k, v, g, beta, A_log, dt_bias, h0 = x
    with torch.inference_mode():
        o, s = recurrence32_fwd(ws, v, h0, True)
        ro, rs = _reference(q, k, v, g, beta, h0, lower_bound, cu, A_log, dt_bias)
    assert_close("o", ro, o, 6e-3)
    assert_close("final_state", rs, s, 1e-2)


@pytest.mark.gpu
def test_recurrence32_ignores_rows_past_the_last_sequence():
    """Token rows after ``cu_seqlens[-1]`` are never written by K1; NaN there must not reach o or the state."""
    from flashkda.fwd.v2.emulate import emulate_recurrence
    from flashkda.fwd.v2.recurrence32 import recurrence32_fwd

    lengths = (37, 0, 300, 5)
    end = sum(lengths)
    ws, x, _ = _gpu_workspace32(1, end, 2, lengths, seed=5, extra_rows=9)
    v, h0 = x[2], x[7]
    for t in (ws.kd, ws.qd, ws.kr, ws.beta):
        t[end:] = float("nan")
    v[:, end:] = float("nan")
    with torch.inference_mode():
        o, s = recurrence32_fwd(ws, v, h0, True)
        ro, rs = emulate_recurrence(ws, v, h0, True)
    assert_close("o", ro[:, :end].float(), o[:, :end].float(), TOL_EMULATE)
    assert_close("final_state", rs, s, TOL_EMULATE)


# --------------------------------------------------------------- the chunk-32 prepare kernel and forward (gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, cu, a_log, HV", V2_GPU_CASES)
def test_prepare32_kernel_matches_emulation(B, T, H, cu, a_log, HV):
    from flashkda.fwd.v2.prepare32 import prepare32_fwd

    cu_t, (q, k, _, g, beta, A_log, dt_bias, _) = gpu_inputs(B, T, H, cu, a_log, 7, HV)
    layout = build_chunk_layout32(B, T, cu_t, q.device)
    ref = emulate_prepare32(q, k, g, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
    ws = prepare32_fwd(q, k, g, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
    torch.cuda.synchronize()
    assert_workspace_close(ws, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, -0.1])
def test_chunk_kda_fwd_v2_c32_gate_sweep(lower_bound):
    from flashkda.fwd.v2.chunk_fwd import chunk_kda_fwd_v2

    cu_t, (q, k, v, g, beta, A_log, dt_bias, h0) = gpu_inputs(1, 2048, 2, (0, 1500, 2048), True, 9, 2)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=lower_bound, cu_seqlens=cu_t, A_log=A_log, dt_bias=dt_bias)
    o, s, _ = chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, h0, True, chunk_size=32, **kw)
    ro, rs = reference.chunk_kda_reference(q, k, v, g, beta, K**-0.5, h0, True, **kw)
    assert_close("o", ro, o, 6e-3)
    assert_close("final_state", rs, s, 1e-2)
