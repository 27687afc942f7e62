"""The v2 training entry ``chunk_kda_v2`` (forward K1 + F2, backward K1 + B2 + B3) against fp64 autograd.

On the device: the Gluon K1/F2/B2 and the Triton B3 (``gpu``). On the CPU: the same autograd function chaining the
torch emulation of K1, F2 and B2 with B3 under Triton's interpreter (its wiring: argument and gradient order, GVA,
varlen, dtypes), and its argument checks.
"""

import pytest
import torch

from benchmarks.kda.v2_bwd_precision import autograd_grads, make_case, rel_rms
from flashkda.bwd.v2.train import chunk_kda_v2, emulated_stages

KERNEL_BAR, DA_LOG_BAR = 8e-3, 3e-2  # as tests/flashkda/test_bwd_v2_emulate.py
LEAVES = dict(dq="q", dk="k", dv="v", dg="g", dbeta="beta", dA_log="A_log", ddt_bias="dt_bias", dh0="h0")
def train_grads(c, lower_bound, every=None, stages=None, chunk_size=16):
    leaves = {n: (None if c[n] is None else c[n].detach().clone().requires_grad_())
              for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")}
    scale = c["q"].shape[-1] ** -0.5
    o, ht = chunk_kda_v2(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale, leaves["h0"],
                         True, lower_bound, c["cu"], leaves["A_log"], leaves["dt_bias"], every, chunk_size,
                         stages=stages)
    ((o.float() * c["do"].float()).sum() + (ht * c["dht"]).sum()).backward()
    return {n: (None if leaves[x] is None else leaves[x].grad) for n, x in LEAVES.items()}


def check_against_fp64(c, lower_bound, got):
    ref = autograd_grads(c, lower_bound)
    errs = {}
    for n, r in ref.items():
        if r is None:
            assert got[n] is None, n
            continue
        assert got[n] is not None and got[n].shape == r.shape and torch.isfinite(got[n]).all(), n
        errs[n] = rel_rms(got[n], r)
    assert all(e < (DA_LOG_BAR if n == "dA_log" else KERNEL_BAR) for n, e in errs.items()), errs


@pytest.mark.parametrize("chunk_size,head_dim", [(16, 128), (32, 128), (16, 64)])
def test_emulated_stages_against_fp64_autograd(chunk_size, head_dim):
    c = make_case(B=1, T=70, H=1, HV=2, cu=[0, 37, 38, 38, 70], seed=5, K=head_dim)
    got = train_grads(c, -5.0, every=2, stages=emulated_stages(chunk_size), chunk_size=chunk_size)
    check_against_fp64(c, -5.0, got)


def test_bad_arguments():
    c = make_case(B=1, T=32, H=1, seed=1)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"])
    with pytest.raises(ValueError, match="Hopper"):
        chunk_kda_v2(*args)
    with pytest.raises(ValueError, match="every"):
        chunk_kda_v2(*args, every=0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_v2(*args, chunk_size=64)


def test_head_width_scope(monkeypatch):
    """K = 64 trains at 16-token chunks; 32-token chunks and other widths are refused by name."""
    from flashkda.fwd.v2 import chunk_fwd

    monkeypatch.setattr(chunk_fwd, "_device_reason", lambda q: None)
    narrow = make_case(B=1, T=32, H=1, seed=1, K=64)
    args = (narrow["q"], narrow["k"], narrow["v"], narrow["g"], narrow["beta"])
    with pytest.raises(ValueError, match="K = V = 128, got K=64, V=64"):
        chunk_kda_v2(*args, lower_bound=-5.0, chunk_size=32, stages=None)
    wide = make_case(B=1, T=32, H=1, seed=1, K=96)
    with pytest.raises(ValueError, match="K = V = 64 or 128, got K=96"):
        chunk_kda_v2(wide["q"], wide["k"], wide["v"], wide["g"], wide["beta"], lower_bound=-5.0)


GPU_CASES = {
    "fixed": (dict(B=2, T=200, H=2), -5.0),
    "varlen": (dict(B=1, T=300, H=2, cu=[0, 100, 101, 101, 300]), -5.0),
    "gva": (dict(B=1, T=160, H=1, HV=2), -1.0),
    "no_alog_no_h0": (dict(B=1, T=100, H=2, a_log=False, init=False), -0.1),
    "k64_fixed": (dict(B=2, T=200, H=2, K=64), -5.0),
    "k64_varlen_gva": (dict(B=1, T=300, H=1, HV=2, cu=[0, 100, 101, 101, 300], K=64), -1.0),
    "k64_no_alog_no_h0": (dict(B=1, T=100, H=2, a_log=False, init=False, K=64), -0.1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("case", list(GPU_CASES), ids=str)
def test_device_against_fp64_autograd(case, chunk_size):
    kw, lb = GPU_CASES[case]
    if kw.get("K") == 64 and chunk_size == 32:
        pytest.skip("K = 64 trains at 16-token chunks only")
    c = make_case(**kw, seed=3, device="cuda")
    check_against_fp64(c, lb, train_grads(c, lb, chunk_size=chunk_size))
