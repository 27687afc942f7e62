"""Both forward stages give the fp64 result in every launch configuration their autotuners may pick (intra: pass-2
slice width and warps; state: V tile, warps, pipeline stages of the fused or the state-only kernel, the output
kernel's tiles and product precisions), with a varlen tail chunk and an empty sequence."""

import os

import pytest
import torch

from flashkda import reference
from flashkda.fwd.chunk_fwd import dot_precision_for, work_dtype_for
from flashkda.fwd.intra import CHUNK_SIZE, INTRA_CONFIGS, chunk_kda_fwd_intra
from flashkda.fwd.output import O_CONFIGS
from flashkda.fwd.state import HB_CONFIGS, STATE_CONFIGS, chunk_kda_fwd_state_o
from flashkda.index import build_chunk_index
from flashkda.rounding import PREC_BF16, PREC_HILO, PREC_TF32
from tests.flashkda.kda_cases import TOL, KDACase, assert_close, make_call

#: Triton's interpreter ignores warps and pipeline stages: there each tile shape runs once, on a GPU every
#: configuration.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _per_tile(configs, tile):
    if not INTERPRETED:
        return list(configs)
    first: dict = {}
    for c in configs:
        first.setdefault(tile(c), c)
    return list(first.values())


HB_RUN = _per_tile(HB_CONFIGS, lambda c: c[0])
O_RUN = _per_tile(O_CONFIGS, lambda c: c[:2])

