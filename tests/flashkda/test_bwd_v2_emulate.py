"""CPU tests of the v2 backward's torch emulation against autograd through the fp64 reference."""

import pytest
import torch

from benchmarks.kda.v2_bwd_precision import K, errors, make_case
from flashkda.bwd.v2.checkpoints import checkpoint_offsets, emulate_recurrence_train
from flashkda.bwd.v2.emulate import emulate_backward
from flashkda.fwd.v2.emulate import emulate_prepare, emulate_recurrence
from flashkda.fwd.v2.workspace import build_chunk_layout

CPU = torch.device("cpu")


# Bars. exact: the algebra, fp64 with no rounding, must equal autograd to fp64 rounding (measured <= 1.2e-14).
# Kernel precision: every operand of a product is bf16 (as the forward's K2 and FlashKDA), so each gradient carries
# a few bf16 half-ulps (2^-9 = 2e-3) summed over the chunk and the chain; measured 1.5e-3 to 4.4e-3 per tensor at
# T <= 130 for chunk 16 and 32, and 6.6e-3 for dbeta (a signed sum over V) with seed 3 at both chunk sizes. For
# scale, the fp64 gradients move by 1.7e-3 to 3.7e-3 under a 2^-9 relative perturbation of q, k, v, g. Bar 8e-3.
# dA_log is one signed sum over all tokens and channels per head, so its error is relative to a sum much smaller
# than its terms: measured up to 2.2e-2 (chunk 16, fixed case) with the same per-term errors; bar 3e-2.
EXACT_BAR = 1e-10
KERNEL_BAR = 8e-3
DA_LOG_BAR = 3e-2


def within_kernel_bars(err):
    return all(e < (DA_LOG_BAR if n == "dA_log" else KERNEL_BAR) for n, e in err.items())

CASES = {
    "fixed": dict(B=2, T=64, H=2),
    "varlen": dict(B=1, T=130, H=2, cu=[0, 50, 51, 51, 130]),
    "gva": dict(B=1, T=48, H=1, HV=2),
    "no_alog_no_h0": dict(B=1, T=40, H=2, a_log=False, init=False),
}


@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_exact_equals_autograd(case):
    err = errors(make_case(**CASES[case]), -5.0, exact=True)
    assert max(err.values()) < EXACT_BAR, err


@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_kernel_precision_within_bar(case):
    err = errors(make_case(**CASES[case]), -5.0, exact=False, every=2)
    assert within_kernel_bars(err), err


CASES32 = {"fixed": dict(B=1, T=96, H=2), "varlen": dict(B=1, T=130, H=1, cu=[0, 70, 71, 71, 130], HV=2)}


@pytest.mark.parametrize("case", list(CASES32), ids=str)
def test_chunk32_exact_equals_autograd(case):
    err = errors(make_case(**CASES32[case], seed=3), -5.0, exact=True, chunk=32)
    assert max(err.values()) < EXACT_BAR, err


@pytest.mark.parametrize("case", list(CASES32), ids=str)
@pytest.mark.parametrize("lower_bound", [-5.0, -0.1])
def test_chunk32_kernel_precision_within_bar(case, lower_bound):
    err = errors(make_case(**CASES32[case], seed=3), lower_bound, exact=False, every=2, chunk=32)
    assert within_kernel_bars(err), err


@pytest.mark.parametrize("chunk", [16, 32])
def test_head_width_64(chunk):
    """The emulation (forward and backward) is width-free: at K = V = 64 (varlen GVA) exact equals autograd, and the
    bf16 roundings stay within the kernel bars. It is the oracle for 64-wide kernels (the kernels are 128 only)."""
    c = make_case(B=1, T=90, H=1, HV=2, cu=[0, 41, 42, 90], seed=5, K=64)
    assert c["q"].shape[-1] == 64 and c["dt_bias"].shape == (2 * 64,)
    exact = errors(c, -5.0, exact=True, chunk=chunk)
    assert max(exact.values()) < EXACT_BAR, exact
    err = errors(c, -5.0, exact=False, every=2, chunk=chunk)
    assert within_kernel_bars(err), err


@pytest.mark.parametrize("lower_bound", [-3.0, -1.0, -0.1])
def test_kernel_precision_gate_sweep(lower_bound):
    err = errors(make_case(B=1, T=64, H=2, seed=1), lower_bound, exact=False)
    assert within_kernel_bars(err), err


