"""FlashKDA forward v2: the chunk layout, the torch emulation of its kernels against the fp64 oracle (CPU), and the
Gluon kernels against the emulation (``gpu``)."""

import dataclasses

import pytest
import torch

from flashkda import reference
from flashkda.fwd.v2.emulate import emulate_chunk_kda, emulate_prepare, neumann_inverse
from flashkda.fwd.v2.workspace import CHUNK, build_chunk_layout, cached_chunk_layout
from tests.flashkda.kda_cases import assert_close

K = 128
CPU = torch.device("cpu")


def make_inputs(B, T, H, N, seed=0, init=True, a_log=True, device=CPU, HV=None):
    """q, k ``[B, T, H, K]``; v, g ``[B, T, HV, K]`` (HV defaults to H); beta, A_log, dt_bias, h0 for HV heads."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = (randn(B, T, H, K).to(device, torch.bfloat16) for _ in range(2))
    v, g = (randn(B, T, HV, K).to(device, torch.bfloat16) for _ in range(2))
    beta = randn(B, T, HV).to(device, torch.bfloat16)
    A_log = (torch.rand(HV, generator=gen) * 2 - 1).to(device) if a_log else None
    dt_bias = (randn(HV * K) * 0.5).to(device)
    h0 = (randn(N, HV, K, K) * 0.1).to(device) if init else None
    return q, k, v, g, beta, A_log, dt_bias, h0


def run_both(B, T, H, cu=None, lower_bound=-5.0, init=True, a_log=True, seed=0, HV=None):
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    N = B if cu is None else len(cu) - 1
    q, k, v, g, beta, A_log, dt_bias, h0 = make_inputs(B, T, H, N, seed, init, a_log, HV=HV)
    layout = build_chunk_layout(B, T, cu_t, CPU)
    o, s = emulate_chunk_kda(q, k, v, g, beta, K**-0.5, layout, lower_bound, A_log, dt_bias, h0, True)
    ro, rs = reference.chunk_kda_reference(
        q, k, v, g, beta, K**-0.5, h0, True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, cu_seqlens=cu_t, A_log=A_log, dt_bias=dt_bias)
    return (o, s), (ro, rs)


def expected_index(lengths):
    rows, starts, first = [], [0], 0
    for n, length in enumerate(lengths):
        for c in range(-(-length // CHUNK)):
            rows.append([n, first + c * CHUNK, min(CHUNK, length - c * CHUNK)])
        starts.append(len(rows))
        first += length
    return rows, starts


@pytest.mark.parametrize("lengths", [(50,), (16, 0, 1, 17, 33), (0,), (5, 0, 0, 32)], ids=str)
def test_varlen_layout_matches_python(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    T = int(cu[-1])
    layout = build_chunk_layout(1, T, cu, CPU)
    rows, starts = expected_index(lengths)
    assert layout.num_chunks >= len(rows)
    assert layout.chunk_index.dtype == torch.int32 and layout.chunk_index.shape == (layout.num_chunks, 3)
    assert layout.chunk_index[: len(rows)].tolist() == rows
    assert layout.chunk_index[len(rows):].tolist() == [[-1, 0, 0]] * (layout.num_chunks - len(rows))
    assert layout.seq_chunks.tolist() == starts
    assert layout.cu_seqlens.tolist() == cu.tolist()
    if len(lengths) > 1:  # longest first, ties in sequence order
        assert layout.seq_order.tolist() == sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    else:
        assert layout.seq_order is None


def test_cached_layout_reuses_and_rebuilds():
    cu = torch.tensor([0, 20, 50], dtype=torch.int64)
    first = cached_chunk_layout(1, 50, cu, CPU)
    assert cached_chunk_layout(1, 50, cu, CPU) is first
    assert cached_chunk_layout(1, 50, cu.clone(), CPU) is not first  # another tensor object
    cu[1] = 30  # modified in place: the cached layout is stale
    again = cached_chunk_layout(1, 50, cu, CPU)
    assert again is not first and again.chunk_index[:4, 2].tolist() == [16, 14, 16, 4]
    fixed = cached_chunk_layout(2, 40, None, CPU)
    assert cached_chunk_layout(2, 40, None, CPU) is fixed and cached_chunk_layout(2, 41, None, CPU) is not fixed
    assert cached_chunk_layout(2, 40, None, CPU, 32) is not fixed  # another chunk size


def test_cached_layout_in_inference_mode_is_built_every_call():
    # inference tensors have no modification counter: an in-place change must never meet a stale layout
    with torch.inference_mode():
        cu = torch.tensor([0, 20, 50], dtype=torch.int64)
        first = cached_chunk_layout(1, 50, cu, CPU)
        cu[1] = 30
        again = cached_chunk_layout(1, 50, cu, CPU)
        fixed = cached_chunk_layout(3, 40, None, CPU)
    assert first.chunk_index[:2, 2].tolist() == [16, 4] and again.chunk_index[:2, 2].tolist() == [16, 14]
    assert cached_chunk_layout(3, 40, None, CPU) is fixed


def test_fixed_layout_matches_python():
    layout = build_chunk_layout(3, 40, None, CPU)
    rows, starts = expected_index((40, 40, 40))
    assert layout.num_chunks == len(rows) and layout.max_chunks_per_seq == 3
    assert layout.chunk_index.tolist() == rows
    assert layout.seq_chunks.tolist() == starts
    assert layout.seq_order.tolist() == [0, 1, 2] and layout.chunk == CHUNK


def test_workspace_shapes_and_dtypes():
    B, T, H = 2, 40, 3
    q, k, v, g, beta, A_log, dt_bias, _ = make_inputs(B, T, H, B)
    ws = emulate_prepare(q, k, g, beta, K**-0.5, build_chunk_layout(B, T, None, CPU), -5.0, A_log, dt_bias)
    NT = 6
    for name, shape, dtype in [("kd", (B * T, H, K), torch.bfloat16), ("qd", (B * T, H, K), torch.bfloat16),
                               ("kr", (B * T, H, K), torch.bfloat16), ("inv", (NT, H, 16, 16), torch.bfloat16),
                               ("mqk", (NT, H, 16, 16), torch.bfloat16), ("glast", (NT, H, K), torch.float32),
                               ("beta", (B * T, H), torch.float32)]:
        x = getattr(ws, name)
        assert x.shape == shape and x.dtype == dtype and x.is_contiguous(), name
    # a partial chunk's inverse and Mqk are zero past its last token (8 valid tokens in chunk 2)
    assert ws.inv[2, :, 8:].abs().sum() == 0 and ws.mqk[2, :, 8:].abs().sum() == 0
    assert torch.all(ws.glast > 0) and torch.all(ws.glast <= 1)


def test_neumann_inverse_inverts_unit_lower_triangular():
    gen = torch.Generator().manual_seed(1)
    L = torch.tril(torch.rand(64, CHUNK, CHUNK, generator=gen) * 0.6 - 0.3, -1)
    inv = neumann_inverse(L).double()
    eye = torch.eye(CHUNK, dtype=torch.float64)
    exact = torch.linalg.inv(eye + L.double())
    assert torch.allclose(torch.triu(inv, 1), torch.zeros_like(inv))
    assert ((inv - exact).norm() / exact.norm()).item() < 2e-3


@pytest.mark.parametrize(
    "B, T, H, cu, init",
    [(2, 100, 2, None, True), (1, 64, 1, None, False), (1, 200, 2, (0, 0, 1, 50, 51, 200), True),
     (1, 15, 1, (0, 15), True)],
    ids=["fixed-B2-T100-h0", "fixed-T64", "varlen-empty-1tok-partial", "one-partial-chunk"],
)
def test_emulation_matches_fp64(B, T, H, cu, init):
    (o, s), (ro, rs) = run_both(B, T, H, cu, init=init)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close("o", ro, o, 5e-3 if cu is None else 6e-3)
    assert_close("final_state", rs, s, 1e-2)


def test_emulation_gva_matches_fp64():
    (o, s), (ro, rs) = run_both(1, 70, 1, (0, 33, 70), HV=3, seed=9)
    assert o.shape == (1, 70, 3, K) and s.shape == (2, 3, K, K)
    assert_close("o", ro, o, 6e-3)
    assert_close("final_state", rs, s, 1e-2)


@pytest.mark.parametrize("lower_bound", [-5.0, -2.0, -0.5, -0.1])
@pytest.mark.parametrize("a_log", [True, False], ids=["A_log", "no-A_log"])
def test_gate_sweep_is_finite_and_accurate(lower_bound, a_log):
    (o, s), (ro, rs) = run_both(1, 96, 1, (0, 41, 96), lower_bound=lower_bound, a_log=a_log, seed=3)
    assert_close("o", ro, o, 6e-3)
    assert_close("final_state", rs, s, 1e-2)


def test_large_gate_logits_stay_finite():
    B, T, H = 1, 64, 1
    q, k, v, g, beta, _, dt_bias, h0 = make_inputs(B, T, H, B, seed=4)
    A_log = torch.full((H,), 6.0)  # exp(A_log) ~ 400: saturated sigmoids, the gate sits at 0 or lower_bound
    o, s = emulate_chunk_kda(q, k, v, g * 50, beta * 50, K**-0.5, build_chunk_layout(B, T, None, CPU), -5.0, A_log,
                             dt_bias, h0, True)
    assert torch.isfinite(o.float()).all() and torch.isfinite(s).all()


def test_earlier_outputs_ignore_future_gates():
    B, T, H = 1, 80, 1
    q, k, v, g, beta, A_log, dt_bias, _ = make_inputs(B, T, H, B, seed=5)
    layout = build_chunk_layout(B, T, None, CPU)
    o1, _ = emulate_chunk_kda(q, k, v, g, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
    g2 = g.clone()
    g2[:, 37:] = torch.randn(B, T - 37, H, K).to(torch.bfloat16) * 4
    o2, _ = emulate_chunk_kda(q, k, v, g2, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
    assert torch.equal(o1[:, :37], o2[:, :37])
    assert not torch.equal(o1[:, 37:], o2[:, 37:])


def test_v2_entry_rejects_what_it_does_not_serve_and_imports_no_kernel():
    import subprocess
    import sys

    from flashkda.fwd.v2 import chunk_kda_fwd_v2, supports_v2

    q = torch.zeros(1, 4, 2, K, dtype=torch.bfloat16)
    assert not supports_v2(q, q, q, q, q[..., 0], lower_bound=-5.0)
    with pytest.raises(ValueError, match="Hopper"):
        chunk_kda_fwd_v2(q, q, q, q, q[..., 0], 1.0, lower_bound=-5.0)
    code = ("import sys, flashkda, flashkda.fwd.v2; "
            "sys.exit(any(m.endswith(('prepare_kernel', 'recurrence_kernel')) for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_v2_checks_the_host_offsets_it_is_given():
    from flashkda.fwd.v2.chunk_fwd import _check_cu_seqlens_cpu

    cu = torch.tensor([0, 3, 7])
    _check_cu_seqlens_cpu(cu, cu.clone())
    _check_cu_seqlens_cpu(None, None)
    for cu_dev, cu_cpu in ((None, cu), (cu, cu[:2]), (cu, cu.to("meta"))):
        with pytest.raises(ValueError, match="cu_seqlens_cpu"):
            _check_cu_seqlens_cpu(cu_dev, cu_cpu)


# ---- device: the Gluon kernels (run on the H200 with -m gpu)

GPU_CASES = [
    pytest.param(2, 200, 3, None, True, 3, id="fixed-B2-T200-H3"),
    pytest.param(1, 1000, 2, (0, 0, 1, 300, 317, 1000), True, 2, id="varlen-empty-1tok-partial"),
    pytest.param(1, 515, 2, (0, 515), False, 2, id="varlen-one-seq-no-A_log"),
    pytest.param(1, 300, 2, (0, 100, 300), True, 4, id="varlen-gva-H2-HV4"),
]


def gpu_inputs(B, T, H, cu, a_log, seed, HV):
    dev = torch.device("cuda")
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64, device=dev)
    N = B if cu is None else len(cu) - 1
    return cu_t, make_inputs(B, T, H, N, seed=seed, a_log=a_log, device=dev, HV=HV)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, cu, a_log, HV", GPU_CASES)
def test_prepare_kernel_matches_emulation(B, T, H, cu, a_log, HV):
    from flashkda.fwd.v2.prepare import prepare_fwd

    cu_t, (q, k, _, g, beta, A_log, dt_bias, _) = gpu_inputs(B, T, H, cu, a_log, 7, HV)
    layout = build_chunk_layout(B, T, cu_t, q.device)
    ref = emulate_prepare(q, k, g, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
    ws = prepare_fwd(q, k, g, beta, K**-0.5, layout, -5.0, A_log, dt_bias)
    torch.cuda.synchronize()
    assert_workspace_close(ws, ref)


def assert_workspace_close(ws, ref):
    """A kernel's workspace against the emulation's (used chunks only); rows past a partial chunk's end are zero."""
    layout = ws.layout
    used = int(layout.seq_chunks[-1])  # the surplus varlen chunks are never read
    for name, ratio in (("kd", 2e-3), ("qd", 2e-3), ("kr", 2e-3), ("beta", 1e-5), ("glast", 1e-4),
                        ("mqk", 5e-3), ("inv", 5e-3)):
        x, r = getattr(ws, name), getattr(ref, name)
        if x.shape[0] == layout.num_chunks:
            x, r = x[:used], r[:used]
        assert_close(name, r.float(), x.float(), ratio)
    last = layout.chunk_index[:used, 2] < layout.chunk
    for c in torch.nonzero(last).flatten().tolist():
        n = int(layout.chunk_index[c, 2])
        assert ws.inv[c, :, n:].abs().sum() == 0 and ws.mqk[c, :, n:].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("B, T, H, cu, a_log, HV", GPU_CASES)
