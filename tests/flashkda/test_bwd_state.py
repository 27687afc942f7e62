"""The training state passes of ``flashkda.bwd.state`` (recompute and reverse) against fp64 torch recurrences.

Chunk-local inputs (``w, u, qg, Aqk, kend, dec``) come from ``chunk_local_prepare`` in fp64 on random chunked
inputs (varlen tails zero padded) and are given to the kernels in fp32. Each pass is checked against the module
docstring's recurrence in fp64 twice: with every product's operands rounded as the kernel rounds them (bf16 for
``dot_precision="tf32"``; a tight bound, since only accumulation order and fp32 sums differ) and exact (the suite's
budgets: 1e-4 for fp32 callers, 1e-2 for bf16). The explicit backward recurrence is itself checked against fp64
autograd through the forward one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from flashkda.bwd.layout import make_layout, to_chunks
from flashkda.bwd.local import chunk_local_prepare
from flashkda.bwd.state import chunk_kda_bwd_dh, chunk_kda_recompute_h
from tests.flashkda.kda_cases import assert_close

C = 64
#: Budgets against the exact fp64 recurrence (the training suite's), and against the one with the kernel's roundings.
BUDGET = {"ieee": 1e-4, "tf32": 1e-2}
SAME_ROUNDING = {"ieee": 1e-6, "tf32": 1e-4}


@dataclass(frozen=True)
class StateCase:
    lengths: tuple[int, ...]
    K: int
    V: int
    HV: int = 1
    dot_precision: str = "ieee"  # "tf32": a bf16/fp16 caller (bf16 operands)
    h0: bool = True
    dht: bool = True


CASES = [
    pytest.param(StateCase((70,), 32, 64), id="K32-V64-T70-ieee"),
    pytest.param(StateCase((45, 0, 105), 128, 32, HV=2, h0=False), id="K128-V32-cu45-0-105-ieee-noh0"),
    pytest.param(StateCase((100,), 256, 64, dht=False), id="K256-V64-T100-ieee-nodht"),
    pytest.param(StateCase((30, 0, 100), 128, 64, dot_precision="tf32"), id="K128-V64-cu30-0-100-bf16"),
    pytest.param(StateCase((90,), 32, 48, HV=2, dot_precision="tf32", h0=False, dht=False),
                 id="K32-V48-T90-bf16-noh0-nodht"),
    pytest.param(StateCase((80,), 256, 32, dot_precision="tf32"), id="K256-V32-T80-bf16"),
]


def _chunked_inputs(case: StateCase, device: str):
    """fp64 chunk-local quantities, chunk offsets, initial state, ``do`` and ``dht`` for a case."""
    gen = torch.Generator().manual_seed(case.K * 1000 + case.V * 10 + len(case.lengths))
    T, HV, K, V = sum(case.lengths), case.HV, case.K, case.V
    cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()])
    layout = make_layout(1, T, cu, C, torch.device(device))

    def chunks(*shape, fn=lambda x: x):
        return to_chunks(fn(torch.randn(1, T, HV, *shape, generator=gen, dtype=torch.float64)).to(device), layout)

    q, k = (chunks(K, fn=lambda x: F.normalize(x, dim=-1)) for _ in range(2))
    v = chunks(V)
    g = chunks(K, fn=lambda x: F.logsigmoid(x + 4.0))  # mild decay, so the state carries across chunks
    beta = chunks(1, fn=lambda x: torch.sigmoid(x))[..., 0]
    local = chunk_local_prepare(q, k, v, g, beta, K**-0.5)
    N = len(case.lengths)
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64).to(device) if case.h0 else None
    do = torch.randn(layout.num_chunks, HV, C, V, generator=gen, dtype=torch.float64).to(device)
    dht = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64).to(device) if case.dht else None
    return local, layout.chunk_offsets, h0, do, dht


def _rounding(dot_precision: str):
    if dot_precision == "tf32":
        return lambda x: x.to(torch.bfloat16).double()
    return lambda x: x


def _ref_fwd(local, offsets, h0, rnd):
    """``(o, final_state, h, v_new)`` of the forward recurrence, operands of every product through ``rnd`` (``o``
    for `test_reference_backward_is_fp64_autograd`'s loss)."""
    HV, K, V = local.w.shape[1], local.w.shape[-1], local.u.shape[-1]
    o, h, v_new, ht = [], [], [], []
    for n in range(len(offsets) - 1):
        S = h0[n] if h0 is not None else local.w.new_zeros(HV, K, V)
        for c in range(int(offsets[n]), int(offsets[n + 1])):
            h.append(S)
            vn = local.u[c] - rnd(local.w[c]) @ rnd(S)
            o.append(rnd(local.qg[c]) @ rnd(S) + rnd(local.aqk[c]) @ rnd(vn))
            S = local.dec[c][..., None] * S + rnd(local.kend[c]).mT @ rnd(vn)
            v_new.append(vn)
        ht.append(S)
    stack = lambda xs, shape: torch.stack(xs) if xs else local.w.new_zeros(0, *shape)  # noqa: E731
    return stack(o, (HV, C, V)), torch.stack(ht), stack(h, (HV, K, V)), stack(v_new, (HV, C, V))


def _ref_bwd(local, offsets, do, dht, rnd):
    """``(dv_new, dh at every chunk end, dh0)`` of the reverse recurrence, operands through ``rnd``."""
    HV, K, V = local.w.shape[1], local.w.shape[-1], do.shape[-1]
    dv_new, dhe = torch.zeros_like(do), do.new_zeros(local.w.shape[0], HV, K, V)
    dh0 = []
    for n in range(len(offsets) - 1):
        dS = dht[n] if dht is not None else do.new_zeros(HV, K, V)
        for c in reversed(range(int(offsets[n]), int(offsets[n + 1]))):
            dhe[c] = dS
            dvn = rnd(local.aqk[c]).mT @ rnd(do[c]) + rnd(local.kend[c]) @ rnd(dS)
            dS = local.dec[c][..., None] * dS + rnd(local.qg[c]).mT @ rnd(do[c]) - rnd(local.w[c]).mT @ rnd(dvn)
            dv_new[c] = dvn
        dh0.append(dS)
    return dv_new, dhe, torch.stack(dh0)


def _fwd(local, offsets, h0, dot_precision, *, store_h=True, store_final_state=True, **launch):
    f32 = lambda x: None if x is None else x.float().contiguous()  # noqa: E731
    return chunk_kda_recompute_h(f32(local.w), f32(local.u), f32(local.kend), f32(local.dec), f32(h0), offsets,
                           store_h=store_h, store_final_state=store_final_state, dot_precision=dot_precision, **launch)


def _bwd(local, offsets, do, dht, dot_precision, **launch):
    f32 = lambda x: None if x is None else x.float().contiguous()  # noqa: E731
    # bf16/fp16 callers may pass do in their own dtype (exact, see chunk_kda_bwd_dh)
    do = do.to(torch.bfloat16) if dot_precision == "tf32" else f32(do)
    return chunk_kda_bwd_dh(f32(local.qg), f32(local.aqk), f32(local.kend), f32(local.dec), f32(local.w), do,
                            f32(dht), offsets, store_dh0=True, dot_precision=dot_precision, **launch)


@pytest.mark.parametrize("case", CASES)
def test_forward_state_pass(case: StateCase, device: str) -> None:
    local, offsets, h0, _, _ = _chunked_inputs(case, device)
    rnd = _rounding(case.dot_precision)
    exact, rounded = _ref_fwd(local, offsets, h0, lambda x: x), _ref_fwd(local, offsets, h0, rnd)
    ours = _fwd(local, offsets, h0, case.dot_precision)
    for name, x, ref, ref_r in zip(("final state", "h", "v_new"), ours, exact[1:], rounded[1:]):
        assert x.dtype == torch.float32
        assert_close(name, ref_r, x, SAME_ROUNDING[case.dot_precision])
        assert_close(name, ref, x, BUDGET[case.dot_precision])
    # the backward's recompute (no final state) and the fp64 forward (no h) store the same tensors
    ht, h, v_new = _fwd(local, offsets, h0, case.dot_precision, store_final_state=False)
    assert ht is None and torch.equal(h, ours[1]) and torch.equal(v_new, ours[2])
    ht, h, v_new = _fwd(local, offsets, h0, case.dot_precision, store_h=False)
    assert h is None and torch.equal(ht, ours[0]) and torch.equal(v_new, ours[2])


@pytest.mark.parametrize("case", CASES)
def test_backward_state_pass(case: StateCase, device: str) -> None:
    local, offsets, _, do, dht = _chunked_inputs(case, device)
    rnd = _rounding(case.dot_precision)
    exact, rounded = _ref_bwd(local, offsets, do, dht, lambda x: x), _ref_bwd(local, offsets, do, dht, rnd)
    ours = _bwd(local, offsets, do, dht, case.dot_precision)
    for name, x, ref, ref_r in zip(("dv_new", "dh", "dh0"), ours, exact, rounded):
        assert x.dtype == torch.float32
        assert_close(name, ref_r, x, SAME_ROUNDING[case.dot_precision])
        assert_close(name, ref, x, BUDGET[case.dot_precision])


def test_reference_backward_is_fp64_autograd(device: str) -> None:
    """The explicit reverse recurrence the kernels are checked against is the gradient of ``<o, do> + <final state,
    dht>``: ``dv_new`` and ``dh`` w.r.t. ``v_new`` and the states at chunk ends, ``dh0`` w.r.t. the initial state
    (varlen with an empty sequence and a tail chunk)."""
    case = StateCase((45, 0, 100), 32, 48, HV=2)
    local, offsets, h0, do, dht = _chunked_inputs(case, device)
    h0 = h0.clone().requires_grad_()
    # zero perturbations of v_new and of every chunk-end state: their gradients are the total derivatives
    z_v = torch.zeros_like(do, requires_grad=True)
    z_s = do.new_zeros(local.w.shape[0], case.HV, case.K, case.V, requires_grad=True)
    loss = 0.0
    for n in range(len(offsets) - 1):
        S = h0[n]
        for c in range(int(offsets[n]), int(offsets[n + 1])):
            vn = local.u[c] - local.w[c] @ S + z_v[c]
            loss = loss + ((local.qg[c] @ S + local.aqk[c] @ vn) * do[c]).sum()
            S = local.dec[c][..., None] * S + local.kend[c].mT @ vn + z_s[c]
        loss = loss + (S * dht[n]).sum()
    autograd = torch.autograd.grad(loss, (z_v, z_s, h0))
    for name, ref, x in zip(("dv_new", "dh", "dh0"), autograd, _ref_bwd(local, offsets, do, dht, lambda x: x)):
        torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-10, msg=name)


def test_invalid_launch_arguments_are_rejected(device: str) -> None:
    z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
    offsets = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for K, kw, match in ((512, {}, "K <= 256"), (32, dict(block_v=24), "block_v"),
                         (32, dict(dot_precision="tf32x3"), "dot_precision")):
        with pytest.raises(ValueError, match=match):
            chunk_kda_recompute_h(z(1, 1, C, K), z(1, 1, C, 32), z(1, 1, C, K), z(1, 1, K), None, offsets,
                                  store_h=False, store_final_state=False, **kw)
        with pytest.raises(ValueError, match=match):
            chunk_kda_bwd_dh(z(1, 1, C, K), z(1, 1, C, C), z(1, 1, C, K), z(1, 1, K), z(1, 1, C, K), z(1, 1, C, 32),
                             None, offsets, store_dh0=False, **kw)