def test_fp32_checkpoints_no_worse_than_bf16():
    c = make_case(B=1, T=96, H=1, seed=2)
    e16 = errors(c, -1.0, exact=False, every=1)
    e32 = errors(c, -1.0, exact=False, every=1, ck_dtype=torch.float32)
    assert within_kernel_bars(e16) and within_kernel_bars(e32), (e16, e32)
    assert e32["dh0"] <= e16["dh0"] * 1.05, (e16, e32)


def test_training_forward_matches_forward_and_checkpoints():
    c = make_case(B=1, T=100, H=2, cu=[0, 37, 37, 100])
    layout = build_chunk_layout(1, 100, c["cu"], CPU)
    ws = emulate_prepare(c["q"], c["k"], c["g"], c["beta"], K**-0.5, layout, -5.0, c["A_log"], c["dt_bias"])
    o, s = emulate_recurrence(ws, c["v"], c["h0"], True)
    o2, s2, ck = emulate_recurrence_train(ws, c["v"], c["h0"], 2, torch.float32)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    offsets = checkpoint_offsets(layout, 2)
    assert offsets.tolist() == [0, 2, 2, 4]  # 3, 0 and 4 chunks of 16 tokens
    assert torch.equal(ck[0], c["h0"][0]) and torch.equal(ck[2], c["h0"][2])

    # the checkpoint of chunk 2 of sequence 0 is its state after 32 tokens: the forward over those tokens alone
    short = build_chunk_layout(1, 32, None, CPU)
    ws_s = emulate_prepare(*(c[n][:, :32] for n in ("q", "k", "g", "beta")), K**-0.5, short, -5.0, c["A_log"],
                           c["dt_bias"])
    _, s_short = emulate_recurrence(ws_s, c["v"][:, :32], c["h0"][:1], True)
    assert torch.equal(ck[1], s_short[0])


def test_bad_arguments():
    c = make_case(B=1, T=16, H=1)
    layout = build_chunk_layout(1, 16, None, CPU)
    with pytest.raises(ValueError, match="every"):
        checkpoint_offsets(layout, 0)
    with pytest.raises(ValueError, match="checkpoints"):
        emulate_backward(c["q"], c["k"], c["v"], c["g"], c["beta"], K**-0.5, layout, -5.0, c["do"])
    ws = emulate_prepare(c["q"], c["k"], c["g"], c["beta"], K**-0.5, layout, -5.0)
    with pytest.raises(ValueError, match="checkpoint_dtype"):
        emulate_recurrence_train(ws, c["v"], None, 1, torch.float16)


def test_precision_report_rows():
    from benchmarks.kda.v2_bwd_precision import describe, run, worst_ratio

    rows = run("cpu", 32, write=False, seeds=2)
    assert len(rows) == 4
    assert all(0 < e < DA_LOG_BAR for r in rows for e in r.extra.values())
    assert all(r.params["seeds"] == 2 for r in rows)
    one = run("cpu", 32, write=False)
    assert all(o.extra.keys() == r.extra.keys() and o.extra != r.extra for o, r in zip(one, rows))
    with pytest.raises(ValueError, match="seeds"):
        run("cpu", 32, write=False, seeds=0)
    fixed = run("cpu", 32, write=False, kinds=("fixed",), lower_bounds=(-5.0,))
    assert [r.case for r in fixed] == ["fixed-T32-H4-lb-5.0"] and fixed[0].extra == one[0].extra
    with pytest.raises(ValueError, match="kinds"):
        run("cpu", 32, write=False, kinds=("packed",))
    extra = {"fla dq": 2e-3, "ours c16 dq": 3e-3, "fla dk": 4e-3, "ours c16 dk": 2e-3, "ours c16 dv": 1e-3}
    summary = worst_ratio(extra)
    assert summary["ours / fla worst tensor"] == "dq"
    assert summary["ours / fla worst ratio"] == pytest.approx(1.5)
    line = describe({**extra, **summary})
    assert "ours / fla worst tensor dq" in line and "ours / fla worst ratio 1.50e+00" in line
    assert worst_ratio({"ours c16 dq": 1e-3}) == {}
