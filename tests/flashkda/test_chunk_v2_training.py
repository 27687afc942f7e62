"""``flashkda.chunk_kda``'s training route: ``prefers_v2_training`` (which calls v2 trains exactly, the
``FLASHKDA_KERNELS`` override) and the wiring to ``flashkda.bwd.v2.chunk_kda_v2``.

On the CPU: the rule with the device check passed, each unsupported flag, dtype or shape falling back with its reason,
and ``chunk_kda`` end to end through v2's route with the emulated K1/F2/B2 and B3 under Triton's interpreter against
fp64 autograd (state V-first, GVA, varlen, ``dt_bias`` ``[HV, K]``). On the device (``gpu``): ``chunk_kda``
training through v2 against fla 0.6.0's ``chunk_kda`` and against our v1, fixed length and varlen.
"""

import inspect

import pytest
import torch

import flashkda
import flashkda.chunk as chunk_mod
from benchmarks.kda.v2_bwd_precision import K, autograd_grads, make_case
from flashkda.bwd.v2.train import emulated_stages
from flashkda.fwd.v2 import chunk_fwd
from tests.flashkda.test_bwd_v2_train import check_against_fp64

K3_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-5.0)


def _call(B=1, T=16, H=2, HV=2, D=K, dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
          h0_dtype=torch.float32, cu=None, **flags):
    """The positional arguments of `prefers_v2_training` for CPU tensors of these shapes and ``flags``."""
    q = torch.zeros(B, T, H, D, dtype=dtype)
    v = torch.zeros(B, T, HV, D, dtype=dtype)
    g, beta = torch.zeros(B, T, HV, D, dtype=g_dtype), torch.zeros(B, T, HV, dtype=beta_dtype)
    N = B if cu is None else len(cu) - 1
    kw = dict(K3_FLAGS, initial_state=torch.zeros(N, HV, D, D, dtype=h0_dtype),
              cu_seqlens=None if cu is None else torch.tensor(cu), A_log=torch.zeros(HV),
              dt_bias=torch.zeros(HV * D))
    kw.update(flags)
    return (q, q, v, g, beta), kw


@pytest.fixture
def on_hopper(monkeypatch):
    """The rule as on a Hopper GPU with Gluon: the device check passes for CPU tensors."""
    monkeypatch.delenv(chunk_fwd.KERNELS_ENV, raising=False)
    monkeypatch.setattr(chunk_fwd, "_device_reason", lambda q: None)


@pytest.mark.parametrize("case", [
    dict(), dict(HV=4), dict(T=45, cu=[0, 20, 20, 45]), dict(state_v_first=True), dict(g_dtype=torch.float32),
    dict(beta_dtype=torch.float32), dict(A_log=None), dict(dt_bias=None), dict(initial_state=None),
    dict(lower_bound=-0.5), dict(safe_gate=False), dict(B=3), dict(D=64), dict(D=64, HV=4, T=45, cu=[0, 20, 45]),
], ids=lambda c: ",".join(c) or "k3")
def test_rule_takes_v2(on_hopper, case):
    args, kw = _call(**case)
    assert chunk_fwd.v2_training_unsupported_reason(*args, **kw) is None
    assert chunk_fwd.prefers_v2_training(*args, **kw)


@pytest.mark.parametrize("case,why", [
    (dict(dtype=torch.float16), "bf16"),
    (dict(dtype=torch.float32), "bf16"),
    (dict(D=96), "K = V = 64 or 128"),
    (dict(D=64, chunk_size=32), "K = V = 128, got K=64, V=64 at 32-token chunks"),
    (dict(use_qk_l2norm_in_kernel=False), "in-kernel"),
    (dict(use_gate_in_kernel=False), "in-kernel"),
    (dict(use_beta_sigmoid_in_kernel=False), "in-kernel"),
    (dict(allow_neg_eigval=True), "allow_neg_eigval"),
    (dict(lower_bound=None), "bounded gate"),
    (dict(lower_bound=-6.0), "bounded gate"),
    (dict(h0_dtype=torch.float64), "fp32 initial_state"),
    (dict(B=2, T=45, cu=[0, 20, 45]), "B == 1"),
    (dict(g_dtype=torch.float16), "g in bf16 or fp32"),
    (dict(beta_dtype=torch.float16), "beta in bf16 or fp32"),
    (dict(T=0), "at least one token"),
    (dict(disable_recompute=True), "disable_recompute"),
    (dict(dt_bias=torch.zeros(2 * 64)), "dt_bias"),
    (dict(A_log=torch.zeros(3)), "A_log"),
], ids=lambda c: c if isinstance(c, str) else ",".join(f"{k}={v}" for k, v in c.items() if not torch.is_tensor(v)))
def test_rule_falls_back_with_a_reason(on_hopper, case, why):
    args, kw = _call(**case)
    reason = chunk_fwd.v2_training_unsupported_reason(*args, **kw)
    assert reason is not None and why in reason, reason
    assert not chunk_fwd.prefers_v2_training(*args, **kw)


