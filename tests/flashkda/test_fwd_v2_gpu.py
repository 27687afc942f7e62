"""FlashKDA forward v2, the recurrence kernel (K2): its launcher's checks and order on the CPU, and on the device
the Gluon kernel against its torch emulation on the same emulated workspace, so K2 is checked apart from K1 (Hopper
GPUs only; the whole forward's fp64 check is in ``test_fwd_v2.py``)."""

import subprocess
import sys

import pytest
import torch

from flashkda.fwd.v2.emulate import emulate_prepare, emulate_recurrence
from flashkda.fwd.v2.workspace import build_chunk_layout
from tests.flashkda.kda_cases import assert_close

K = 128
#: Kernel vs emulation on the same workspace: only the fp32 summation order differs (it can flip a bf16 rounding
#: of the state operand, which the following chunks carry on).
TOL_EMULATE = 3e-3


def _inputs(B, T, H, N, seed=0, init=True, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k, v, g = (randn(B, T, H, K).bfloat16() for _ in range(4))
    beta = randn(B, T, H).bfloat16()
    A_log = torch.rand(H, generator=gen, device=device) * 2 - 1
    dt_bias = randn(H * K) * 0.5
    h0 = randn(N, H, K, K) * 0.1 if init else None
    return q, k, v, g, beta, A_log, dt_bias, h0


def _layout_and_workspace(B, T, H, lengths, lower_bound=-5.0, seed=0, init=True):
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                   dtype=torch.int64, device="cuda")
    N = B if lengths is None else len(lengths)
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(B, T, H, N, seed, init)
    layout = build_chunk_layout(B, T, cu, torch.device("cuda"))
    ws = emulate_prepare(q, k, g, beta, K**-0.5, layout, lower_bound, A_log, dt_bias)
    return ws, (q, k, v, g, beta, A_log, dt_bias, h0), cu


CASES = [
    dict(B=1, T=64, H=1, lengths=None),
    dict(B=2, T=100, H=3, lengths=None),
    dict(B=1, T=1 + 16 + 0 + 47 + 300 + 5, H=2, lengths=(1, 16, 0, 47, 300, 5)),
    dict(B=1, T=700, H=4, lengths=(700,), init=False),
]


