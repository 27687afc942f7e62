"""Gate sweeps: extreme raw gates and biases, both in-kernel formulas; finite and within tolerance everywhere.

Each call gives every value head its own (g, dt_bias) distribution pair; six rotations cover all 36 pairs.
Tolerance: 1e-5, or twice the error of the same recurrence done token by token in fp32 torch, whichever is
larger (flash-attention's rule): a head whose gate barely decays (g=-8, dt_bias=-4) is ill-conditioned enough
that exact fp32 arithmetic already misses 1e-5.
"""

import pytest
import torch

import flashkda
from flashkda import reference
from tests.flashkda.kda_cases import assert_close, rms_ratio

G_DISTS = ["-8", "-4", "0", "8", "U(-8,8)", "N(0,8)"]
B_DISTS = ["+4", "-4", "+8", "-8", "U", "N"]
T, HV, K, V = 48, 6, 16, 16


def _g(name, gen, shape):
    if name == "U(-8,8)":
        return torch.rand(shape, generator=gen) * 16 - 8
    if name == "N(0,8)":
        return torch.randn(shape, generator=gen) * 8
    return torch.full(shape, float(name))


def _bias(name, gen):
    if name == "U":
        return torch.rand(K, generator=gen) * 16 - 8
    if name == "N":
        return torch.randn(K, generator=gen) * 4
    return torch.full((K,), float(name))


@pytest.mark.parametrize("formula", ["softplus", "bounded"])
@pytest.mark.parametrize("rotation", range(6))
def test_gate_sweep_is_finite_and_accurate(formula, rotation, device):
    gen = torch.Generator().manual_seed(rotation)
    g = torch.stack([_g(G_DISTS[h], gen, (1, T, K)) for h in range(HV)], 2)
    dt_bias = torch.cat([_bias(B_DISTS[(h + rotation) % 6], gen) for h in range(HV)])
    q, k = torch.randn(1, T, 1, K, generator=gen), torch.randn(1, T, 1, K, generator=gen)
    v, beta = torch.randn(1, T, HV, V, generator=gen), torch.randn(1, T, HV, generator=gen)
    A_log = torch.log(torch.rand(HV, generator=gen) * 15 + 1)
    h0 = torch.randn(1, HV, K, V, generator=gen)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, A_log=A_log.to(device), dt_bias=dt_bias.to(device))
    if formula == "bounded":
        kw.update(lower_bound=-5.0, safe_gate=True)
    kw["initial_state"] = h0.to(device)
    args = tuple(x.to(device) for x in (q, k, v, g, beta))
    o, s = flashkda.chunk_kda(*args, **kw)
    ro, rs = reference.chunk_kda_reference(*args, **kw)
    o32, s32 = _torch_fp32_recurrence(args, kw)
    assert_close("o", ro, o, max(1e-5, 2 * rms_ratio(o32, ro)))
    assert_close("final_state", rs, s, max(1e-5, 2 * rms_ratio(s32, rs)))


def _torch_fp32_recurrence(args, kw):
    """The oracle's math in fp32 (gate, norm and sigmoid as the oracle, recurrence as fla's naive, in fp32)."""
    naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta = args
    q, k = reference.l2norm(q).float(), reference.l2norm(k).float()
    g = reference.kda_gate(g, kw["A_log"], kw["dt_bias"], kw.get("lower_bound")).float()
    return naive.naive_recurrent_kda(q, k, v.float(), g, reference.beta_sigmoid(beta).float(),
                                     initial_state=kw["initial_state"].float(), output_final_state=True)