def test_chunk_kda_fwd_v2_matches_fp64(B, T, H, cu, a_log, HV, chunk_size):
    from flashkda.fwd.v2 import chunk_kda_fwd_v2

    cu_t, (q, k, v, g, beta, A_log, dt_bias, h0) = gpu_inputs(B, T, H, cu, a_log, 8, HV)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, cu_seqlens=cu_t, A_log=A_log, dt_bias=dt_bias)
    o, s, _ = chunk_kda_fwd_v2(q, k, v, g, beta, K**-0.5, h0, True, chunk_size=chunk_size, **kw)
    ro, rs = reference.chunk_kda_reference(q, k, v, g, beta, K**-0.5, h0, True, **kw)
    assert_close("o", ro, o, 5e-3 if cu is None else 6e-3)
    assert_close("final_state", rs, s, 1e-2)


def test_layout_derived_tables_are_built_once_per_key():
    layout = cached_chunk_layout(1, 50, torch.tensor([0, 20, 50]), CPU)
    calls = []

    def build():
        calls.append(1)
        return layout.seq_chunks * 2

    first = layout.derived(("double", 1), build)
    assert layout.derived(("double", 1), build) is first and len(calls) == 1
    assert layout.derived(("double", 2), build) is not first and len(calls) == 2
    assert build_chunk_layout(1, 50, torch.tensor([0, 20, 50]), CPU).derived(("double", 1), build) is not first
    # a copy with another field is another layout: it does not share the kept tables
    assert dataclasses.replace(layout, dense=not layout.dense).derived(("double", 1), build) is not first