CASES = [KDACase(T=150, H=1, HV=2, K=64, V=64, dtype=dtype, gate="bounded", beta_logits=True, lengths=(70, 0, 80))
         for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("config", STATE_CONFIGS,
                         ids=[f"BV{c[0]}-w{c[1]}-s{c[2]}" for c in STATE_CONFIGS])
@pytest.mark.parametrize("case", CASES, ids=[str(c.dtype)[6:] for c in CASES])
def test_state_stage_configs_match_fp64(config, case, device):
    block_v, num_warps, num_stages = config
    _check(case, device, {}, dict(block_v=min(block_v, case.V), num_warps=num_warps, num_stages=num_stages,
                                  split=False))


@pytest.mark.parametrize("config", HB_RUN, ids=[f"BV{c[0]}-w{c[1]}-s{c[2]}" for c in HB_RUN])
@pytest.mark.parametrize("case", CASES, ids=[str(c.dtype)[6:] for c in CASES])
def test_blocked_state_configs_match_fp64(config, case, device):
    block_v, num_warps, num_stages = config
    _check(case, device, {}, dict(block_v=min(block_v, case.V), num_warps=num_warps, num_stages=num_stages,
                                  split=True))


#: Key widths 32 (one 32-row tile), 128 (two 64-row tiles) and 256 (four), V-first state, GVA, a varlen tail, no
#: initial state.
BLOCKED_CASES = [
    KDACase(T=130, H=1, HV=2, K=32, V=64, dtype=torch.bfloat16, gate="softplus", lengths=(130,)),
    KDACase(T=200, H=1, HV=2, K=128, V=64, dtype=torch.bfloat16, gate="pre", v_first=True),
    KDACase(T=150, H=1, HV=2, K=256, V=32, dtype=torch.bfloat16, gate="bounded", lengths=(85, 65)),
    KDACase(T=150, H=1, HV=2, K=256, V=32, dtype=torch.float32, gate="bounded", lengths=(85, 65)),
    KDACase(T=100, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, gate="pre", h0=False),
]


@pytest.mark.parametrize("precs", [(PREC_BF16, PREC_HILO), (PREC_HILO, PREC_HILO), (PREC_TF32, PREC_TF32)],
                         ids=["bf16-hilo", "hilo-hilo", "tf32-tf32"])
@pytest.mark.parametrize("case", BLOCKED_CASES, ids=[c.id() for c in BLOCKED_CASES])
def test_blocked_state_pass_matches_fp64(case, precs, device):
    """Every key width the blocked pass tiles, at each operand precision offered for half input (fp32 input is
    exact whatever ``precs`` says it would be for half input: its products are fp32)."""
    _check(case, device, {}, dict(block_v=32, split=True,
                                  precs=None if case.dtype == torch.float32 else precs))


@pytest.mark.parametrize("o_hilo", [False, True], ids=["tf32", "hilo"])
@pytest.mark.parametrize("o_config", O_RUN, ids=[f"BV{c[0]}-BK{c[1]}-w{c[2]}" for c in O_RUN])
@pytest.mark.parametrize("case", CASES, ids=[str(c.dtype)[6:] for c in CASES])
def test_split_state_output_configs_match_fp64(o_config, o_hilo, case, device):
    _check(case, device, {}, dict(block_v=32, split=True, o_config=o_config, o_hilo=o_hilo))


#: The interpreter ignores register caps, so each (slice, warps, stacked products) configuration is run once.
INTRA_SHAPES = sorted({c[:3] for c in INTRA_CONFIGS})


@pytest.mark.parametrize("config", INTRA_SHAPES, ids=[f"BS{c[0]}-w{c[1]}{'-merge' * c[2]}" for c in INTRA_SHAPES])
@pytest.mark.parametrize("case", CASES, ids=[str(c.dtype)[6:] for c in CASES])
def test_intra_stage_configs_match_fp64(config, case, device):
    solve_slice, num_warps, merge = config
    _check(case, device, dict(solve_slice=solve_slice, num_warps=num_warps, merge=merge), dict(block_v=32))


def _check(case, device, intra_kw, state_kw):
    key = (repr(case), device, tuple(sorted(intra_kw.items())))
    if key not in _STAGE_INPUTS:
        _STAGE_INPUTS[key] = _stage_inputs(case, device, intra_kw)
    args, kw, index, prec, mid, ro, rs = _STAGE_INPUTS[key]
    with torch.no_grad():
        o, s, _ = chunk_kda_fwd_state_o(*mid, kw.get("initial_state"), True, case.v_first, index, args[0].dtype, prec,
                                        **state_kw)
    assert_close("o", ro, o, TOL[case.dtype])
    assert_close("final_state", rs, s, TOL[case.dtype])


#: ``_stage_inputs`` per (case, device, intra settings): the state-stage configurations of a case share one intra
#: stage and one reference (the interpreted intra stage is most of a check's time).
_STAGE_INPUTS: dict = {}


def _stage_inputs(case, device, intra_kw):
    """One case's inputs, its intra-stage output under ``intra_kw`` and the fp64 reference."""
    args, kw = make_call(case, device)
    q, k, v, g, beta = args
    index = build_chunk_index(case.B, case.T, kw.get("cu_seqlens"), CHUNK_SIZE)
    prec = dot_precision_for(q.dtype)
    with torch.no_grad():
        flags = [kw.get(name, False) for name in ("use_gate_in_kernel", "use_qk_l2norm_in_kernel",
                                                  "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate")]
        mid = chunk_kda_fwd_intra(q, k, v, g, beta, kw.get("A_log"), kw.get("dt_bias"), case.K ** -0.5,
                                  kw.get("lower_bound"), *flags, index, work_dtype_for(q.dtype), prec, **intra_kw)
    ro, rs = reference.chunk_kda_reference(*args, **kw)
    return args, kw, index, prec, mid, ro, rs


@pytest.mark.parametrize("o_hilo", [False, True], ids=["tf32", "hilo"])
@pytest.mark.parametrize("case", [CASES[1], *BLOCKED_CASES[:3]], ids=[c.id() for c in [CASES[1], *BLOCKED_CASES[:3]]])
def test_bf16_intermediates_match_fp64(case, o_hilo, device):
    """The bf16 storage of qg, u, Aqk and v_new (the default for bf16 input) stays within the bf16 budget (the
    interpreter rounds stores to nearest, as the GPU does)."""
    _check(case, device, {}, dict(block_v=32, split=True, o_hilo=o_hilo))