def test_rule_needs_hopper_and_env_overrides(monkeypatch, on_hopper):
    args, kw = _call()
    monkeypatch.setenv(chunk_fwd.KERNELS_ENV, "v1")
    assert not chunk_fwd.prefers_v2_training(*args, **kw)
    monkeypatch.setenv(chunk_fwd.KERNELS_ENV, "V2")
    assert chunk_fwd.prefers_v2_training(*args, **kw)
    monkeypatch.setenv(chunk_fwd.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="FLASHKDA_KERNELS='fast'"):
        chunk_fwd.prefers_v2_training(*args, **kw)
    monkeypatch.undo()
    assert "Hopper" in chunk_fwd.v2_training_unsupported_reason(*args, **kw)
    assert not chunk_fwd.prefers_v2_training(*args, **kw)


def test_inference_rule_follows_the_env(monkeypatch, on_hopper):
    few = torch.zeros(1, 16, 2, K, dtype=torch.bfloat16)
    args = (few, few, few, few, few[..., 0])
    assert not chunk_fwd.prefers_v2(*args, **K3_FLAGS)  # below MIN_SEQUENCE_HEADS
    monkeypatch.setenv(chunk_fwd.KERNELS_ENV, "v2")
    assert chunk_fwd.prefers_v2(*args, **K3_FLAGS)
    monkeypatch.setenv(chunk_fwd.KERNELS_ENV, "v1")
    many = torch.zeros(1, 16, chunk_fwd.MIN_SEQUENCE_HEADS, K, dtype=torch.bfloat16)
    assert not chunk_fwd.prefers_v2(few, few, many, many, many[..., 0], **K3_FLAGS)


def test_calibration_records_the_path_it_timed(monkeypatch):
    from benchmarks.kda.calibrate import Shape, make_inputs, ours_path

    monkeypatch.delenv(chunk_fwd.KERNELS_ENV, raising=False)
    x, kw = make_inputs(Shape("tiny", 2, 40, 1, (15, 25)), "cpu", grad=True)
    assert ours_path(x, kw, training=True) == "v1 (needs a Hopper (sm_90) GPU)"
    monkeypatch.setattr(chunk_fwd, "_device_reason", lambda q: None)
    assert ours_path(x, kw, training=True) == "v2 (chunk 16)"
    assert ours_path(x, dict(kw, disable_recompute=True), training=True).startswith("v1 (disable_recompute")
    assert ours_path(x, kw, training=False).startswith("v1 (the rule")  # 2 x 2: below MIN_SEQUENCE_HEADS
    monkeypatch.setenv(chunk_fwd.KERNELS_ENV, "v1")
    assert ours_path(x, kw, training=True).startswith("v1 (the rule or FLASHKDA_KERNELS")


class _RoutedToV1(Exception):
    pass


def _v1_route(*args, **kwargs):
    """Stands in for the v1 autograd path: the routing tests only need to see that it was chosen."""
    raise _RoutedToV1(kwargs["disable_recompute"])


def _leaves(c, state_v_first, dt_bias_2d=False):
    """Fresh leaves of a `make_case` case; the initial state in the layout ``state_v_first`` names, ``dt_bias``
    ``[HV, K]`` with ``dt_bias_2d`` (chunk_kda takes it as well as ``[HV * K]``)."""
    x = {n: (None if c[n] is None else c[n].detach().clone()) for n in ("q", "k", "v", "g", "beta", "A_log",
                                                                          "dt_bias", "h0")}
    if state_v_first and x["h0"] is not None:
        x["h0"] = x["h0"].transpose(-1, -2).contiguous()
    if dt_bias_2d:
        x["dt_bias"] = x["dt_bias"].reshape(-1, K)
    return {n: (None if t is None else t.requires_grad_()) for n, t in x.items()}


def test_chunk_kda_trains_through_v2_route_on_emulated_stages(monkeypatch, on_hopper):
    routed = []

    def v2_route(*args, **kwargs):
        routed.append(kwargs)
        return v2_autograd(*args, **kwargs, stages=emulated_stages(chunk_fwd.TRAINING_CHUNK))

    v2_autograd = chunk_mod.chunk_kda_v2_autograd
    monkeypatch.setattr(chunk_mod, "chunk_kda_v2_autograd", v2_route)
    monkeypatch.setattr(chunk_mod, "chunk_kda_autograd", _v1_route)
    c = make_case(B=1, T=50, H=1, HV=2, cu=[0, 21, 22, 22, 50], seed=7)
    x = _leaves(c, state_v_first=True, dt_bias_2d=True)
    o, ht = flashkda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                               output_final_state=True, state_v_first=True, safe_gate=True, cu_seqlens=c["cu"],
                               A_log=x["A_log"], dt_bias=x["dt_bias"], **K3_FLAGS)
    assert len(routed) == 1 and o.dtype == torch.bfloat16 and ht.shape == x["h0"].shape
    ((o.float() * c["do"].float()).sum() + (ht * c["dht"].transpose(-1, -2)).sum()).backward()
    got = dict(dq=x["q"].grad, dk=x["k"].grad, dv=x["v"].grad, dg=x["g"].grad, dbeta=x["beta"].grad,
               dA_log=x["A_log"].grad, ddt_bias=x["dt_bias"].grad.reshape(-1), dh0=x["h0"].grad.transpose(-1, -2))
    assert x["dt_bias"].grad.shape == x["dt_bias"].shape and x["h0"].grad.dtype == torch.float32
    check_against_fp64(c, -5.0, got)


