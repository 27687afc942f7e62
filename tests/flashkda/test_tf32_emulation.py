"""`benchmarks.kda.tf32_emulation`: tf32 rounding, and the v1 backward's tf32 error located in the gated-dots
kernel's diagonal blocks, where the kernel's tf32x3 removes it (CPU, interpreter)."""

import os

import numpy as np
import pytest

from benchmarks.kda import tf32_emulation


def test_round_to_tf32_keeps_ten_mantissa_bits_ties_to_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0**-10)
    x = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-11 + 2.0**-20, -(1 + 3 * 2.0**-11)], dtype=np.float32)
    assert tf32_emulation.round_to_tf32(x).tolist() == [one, one + 2 * ulp, one + ulp, -(one + 2 * ulp)]
    r = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    t = tf32_emulation.round_to_tf32(r)
    assert not (t.view(np.uint32) & 0x1FFF).any()
    assert np.all(np.abs(t - r) <= np.abs(r) * 2.0**-11)


def test_the_fused_chains_gate_gradient_error_comes_from_the_diagonal_blocks_and_tf32x3_removes_it():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels under the CPU interpreter")
    rows = tf32_emulation.study(T=40, heads=1, head_dim=32, seed=12)
    fused = rows["fused tf32"]
    plain = rows["diagonal blocks at plain tf32"]
    diagonal = rows["gated-dots diagonal blocks exact"]
    assert fused["v"] > 0  # the emulation rounds
    for name in ("A_log", "dt_bias", "g"):
        assert plain[name] > 5 * diagonal[name], (name, plain[name], diagonal[name])
        assert plain[name] > 5 * fused[name], (name, plain[name], fused[name])
