"""Device-only checks: the compiled kernels (bf16 tensor-core products, which the CPU interpreter cannot run
correctly), fla on the GPU, CUDA-graph capture and the absence of host synchronisation."""

import pytest
import torch

import flashkda
from flashkda import reference
from flashkda.fwd.intra import INTRA_CONFIGS
from flashkda.fwd.output import O_CONFIGS
from flashkda.fwd.state import HB_CONFIGS, STATE_CONFIGS
from tests.flashkda.kda_cases import TOL, KDACase, assert_close, make_call

pytestmark = pytest.mark.gpu

CASES = [
    KDACase(T=8192 // 4, H=4, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="bounded", beta_logits=True),
    KDACase(T=1000, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="softplus", beta_logits=True),
    KDACase(T=777, H=2, HV=2, K=64, V=256, dtype=torch.bfloat16, gate="pre", v_first=True),
    KDACase(T=300, H=1, HV=2, K=256, V=64, dtype=torch.float16, gate="bounded-noA"),
    KDACase(T=500, H=2, HV=2, K=128, V=128, dtype=torch.float32, gate="softplus", beta_logits=True, neg_eig=True),
    KDACase(T=1300 + 547 + 63, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, lengths=(1300, 0, 547, 63),
            gate="bounded", beta_logits=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_chunk_matches_fp64_on_gpu(case):
    args, kw = make_call(case, "cuda")
    with torch.inference_mode():
        o, s = flashkda.chunk_kda(*args, **kw)
        ro, rs = reference.chunk_kda_reference(*args, **kw)
    assert_close("o", ro, o, TOL[case.dtype])
    assert_close("final_state", rs, s, TOL[case.dtype])


def test_varlen_runs_without_host_sync_and_in_a_cuda_graph():
    case = CASES[-1]
    args, kw = make_call(case, "cuda")
    with torch.inference_mode():
        ref_o, ref_s = flashkda.chunk_kda(*args, **kw)  # warm-up compiles outside the capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            flashkda.chunk_kda(*args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, s = flashkda.chunk_kda(*args, **kw)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(s, ref_s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_recurrent_decode_matches_fp64_on_gpu(dtype):
    case = KDACase(B=64, T=1, H=4, HV=8, K=128, V=128, dtype=dtype, gate="bounded", beta_logits=True)
    args, kw = make_call(case, "cuda")
    kw.pop("safe_gate")
    kw.pop("cu_seqlens_cpu", None)
    with torch.inference_mode():
        o, s = flashkda.fused_recurrent_kda(*args, **kw)
        ro, rs = reference.chunk_kda_reference(*args, **kw)
    assert_close("o", ro, o, TOL[dtype])
    assert_close("final_state", rs, s, TOL[dtype])


def _forced_forward(intra_kw, state_kw):
    """The two forward stages on CASES[0], each with the launch keywords given (one configuration forced), against
    the fp64 reference."""
    from flashkda.fwd.chunk_fwd import dot_precision_for, work_dtype_for
    from flashkda.fwd.intra import CHUNK_SIZE, chunk_kda_fwd_intra
    from flashkda.fwd.state import chunk_kda_fwd_state_o
    from flashkda.index import build_chunk_index

    case = CASES[0]
    args, kw = make_call(case, "cuda")
    q = args[0]
    index = build_chunk_index(case.B, case.T, kw.get("cu_seqlens"), CHUNK_SIZE)
    prec = dot_precision_for(q.dtype)
    flags = [kw.get(name, False) for name in ("use_gate_in_kernel", "use_qk_l2norm_in_kernel",
                                              "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate")]
    with torch.inference_mode():
        mid = chunk_kda_fwd_intra(*args, kw.get("A_log"), kw.get("dt_bias"), case.K ** -0.5, kw.get("lower_bound"),
                                  *flags, index, work_dtype_for(q.dtype), prec, **intra_kw)
        o, s, _ = chunk_kda_fwd_state_o(*mid, kw.get("initial_state"), True, case.v_first, index, q.dtype, prec,
                                        **state_kw)
        ro, rs = reference.chunk_kda_reference(*args, **kw)
    assert_close("o", ro, o, TOL[case.dtype])
    assert_close("final_state", rs, s, TOL[case.dtype])


@pytest.mark.parametrize("config", STATE_CONFIGS, ids=[f"BV{c[0]}-w{c[1]}-s{c[2]}" for c in STATE_CONFIGS])
def test_state_stage_configs_match_fp64_on_gpu(config):
    """Every configuration the state-stage autotuner may pick, forced one at a time, on bf16 input."""
    block_v, num_warps, num_stages = config
    _forced_forward({}, dict(block_v=block_v, num_warps=num_warps, num_stages=num_stages, split=False))


@pytest.mark.parametrize("config", HB_CONFIGS, ids=[f"BV{c[0]}-w{c[1]}-s{c[2]}" for c in HB_CONFIGS])
def test_blocked_state_configs_match_fp64_on_gpu(config):
    """Every configuration of the blocked state pass (bf16 input, default operand precisions)."""
    block_v, num_warps, num_stages = config
    _forced_forward({}, dict(block_v=block_v, num_warps=num_warps, num_stages=num_stages, split=True))


@pytest.mark.parametrize("fp32_u", [False, True], ids=["bf16-u", "fp32-u"])
@pytest.mark.parametrize("o_hilo", [False, True], ids=["tf32", "hilo"])
@pytest.mark.parametrize("config", O_CONFIGS, ids=[f"BV{c[0]}-BK{c[1]}-w{c[2]}" for c in O_CONFIGS])
def test_output_kernel_configs_match_fp64_on_gpu(config, o_hilo, fp32_u):
    """Every output-kernel configuration, with bf16 ``v_new`` (inference) and fp32 ``v_new`` (the training forward
    that keeps its states): the hi/lo split of fp32 ``v_new`` that Triton 3.6 compiled wrong at 4 warps (relative
    error up to 0.11) must not come back."""
    _forced_forward(dict(fp32_u=fp32_u), dict(split=True, o_config=config, o_hilo=o_hilo))


@pytest.mark.parametrize("config", INTRA_CONFIGS,
                         ids=[f"BS{c[0]}-w{c[1]}{'-merge' * c[2]}-r{c[3]}" for c in INTRA_CONFIGS])
def test_intra_stage_configs_match_fp64_on_gpu(config):
    """Every configuration the intra-stage autotuner may pick, forced one at a time, on bf16 input."""
    solve_slice, num_warps, merge, maxnreg = config
    _forced_forward(dict(solve_slice=solve_slice, num_warps=num_warps, merge=merge, maxnreg=maxnreg), {})


@pytest.mark.parametrize("case", CASES[:2] + CASES[-1:], ids=[c.id() for c in CASES[:2] + CASES[-1:]])
def test_chunk_matches_fla_on_gpu(case, monkeypatch):
    monkeypatch.setenv("FLASHKDA_DISABLE", "1")
    monkeypatch.setenv("FLA_FLASH_KDA", "0")
    fla_kda = pytest.importorskip("fla.ops.kda")
    args, kw = make_call(case, "cuda")
    with torch.inference_mode():
        o, s = flashkda.chunk_kda(*args, **kw)
        fo, fs = fla_kda.chunk_kda(*args, **kw)
    assert_close("o vs fla", fo, o, 1e-2)
    assert_close("final_state vs fla", fs, s, 1e-2)


@pytest.mark.parametrize("host_copy", ["cu_seqlens_cpu", "reused-cu_seqlens"])
def test_varlen_training_step_runs_without_host_sync(host_copy):
    """A second training step (forward and backward) on the same varlen batch never waits for the device: with
    ``cu_seqlens_cpu``, or with the same ``cu_seqlens`` tensor again (its host copy and layout are kept)."""
    case = CASES[-1]
    args, kw = make_call(case, "cuda")
    if host_copy == "reused-cu_seqlens":
        kw.pop("cu_seqlens_cpu")
    inputs = [x.detach().clone().requires_grad_() for x in args]

    def step():
        o, s = flashkda.chunk_kda(*inputs, **kw)
        return torch.autograd.grad((o, s), inputs, (torch.ones_like(o), torch.ones_like(s)))

    first = step()  # compiles and autotunes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)