def test_chunk_kda_keeps_v1_for_disable_recompute(monkeypatch, on_hopper):
    monkeypatch.setattr(chunk_mod, "chunk_kda_autograd", _v1_route)
    c = make_case(B=1, T=16, H=1, seed=1)
    x = _leaves(c, state_v_first=False)
    with pytest.raises(_RoutedToV1, match="True"):
        flashkda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], A_log=x["A_log"],
                           dt_bias=x["dt_bias"], disable_recompute=True, **K3_FLAGS)


# The device checks: chunk_kda (v2 route) against fla 0.6.0 and against v1 (FLASHKDA_KERNELS=v1), both bf16.
GPU_CASES = {
    "fixed": dict(B=2, T=300, H=2, HV=4),
    "varlen": dict(B=1, T=420, H=2, cu=[0, 100, 137, 420]),
    "k64_varlen_gva": dict(B=1, T=300, H=2, HV=4, cu=[0, 100, 137, 300], K=64),
}
#: o and the final state against the other bf16 paths (relative RMS); each gradient against fp64 autograd: v2 at
#: most `GRAD_SLACK` times the other path's error, or under `GRAD_FLOOR` (bf16 noise at these small shapes)
OUT_TOL, GRAD_SLACK, GRAD_FLOOR = 1e-2, 1.25, 1e-2


def _device_step(fn, c, **extra):
    x = _leaves(c, state_v_first=True)
    o, ht = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
               state_v_first=True, safe_gate=True, cu_seqlens=c["cu"], A_log=x["A_log"], dt_bias=x["dt_bias"],
               **K3_FLAGS, **extra)
    ((o.float() * c["do"].float()).sum() + (ht * c["dht"].transpose(-1, -2)).sum()).backward()
    grads = {f"d{n}": x[n].grad for n in x}
    grads["dh0"] = grads["dh0"].transpose(-1, -2)  # K-first, as the fp64 reference's
    return dict(o=o, final_state=ht, **grads)


def _rel(got, ref):
    return float((got.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def _assert_as_close(ours, other, ref, label):
    """o and the final state within `OUT_TOL` of ``other``; every gradient at least about as close to the fp64
    ``ref`` as ``other``'s."""
    for n in ("o", "final_state"):
        assert _rel(ours[n], other[n]) < OUT_TOL, (label, n, _rel(ours[n], other[n]))
    for n, r in ref.items():
        assert ours[n] is not None and ours[n].shape == r.shape and torch.isfinite(ours[n]).all(), (label, n)
        mine, theirs = _rel(ours[n], r), _rel(other[n], r)
        assert mine < max(GRAD_SLACK * theirs, GRAD_FLOOR), (label, n, mine, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_device_chunk_kda_training_v2_against_fla_and_v1(monkeypatch, case):
    monkeypatch.delenv(chunk_fwd.KERNELS_ENV, raising=False)
    c = make_case(**GPU_CASES[case], seed=11, device="cuda")
    routed = []
    v2_autograd = chunk_mod.chunk_kda_v2_autograd
    monkeypatch.setattr(chunk_mod, "chunk_kda_v2_autograd", lambda *a, **kw: routed.append(1) or v2_autograd(*a, **kw))
    ours = _device_step(flashkda.chunk_kda, c)
    assert routed == [1], "chunk_kda did not train through v2 on this device"
    monkeypatch.setenv(chunk_fwd.KERNELS_ENV, "v1")
    v1 = _device_step(flashkda.chunk_kda, c)
    assert routed == [1], "FLASHKDA_KERNELS=v1 still ran v2"
    ref = autograd_grads(c, K3_FLAGS["lower_bound"])
    _assert_as_close(ours, v1, ref, "v2 vs v1")
    fla_chunk = pytest.importorskip("fla.ops.kda.chunk")
    fla = _device_step(inspect.unwrap(fla_chunk.chunk_kda), c)  # fla's own path, not dispatched to us
    _assert_as_close(ours, fla, ref, "v2 vs fla")