def test_import_loads_no_kernel_and_order_is_longest_first():
    code = ("import sys, torch; from flashkda.fwd.v2.recurrence import longest_first_order; "
            "assert 'flashkda.fwd.v2.recurrence_kernel' not in sys.modules; "
            "assert not any(m.startswith('triton.experimental.gluon') for m in sys.modules); "
            "cu = torch.tensor([0, 5, 305, 305, 322], dtype=torch.int32); "
            "assert longest_first_order(cu).tolist() == [1, 3, 0, 2]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_recurrence_rejects_bad_arguments():
    from flashkda.fwd.v2.recurrence import recurrence_fwd

    ws = emulate_prepare(*(torch.zeros(1, 16, 1, K) for _ in range(3)), torch.zeros(1, 16, 1), K**-0.5,
                         build_chunk_layout(1, 16, None, torch.device("cpu")), -5.0)
    v = torch.zeros(1, 16, 1, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        recurrence_fwd(ws, v)


@pytest.mark.gpu
@pytest.mark.parametrize("block_v,stages", [(64, 3), (64, 2), (128, 3)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c['B']}-T{c['T']}-H{c['H']}-{c['lengths']}")
def test_recurrence_kernel_matches_emulation(case, block_v, stages):
    from flashkda.fwd.v2.recurrence import recurrence_fwd

    init = case.get("init", True)
    ws, x, _ = _layout_and_workspace(case["B"], case["T"], case["H"], case["lengths"], init=init)
    v, h0 = x[2], x[7]
    with torch.inference_mode():
        ro, rs = emulate_recurrence(ws, v, h0, True)
        o, s = recurrence_fwd(ws, v, h0, True, block_v=block_v, stages=stages)
    torch.cuda.synchronize()
    assert_close("o", ro.float(), o.float(), TOL_EMULATE)
    assert_close("final_state", rs, s, TOL_EMULATE)


@pytest.mark.gpu
def test_recurrence_without_final_state_and_longest_first_order_is_a_permutation():
    from flashkda.fwd.v2.recurrence import longest_first_order, recurrence_fwd

    lengths = (5, 300, 0, 17)
    ws, x, cu = _layout_and_workspace(1, sum(lengths), 2, lengths, seed=3)
    order = longest_first_order(ws.layout.cu_seqlens)
    assert order.tolist() == [1, 3, 0, 2]
    with torch.inference_mode():
        o, s = recurrence_fwd(ws, x[2], x[7], False)
        ro, _ = emulate_recurrence(ws, x[2], x[7], False)
    assert s is None
    assert_close("o", ro.float(), o.float(), TOL_EMULATE)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, -0.1])
def test_recurrence_gate_sweep_is_finite(lower_bound):
    from flashkda.fwd.v2.recurrence import recurrence_fwd

    ws, x, _ = _layout_and_workspace(1, 2048, 2, None, lower_bound=lower_bound, seed=7)
    with torch.inference_mode():
        o, s = recurrence_fwd(ws, x[2], x[7], True)
        ro, rs = emulate_recurrence(ws, x[2], x[7], True)
    assert_close("o", ro.float(), o.float(), TOL_EMULATE)
    assert_close("final_state", rs, s, TOL_EMULATE)


@pytest.mark.gpu
def test_recurrence_ignores_rows_past_the_last_sequence():
    """Token rows after ``cu_seqlens[-1]`` are never written by K1; NaN there must not reach o or the state."""
    from flashkda.fwd.v2.recurrence import recurrence_fwd

    lengths = (37, 0, 300, 5)
    end = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, end + 9, 2, len(lengths), seed=5)
    layout = build_chunk_layout(1, end + 9, cu, torch.device("cuda"))
    ws = emulate_prepare(q, k, g, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
    for t in (ws.kd, ws.qd, ws.kr, ws.beta):
        t[end:] = float("nan")
    v[:, end:] = float("nan")
    with torch.inference_mode():
        o, s = recurrence_fwd(ws, v, h0, True)
        ro, rs = emulate_recurrence(ws, v, h0, True)
    assert_close("o", ro[:, :end].float(), o[:, :end].float(), TOL_EMULATE)
    assert_close("final_state", rs, s, TOL_EMULATE)


def test_v2_preference_rule(monkeypatch):
    from flashkda.fwd.v2 import chunk_fwd

    monkeypatch.delenv(chunk_fwd.KERNELS_ENV, raising=False)
    x = torch.zeros(1, 16, 1, K)
    many = torch.zeros(1, 16, chunk_fwd.MIN_SEQUENCE_HEADS, K)
    g, beta = many, many[..., 0]
    assert not chunk_fwd.prefers_v2(x, x, many, g, beta)  # CPU tensors: v2 does not serve them
    monkeypatch.setattr(chunk_fwd, "supports_v2", lambda *args, **kwargs: True)
    assert chunk_fwd.prefers_v2(x, x, many, g, beta)
    few = many[:, :, :-(-chunk_fwd.MIN_SEQUENCE_HEADS // 3)]  # three sequences of these reach the rule, two do not
    assert not chunk_fwd.prefers_v2(x, x, few, g, beta)
    assert chunk_fwd.prefers_v2(x, x, few.expand(3, -1, -1, -1), g, beta)
    three, two = torch.tensor([0, 5, 9, 16]), torch.tensor([0, 5, 16])  # varlen: sequences from cu_seqlens's shape
    assert chunk_fwd.prefers_v2(x, x, few, g, beta, cu_seqlens=three)
    assert not chunk_fwd.prefers_v2(x, x, few, g, beta, cu_seqlens=two)
    assert chunk_fwd.prefers_v2(x, x, few, g, beta, None, False, False, False, False, None, False, three)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, (700, 300, 24)], ids=str)
def test_chunk_kda_inference_runs_v2_from_min_sequence_heads(lengths):
    import flashkda
    from flashkda.fwd.v2 import chunk_fwd

    H, T = chunk_fwd.MIN_SEQUENCE_HEADS, 1024
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    N = 1 if lengths is None else len(lengths)
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, T, H, N, seed=3)
    flags = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias)
    with torch.inference_mode():
        o, s = flashkda.chunk_kda(q, k, v, g, beta, safe_gate=True, **flags)
        o2, s2, _ = chunk_fwd.chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, safe_gate=True, **flags)
    assert torch.equal(o, o2) and torch.equal(s, s2)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, (0, 170, 130)], ids=str)
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_v2_state_v_first_is_the_transposed_state(chunk_size, lengths):
    from flashkda.fwd.v2.chunk_fwd import chunk_kda_fwd_v2

    N = 1 if lengths is None else len(lengths)
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, 300, 4, N, seed=5)
    flags = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias,
                 chunk_size=chunk_size, cu_seqlens=cu)
    o, s, _ = chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, initial_state=h0, **flags)
    o_t, s_t, _ = chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, initial_state=h0.transpose(-1, -2).contiguous(),
                                   state_v_first=True, **flags)
    assert torch.equal(o, o_t) and torch.equal(s, s_t.transpose(-1, -2))


@pytest.mark.gpu
def test_v2_chunk_size_choice_and_bad_values():
    from flashkda.fwd.v2.chunk_fwd import chunk_kda_fwd_v2

    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, 96, 2, 1, seed=6)
    flags = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias)
    o, s, _ = chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, **flags)
    o32, s32, _ = chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, chunk_size=32, **flags)
    assert torch.equal(o, o32) and torch.equal(s, s32)  # calls default to 32-token chunks
    for bad in (8, 64, True):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, chunk_size=bad, **flags)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):  # a host copy of offsets the call does not have
        chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, cu_seqlens_cpu=torch.tensor([0, 96]), **flags)
